"""The hand-off's sending side in a long-lived child process, so the prefill's process keeps the GIL.

Why: in the prefill worker's process the in-thread sender (baton/handoff/encode.py) competes for the GIL with
the prefill thread, which launches thousands of kernels from Python: gRPC's Python layer copies every
message under the GIL, and the pool threads re-take it per chunk (benchmarks/gil_probe.py, `send`).
Here the prefill's process only stages each chunk's bytes into a shared-memory ring and posts a 24-byte
control message; framing, hashing, gRPC and its copies run in baton/handoff/sender/child.py, a process with its
own GIL that imports no torch (no CUDA). Frames on the wire are byte-identical to the in-thread sender's.

Lifecycle:
    SenderProcess(slots, slot_bytes)   one per prefill worker; the child is spawned on start() or the
                                       first push, and again on the first push after it died
    start_push(target, settings, plan) -> ProcessPush: OPEN (target, settings, header) to the child, then
        a stager thread (per push): encode.chunk_segments(plan) -> per chunk: take a free slot (at
        most `per_stream` slots per push, and only while the push is one of the `streams` = slots / 2
        oldest pushes staging, each then holding at most its share of the ring: FIFO admission, so
        later streams never fill the ring), staging.stage_into(slot, segments): CUDA bytes D2H on the
        copy stream gated on each tensor's ready event (ring pinned with cudaHostRegister on first
        use), CPU bytes one copy; CHUNK(slot, index, n) once the copy is done (a CUDA chunk waits one
        chunk behind the copies queued); END(next_token) after the last
    reader thread (per child)          FREE slot -> back on the free list; DONE stream -> that push's
                                       outcome; EOF (the child died or was closed) -> every push in
                                       flight fails with HandoffError(UNAVAILABLE, "... sender process died");
                                       a broken control channel (a message it cannot parse): the child is
                                       killed first (so that wait cannot hang), then the same
    ProcessPush.result(is_active) / cancel()   (baton/handoff/sender/stream.py) handoff.Push's contract (CANCEL stops the child's call).
        Never waits past the push's deadline: the child's call has that deadline, so its DONE comes by then;
        none `answer_grace_s` later (or a CANCEL the child does not take within 2 s) means the child is
        wedged: it is killed (every push on it fails, the next push starts a new one) and result() raises
        HandoffError(DEADLINE_EXCEEDED)
Where the prefill's process takes the GIL per chunk: the stager (take a slot, a few torch calls, which
release it while they copy, one sendall of 24 bytes) and the reader (one FREE message). No pass over
the bytes runs under it; none of gRPC's Python runs here at all.
Shared memory: a memfd (never under /dev/shm); unmapped here once the child is gone and no stager
still uses it; the kernel frees it with the last mapping, so a kill -9 on either side leaks nothing.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

from baton.handoff.encode import Plan
from baton.handoff.frames import header_frame
from baton.handoff.sender.ipc import ADMIT, DONE, FREE, OPEN, READY, Channel, Ring
from baton.handoff.sender.stream import ANSWER_GRACE_S, ProcessPush, _Stop
from baton.handoff.wire import DEFAULT_CHUNK_BYTES, default_workers
from baton.settings import DEFAULT_RING_SLOTS, Settings

log = logging.getLogger("baton.sender")
_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding the baton package


class _Child:
    """One incarnation of the sender process: the process, its ring, its control channel, its reader."""

    def __init__(self, slots: int, slot_bytes: int, per_stream: int, workers: int):
        self._unmapped = threading.Lock()  # held once the ring is unmapped: _unmap runs once
        self.ring = Ring.create(slots, slot_bytes)
        self.buf = torch.frombuffer(self.ring.mm, dtype=torch.uint8)  # [slots * slot_bytes], shared
        self.per_stream = per_stream
        self._pinned: bool | None = None  # None: not tried yet (CUDA untouched)
        mine, theirs = socket.socketpair()
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([_ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        )
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "baton.handoff.sender.child",
                    "--control-fd",
                    str(theirs.fileno()),
                    "--ring-fd",
                    str(self.ring.fd),
                    "--slots",
                    str(slots),
                    "--slot-bytes",
                    str(slot_bytes),
                    "--workers",
                    str(workers),
                ],
                pass_fds=(theirs.fileno(), self.ring.fd),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            mine.close()
            self._unmap()
            raise
        finally:
            theirs.close()
        self.conn = Channel(mine)
        self.ready: dict | None = None
        self.dead: str | None = None  # why the child is gone
        self._cv = threading.Condition()
        self._free = list(range(slots))
        self._owner: dict[int, ProcessPush] = {}  # slot -> the push holding it (staging or posted)
        self._order: list[ProcessPush] = []  # pushes that asked for slots, oldest first (take's admission)
        self.streams = max(1, slots // 2)  # pushes staging at once (FIFO admission, _admitted)
        self._pushes: dict[int, ProcessPush] = {}  # stream id -> push in flight
        self._ids = 0
        self._users = 0  # stagers running: the ring stays mapped for them
        self.reader = threading.Thread(target=self._read, daemon=True, name=f"baton-sender-reader-{self.proc.pid}")
        self.reader.start()

    # ---- prefill side: the stager's calls ----------------------------------------------------------
    def open(self, push: "ProcessPush", meta: dict) -> bool:
        """Registers the push and sends OPEN; False if the child is already gone."""
        with self._cv:
            push.child = self
            if self.dead is not None:
                return False
            self._ids += 1
            push.sid = self._ids
            self._pushes[push.sid] = push
            self._users += 1
        try:
            self.conn.send(OPEN, push.sid, payload=meta)
        except OSError:
            pass  # the reader sees the EOF and fails the push
        return True

    def _admitted(self, push: "ProcessPush") -> bool:
        """Under _cv: the push is one of the `streams` oldest that asked for ring slots and are not done.
        Later pushes wait: with many pushes staging at once (a batched prefill marks every session's layer
        together) they would otherwise fill the ring with chunks of streams the receiver is not reading
        yet, while the streams it is reading wait for slots (a hold-and-wait cycle; seen on the H200 with
        32 sessions in flight)."""
        self._order = [p for p in self._order if not p.done.is_set()]
        if push not in self._order:
            self._order.append(push)
        return self._order.index(push) < self.streams

    def _cap(self) -> int:
        """Under _cv, after _admitted: the slots one admitted push may hold: per_stream when it stages
        alone (a lone hand-off keeps its deep pipeline), an equal share of the ring when several do."""
        share = self.ring.slots // max(1, min(len(self._order), self.streams))
        return max(1, min(self.per_stream, max(2, share)))

    def take(self, push: "ProcessPush") -> int:
        with self._cv:
            while (
                self.dead is None
                and not push.done.is_set()
                and (not self._free or not self._admitted(push) or push.held >= self._cap())
            ):
                self._cv.wait(0.05)  # NOTE: a timeout: a push ending elsewhere (DONE, cancel) admits the next
            if self.dead is not None or push.done.is_set():
                raise _Stop
            slot = self._free.pop()
            self._owner[slot] = push
            push.held += 1
            return slot

    def give(self, slot: int) -> None:
        """A slot the stager took but never posted."""
        with self._cv:
            self._release(slot)

    def slot(self, slot: int, n: int) -> torch.Tensor:
        if n > self.ring.slot_bytes:
            raise ValueError(f"chunk of {n} bytes > ring slot of {self.ring.slot_bytes}")
        return self.buf[slot * self.ring.slot_bytes : (slot + 1) * self.ring.slot_bytes]

    def pin(self) -> bool:
        """Page-locks the ring for async D2H (first CUDA chunk only: a CPU-only process never touches CUDA).
        If the driver refuses, the copies still land (pageable memory: each one then waits on the host).
        -> whether the ring is page-locked."""
        with self._cv:
            if self._pinned is None:
                r = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)
                self._pinned = int(getattr(r, "value", r)) == 0
                if not self._pinned:
                    log.warning(
                        "hand-off sender: cudaHostRegister of the ring failed (%s); D2H copies into it are synchronous",
                        r,
                    )
            return self._pinned

    def post(self, kind: int, sid: int, a: int = 0, b: int = 0, n: int = 0) -> None:
        try:
            self.conn.send(kind, sid, a, b, n)
        except OSError:
            raise _Stop from None

    def kill(self, why: str) -> None:
        """The child is wedged (no answer past a deadline, a control channel it does not read): SIGKILL. The
        reader then fails every push in flight with `why`; the next push starts a new child."""
        with self._cv:
            if self.dead is None:
                self.dead = why
            self._cv.notify_all()
        log.error("hand-off sender: %s; killing it (pid %d)", why, self.proc.pid)
        try:
            self.proc.kill()
        except OSError:
            pass

    def leave(self) -> None:
        """A stager is done with the ring."""
        with self._cv:
            self._users -= 1
            last = self.dead is not None and self._users == 0
        if last:
            self._unmap()

    # ---- the reader thread ------------------------------------------------------------------------
    def _release(self, slot: int) -> None:  # NOTE: under self._cv
        owner = self._owner.pop(slot, None)
        if owner is not None:
            owner.held -= 1
            self._free.append(slot)
            self._cv.notify_all()

    def _read(self) -> None:
        try:
            while (msg := self.conn.recv()) is not None:
                kind, sid, a, _, _, payload = msg
                if kind == FREE:
                    with self._cv:
                        self._release(a)
                elif kind == DONE:
                    with self._cv:
                        push = self._pushes.pop(sid, None)
                        self._cv.notify_all()
                    if push is not None:
                        push._finish(payload)
                elif kind == ADMIT:
                    with self._cv:
                        push = self._pushes.get(sid)
                    if push is not None:
                        push.admission.set()
                elif kind == READY:
                    self.ready = payload
        except Exception as e:  # noqa: BLE001 - whatever broke the channel, the pushes must not wait forever
            log.error("hand-off sender: control channel failed: %r", e)
            self.kill(f"the hand-off sender's control channel failed ({e!r})")  # NOTE: else wait() may never return
        rc = self.proc.wait()
        with self._cv:
            if self.dead is None:
                self.dead = f"the hand-off sender process died (exit code {rc})"
            pushes, self._pushes = list(self._pushes.values()), {}
            self._cv.notify_all()
            last = self._users == 0
        self.conn.close()
        for p in pushes:
            p._finish({"code": "UNAVAILABLE", "details": self.dead, "chunks": 0})
        if last:
            self._unmap()

    def _unmap(self) -> None:
        """Once (the reader's end and the last stager's leave() can both see themselves last: a second
        close of the ring's fd would close whatever file reused its number)."""
        if not self._unmapped.acquire(blocking=False):
            return
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
        self._pinned = False
        self.buf = None  # NOTE: the tensor's export of the mmap goes first
        try:
            self.ring.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            log.warning("hand-off sender: ring still referenced at close")

    def close(self, timeout: float = 3.0) -> None:
        """EOF to the child (it cancels what is in flight and exits), then waits for it and the reader."""
        with self._cv:
            if self.dead is None:
                self.dead = "the hand-off sender process was closed"
        try:
            self.conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.reader.join(timeout)


class SenderProcess:
    """The prefill worker's sender process, respawned on the first push after it died; close() on shutdown.
    slot_bytes bounds the chunk size it carries (fits()); per_stream: ring slots one push may hold."""

    def __init__(
        self,
        slots: int = DEFAULT_RING_SLOTS,
        slot_bytes: int = DEFAULT_CHUNK_BYTES,
        per_stream: int | None = None,
        workers: int | None = None,
        answer_grace_s: float = ANSWER_GRACE_S,
    ):
        self.slots, self.slot_bytes, self.answer_grace_s = slots, slot_bytes, answer_grace_s
        self.per_stream = per_stream or max(1, slots - 2)
        self.workers = default_workers() if workers is None else workers
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._closed = False

    def fits(self, chunk_bytes: int) -> bool:
        return chunk_bytes <= self.slot_bytes

    def child(self) -> _Child:
        """The live child, spawned if there is none (or it died)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("hand-off sender closed")
            if self._child is None or self._child.dead is not None:
                if self._child is not None:
                    log.warning("hand-off sender: %s; starting a new one", self._child.dead)
                    self._child.reader.join(1.0)
                self._child = _Child(self.slots, self.slot_bytes, self.per_stream, self.workers)
            return self._child

    start = child

    def start_push(
        self,
        target: str,
        settings: Settings,
        plan: Plan,
        *,
        method: str,
        deserialize: Callable[[bytes], object],
        timeout: float,
        position: int,
        timeline: bool = False,
    ) -> ProcessPush:
        """timeline: stamp the hand-off's marks here and in the child (baton/handoff/timeline.py), and ask the
        receiver for its own; ProcessPush.result() reports them in the BridgeReport."""
        if not self.fits(plan.header.chunk_bytes):
            raise ValueError(f"chunk_bytes {plan.header.chunk_bytes} > the sender ring's slots ({self.slot_bytes})")
        meta = {
            "target": target,
            "method": method,
            "timeout": timeout,
            "settings": dataclasses.asdict(settings),
            "header": base64.b64encode(header_frame(plan.header)).decode(),
            "timeline": bool(timeline),
        }
        json.dumps(meta)  # NOTE: fails here, not in the child, if a setting is not plain data
        return ProcessPush(target, plan, deserialize, position, timeout, self.answer_grace_s, timeline=timeline)._start(
            self.child(), meta
        )

    def close(self) -> None:
        with self._lock:
            self._closed, child, self._child = True, self._child, None
        if child is not None:
            child.close()
