"""The hand-off sender process: frames state chunks out of the shared ring and streams them to LoadState.

`python -m baton.handoff.sender.child --control-fd C --ring-fd R --slots S --slot-bytes B --workers W`, started by
baton/handoff/sender/process.py (one per prefill worker), never by hand. It imports no torch (so it never
initialises CUDA; READY says so) and no pickle: control messages are baton/handoff/sender/ipc.py's structs and
JSON, tensor bytes only pass through the ring.

Lifecycle of one stream (stream id s), on the threads of this process:
    main thread     OPEN s: a _Stream: its LoadState call starts on a cached channel (one per target and
                    settings; baton/handoff/channels.py: bounded LRU, leased until the call ends), the header
                    frame first. CHUNK s: queued on the stream (or, the stream gone, the slot FREEd at
                    once). END s: queued. CANCEL s: its call cancelled.
    feeder (per stream)  takes queued chunks in order and submits each to the framing pool, at most
                    `workers + 2` framed ahead of gRPC (so a slow receiver holds slots, which throttles
                    the prefill process, instead of piling frames up here)
    pool (W threads)     frames.frame(index, [slot bytes]): the frame bytes and the chunk digest,
                    exactly as the in-process sender frames them; then FREE the slot
    gRPC's request thread  the frames in order, the manifest fed with each digest, then the trailer
    done callback   DONE s: OK with the response bytes, or the call's status code and details
With OPEN's `timeline` set, the call carries `baton-timeline: 1` (the receiver reports its marks) and the
stream stamps the sender.* marks of baton/handoff/timeline.py (the last chunk's in / submitted / framed / handed /
sent, END in, trailer handed / sent, reply; series sender.handed) into DONE's JSON: a few clock reads
per chunk, none without it.
Every slot handed over with CHUNK is FREEd exactly once: after its frame is made, or when its stream
ended first. A stream whose call cannot even start (e.g. an unreadable TLS file) is answered DONE INTERNAL;
the process keeps serving the others. EOF on the control socket (the prefill process closed it or died):
cancel everything, exit; any other error: exit too (never a hang in interpreter teardown), so the parent
sees EOF and fails the pushes in flight.
"""

from __future__ import annotations

import argparse
import base64
import os
import queue
import socket
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

import grpc

from baton.handoff.admission import watch_admission
from baton.handoff.channels import ChannelPool
from baton.handoff.frames import Manifest, frame, trailer_frame
from baton.handoff.sender.ipc import ADMIT, CANCEL, CHUNK, DONE, END, FREE, OPEN, READY, Channel, Ring
from baton.handoff.timeline import CLOCK_ID, now
from baton.handoff.timeline import METADATA as TIMELINE_METADATA
from baton.settings import Settings
from baton.v1 import state_pb2


class _Stream:
    def __init__(
        self,
        sid: int,
        meta: dict,
        conn: Channel,
        ring: Ring,
        pool: ThreadPoolExecutor,
        channel: grpc.Channel,
        depth: int,
        on_end,
    ):
        self.sid, self.conn, self.ring, self.pool, self.on_end = sid, conn, ring, pool, on_end
        self.header = base64.b64decode(meta["header"])
        h = state_pb2.StateChunk.FromString(self.header).header
        self.manifest, self.total = Manifest(h), h.total_bytes
        self.posted: queue.SimpleQueue = queue.SimpleQueue()  # ("chunk", slot, index, n) | ("end", token) | None
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # Future of (frame, digest, made) | ("end", token) | None
        self.window = threading.Semaphore(depth)  # frames made but not yet taken by gRPC
        self.lock, self.closed, self.finished = threading.Lock(), False, threading.Event()
        self.tl = bool(meta.get("timeline"))
        self.marks: dict[str, int] = {}  # with a timeline: baton/handoff/timeline.py's sender.* marks
        self.handed: list[int] = []  # ... when each data chunk was handed to gRPC
        self._in = self._submitted = 0  # ... when the latest chunk was read / submitted to the pool
        self.feeder = threading.Thread(target=self._feed, daemon=True, name=f"baton-sender-feed-{sid}")
        self.feeder.start()
        method = channel.stream_unary(meta["method"], request_serializer=None, response_deserializer=None)
        self.call = method.future(
            self._requests(), timeout=float(meta["timeout"]), metadata=TIMELINE_METADATA if self.tl else None
        )
        self.call.add_done_callback(self._done)
        watch_admission(self.call, lambda: self.conn.send(ADMIT, self.sid))

    def post(self, item) -> None:
        """From the main thread, in order. A chunk for a stream that stopped taking them is freed here."""
        if self.tl and item is not None:
            if item[0] == "chunk":
                self._in = now()
            else:
                self.marks.update({"sender.last_chunk_in": self._in, "sender.end_in": now()})
        with self.lock:
            if not self.closed:
                self.posted.put(item)
                return
        if item is not None and item[0] == "chunk":
            self.conn.send(FREE, a=item[1])

    def _feed(self) -> None:
        try:
            while (item := self.posted.get()) is not None:
                if item[0] == "end":
                    self.out.put(item)
                    return
                _, slot, index, n = item
                while not self.window.acquire(timeout=0.1):
                    if self.finished.is_set():
                        self.conn.send(FREE, a=slot)
                        return
                if self.tl:
                    self._submitted = now()
                self.out.put(self.pool.submit(self._frame, slot, index, n))
        finally:
            with self.lock:
                self.closed = True
            while True:  # NOTE: after closed: nothing is queued any more
                try:
                    item = self.posted.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[0] == "chunk":
                    self.conn.send(FREE, a=item[1])

    def _frame(self, slot: int, index: int, n: int) -> tuple[bytes, bytes, int]:
        """-> (frame, digest, when it was made: with a timeline, else 0)"""
        try:
            with self.ring.view(slot, n) as mv:
                return *frame(index, [mv]), now() if self.tl else 0
        finally:
            self.conn.send(FREE, a=slot)

    def _requests(self):
        tl, framed, handed = self.tl, 0, 0
        yield self.header
        while (x := self.out.get()) is not None:
            if isinstance(x, tuple):  # ("end", next_token)
                last = trailer_frame(self.manifest, self.total, x[1])
                if tl:
                    self.marks["sender.trailer_handed"] = now()
                yield last
                if tl:
                    self.marks["sender.trailer_sent"] = now()
                return
            data, digest, made = x.result()
            self.window.release()
            self.manifest.add(digest)
            if tl:
                framed, handed = made, now()
                self.handed.append(handed)
            yield data
            if tl:  # gRPC asks for the next message once this one's send completed
                self.marks.update(
                    {
                        "sender.last_chunk_submitted": self._submitted,
                        "sender.last_chunk_framed": framed,
                        "sender.last_chunk_handed": handed,
                        "sender.last_chunk_sent": now(),
                    }
                )

    def _done(self, call) -> None:
        self.finished.set()
        self.post(None)
        self.out.put(None)
        msg = {"code": "OK", "details": "", "response": "", "chunks": self.manifest.chunks}
        if call.cancelled():
            msg.update(code="CANCELLED", details="hand-off cancelled")
        elif (e := call.exception()) is not None:
            code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNKNOWN
            details = e.details() if isinstance(e, grpc.RpcError) else repr(e)
            msg.update(code=code.name, details=details or "")
        else:
            msg["response"] = base64.b64encode(call.result()).decode()
        if self.tl:
            self.marks["sender.reply"] = now()
            msg["timeline"] = {
                "marks": {k: v for k, v in self.marks.items() if v},
                "clocks": {"sender": CLOCK_ID},
                "series": {"sender.handed": self.handed},
            }
        self.on_end(self.sid)
        self.conn.send(DONE, self.sid, payload=msg)

    def cancel(self) -> None:
        self.call.cancel()


def serve(conn: Channel, ring: Ring, workers: int) -> None:
    """The main loop: control messages until EOF."""
    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="baton-sender-frame")
    streams: dict[int, _Stream] = {}
    channels = ChannelPool()  # bounded LRU; a stream leases its channel until its call ends
    leases = {}
    lock = threading.Lock()

    def ended(sid: int) -> None:
        with lock:
            streams.pop(sid, None)
            lease = leases.pop(sid, None)
        if lease is not None:
            lease.release()

    conn.send(READY, payload={"pid": os.getpid(), "torch": "torch" in sys.modules})
    try:
        while (msg := conn.recv()) is not None:
            kind, sid, a, b, n, meta = msg
            with lock:
                s = streams.get(sid)
            if kind == OPEN:
                try:
                    settings = Settings(**meta["settings"])
                    lease = channels.lease(meta["target"], settings)
                    with lock:
                        leases[sid] = lease  # NOTE: before the call starts: its done callback ends the lease
                    s = _Stream(sid, meta, conn, ring, pool, lease.channel, max(1, workers) + 2, ended)
                except Exception as e:  # noqa: BLE001 - this stream's failure, not the process's
                    # NOTE: e.g. a TLS file that cannot be read: DONE for this stream (its CHUNKs then find no
                    # stream and are FREEd at once); the child keeps serving the others
                    ended(sid)
                    conn.send(
                        DONE,
                        sid,
                        payload={
                            "code": "INTERNAL",
                            "response": "",
                            "chunks": 0,
                            "details": f"the hand-off sender process could not start the call: {type(e).__name__}: {e}",
                        },
                    )
                    continue
                with lock:
                    if not s.finished.is_set():
                        streams[sid] = s
            elif kind == CHUNK:
                if s is None:
                    conn.send(FREE, a=a)
                else:
                    s.post(("chunk", a, b, n))
            elif kind == END and s is not None:
                s.post(("end", n))
            elif kind == CANCEL and s is not None:
                s.cancel()
    finally:
        with lock:
            live = list(streams.values())
        for s in live:
            s.cancel()
        # NOTE: the channels are not closed: close() can block on a call still finishing, and the process
        # ends with os._exit right after this (the kernel closes the sockets)
        pool.shutdown(wait=False, cancel_futures=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m baton.handoff.sender.child")
    ap.add_argument("--control-fd", type=int, required=True)
    ap.add_argument("--ring-fd", type=int, required=True)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--slot-bytes", type=int, required=True)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args(argv)
    conn = Channel(socket.socket(fileno=a.control_fd))
    ring = Ring(a.ring_fd, a.slots, a.slot_bytes)
    try:
        serve(conn, ring, a.workers)
    except (BrokenPipeError, ConnectionResetError):  # the prefill process went away
        pass
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed; the exit below must happen whatever failed
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # NOTE: no interpreter teardown under gRPC's threads (it can hang with calls in flight, and a child
        # that never exits keeps its control socket open: the parent would see no EOF)
        os._exit(code)
