"""The hand-off's sending side in a long-lived child process, so the prefill's process keeps the GIL.

Why: in the prefill worker's process the in-thread sender (baton/wire_send.py) competes for the GIL with
the prefill thread, which launches thousands of kernels from Python: gRPC's Python layer copies every
message under the GIL, and the pool threads re-take it per chunk (benchmarks/gil_probe.py, `send`).
Here the prefill's process only stages each chunk's bytes into a shared-memory ring and posts a 24-byte
control message; framing, hashing, gRPC and its copies run in baton/sender_child.py, a process with its
own GIL that imports no torch (no CUDA). Frames on the wire are byte-identical to the in-thread sender's.

Lifecycle:
    SenderProcess(slots, slot_bytes)   one per prefill worker; the child is spawned on start() or the
                                       first push, and again on the first push after it died
    start_push(target, settings, plan) -> ProcessPush: OPEN (target, settings, header) to the child, then
        a stager thread (per push): wire_send.chunk_segments(plan) -> per chunk: take a free slot (at
        most `per_stream` slots per push), wire_stage.stage_into(slot, segments): CUDA bytes D2H on the
        copy stream gated on each tensor's ready event (ring pinned with cudaHostRegister on first
        use), CPU bytes one copy; CHUNK(slot, index, n) once the copy is done (a CUDA chunk waits one
        chunk behind the copies queued); END(next_token) after the last
    reader thread (per child)          FREE slot -> back on the free list; DONE stream -> that push's
                                       outcome; EOF (the child died or was closed) -> every push in
                                       flight fails with HandoffError(UNAVAILABLE, "... sender process died");
                                       a broken control channel (a message it cannot parse): the child is
                                       killed first (so that wait cannot hang), then the same
    ProcessPush.result(is_active) / cancel()   handoff.Push's contract (CANCEL stops the child's call).
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
import time
from pathlib import Path
from typing import Callable

import grpc
import torch

from baton.handoff import HandoffError
from baton.sender_ipc import CANCEL, CHUNK, DONE, END, FREE, OPEN, READY, Channel, Ring
from baton.settings import Settings
from baton.wire import DEFAULT_CHUNK_BYTES, BridgeStats, default_workers
from baton.wire_frame import header_frame
from baton.wire_send import Plan, chunk_segments
from baton.wire_stage import stage_into

log = logging.getLogger("baton.sender")
DEFAULT_SLOTS = 8
ANSWER_GRACE_S = 10.0   # past a push's deadline: no DONE by then means the child is wedged
CANCEL_SEND_S = 2.0     # a CANCEL not sent by then: the child is not reading its control channel
_ROOT = str(Path(__file__).resolve().parents[1])   # the directory holding the baton package


class _Stop(Exception):
    """The push ended (answered, cancelled, failed) or its child died: stop staging."""


class _Child:
    """One incarnation of the sender process: the process, its ring, its control channel, its reader."""

    def __init__(self, slots: int, slot_bytes: int, per_stream: int, workers: int):
        self.ring = Ring.create(slots, slot_bytes)
        self.buf = torch.frombuffer(self.ring.mm, dtype=torch.uint8)   # [slots * slot_bytes], shared
        self.per_stream = per_stream
        self._pinned: bool | None = None   # None: not tried yet (CUDA untouched)
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT] + ([os.environ["PYTHONPATH"]]
                                                                    if os.environ.get("PYTHONPATH") else [])))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "baton.sender_child", "--control-fd", str(theirs.fileno()),
                 "--ring-fd", str(self.ring.fd), "--slots", str(slots), "--slot-bytes", str(slot_bytes),
                 "--workers", str(workers)],
                pass_fds=(theirs.fileno(), self.ring.fd), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            mine.close()
            self._unmap()
            raise
        finally:
            theirs.close()
        self.conn = Channel(mine)
        self.ready: dict | None = None
        self.dead: str | None = None        # why the child is gone
        self._cv = threading.Condition()
        self._free = list(range(slots))
        self._owner: dict[int, ProcessPush] = {}   # slot -> the push holding it (staging or posted)
        self._pushes: dict[int, ProcessPush] = {}  # stream id -> push in flight
        self._ids = 0
        self._users = 0                            # stagers running: the ring stays mapped for them
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
            pass   # the reader sees the EOF and fails the push
        return True

    def take(self, push: "ProcessPush") -> int:
        with self._cv:
            while self.dead is None and not push.done.is_set() and (not self._free or push.held >= self.per_stream):
                self._cv.wait()
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
        return self.buf[slot * self.ring.slot_bytes:(slot + 1) * self.ring.slot_bytes]

    def pin(self) -> None:
        """Page-locks the ring for async D2H (first CUDA chunk only: a CPU-only process never touches CUDA).
        If the driver refuses, the copies still land (pageable memory: each one then waits on the host)."""
        with self._cv:
            if self._pinned is None:
                r = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)
                self._pinned = int(getattr(r, "value", r)) == 0
                if not self._pinned:
                    log.warning("hand-off sender: cudaHostRegister of the ring failed (%s); D2H copies into it "
                                "are synchronous", r)

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
    def _release(self, slot: int) -> None:   # NOTE: under self._cv
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
                elif kind == READY:
                    self.ready = payload
        except Exception as e:  # noqa: BLE001 - whatever broke the channel, the pushes must not wait forever
            log.error("hand-off sender: control channel failed: %r", e)
            self.kill(f"the hand-off sender's control channel failed ({e!r})")   # NOTE: else wait() may never return
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
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
        self._pinned = False
        self.buf = None   # NOTE: the tensor's export of the mmap goes first
        try:
            self.ring.close()
        except BufferError:   # a view still alive somewhere: the mapping goes with it
            log.warning("hand-off sender: ring still referenced at close")

    def close(self, timeout: float = 10.0) -> None:
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


class ProcessPush:
    """One LoadState call streamed by the sender process; handoff.Push's contract."""

    def __init__(self, target: str, plan: Plan, deserialize: Callable[[bytes], object], position: int,
                 timeout: float, grace: float = ANSWER_GRACE_S):
        self.target, self._plan, self._deserialize, self._position = target, plan, deserialize, position
        self._timeout, self._grace = timeout, grace
        self.sid, self.child, self.held = 0, None, 0   # held: ring slots this push owns (under child._cv)
        self.done = threading.Event()
        self._outcome: dict | None = None
        self._error: BaseException | None = None   # raised while staging (e.g. the prefill failed)
        self._cancelled = False
        self._t0 = time.perf_counter()
        self._stager: threading.Thread | None = None

    def _start(self, child: _Child, meta: dict) -> "ProcessPush":
        if not child.open(self, meta):
            self._finish({"code": "UNAVAILABLE", "details": child.dead, "chunks": 0})
            return self
        self._stager = threading.Thread(target=self._stage, daemon=True, name=f"baton-sender-stage-{self.sid}")
        self._stager.start()
        return self

    def _stage(self) -> None:
        child, p, sid = self.child, self._plan, self.sid
        pending = None   # (slot, index, n, done event): a CUDA chunk whose copy is queued
        try:
            for index, segs in chunk_segments(p.specs, p.tensor_source, p.chunks, p.ready_now):
                n = sum(b - a for _, _, a, b in segs)
                slot = child.take(self)
                try:
                    if any(t.is_cuda for t, _, _, _ in segs):
                        child.pin()
                    n, done = stage_into(child.slot(slot, n), segs)
                except BaseException:
                    child.give(slot)
                    raise
                if pending is not None:
                    pending[3].synchronize()   # NOTE: no GIL while waiting
                    child.post(CHUNK, sid, *pending[:3])
                    pending = None
                if done is not None:
                    pending = (slot, index, n, done)
                else:
                    child.post(CHUNK, sid, slot, index, n)
            if pending is not None:
                pending[3].synchronize()
                child.post(CHUNK, sid, *pending[:3])
                pending = None
            token = p.token()
            if not 0 <= token < 1 << 63:
                raise ValueError(f"next_token {token} out of range")
            child.post(END, sid, n=token)
        except _Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - result() raises it
            self._error = e
            self.cancel()
        finally:
            if pending is not None:
                if pending[3] is not None:
                    pending[3].synchronize()   # the copy must land before the slot is reused
                child.give(pending[0])
            child.leave()

    def _finish(self, outcome: dict) -> None:
        self._outcome = outcome
        self.done.set()
        with self.child._cv:
            self.child._cv.notify_all()   # a stager waiting for a slot stops

    def cancel(self) -> None:
        self._cancelled = True
        if not self.done.is_set() and self.child is not None:
            try:
                self.child.conn.send(CANCEL, self.sid, timeout=CANCEL_SEND_S)
            except TimeoutError:
                self.child.kill(f"the hand-off sender process does not read its control channel (a CANCEL "
                                f"waited {CANCEL_SEND_S:g} s)")
            except OSError:
                pass

    def result(self, is_active: Callable[[], bool] | None = None):
        """(the decode worker's answer, BridgeReport), or HandoffError as handoff.Push.result; never waits
        more than the push's timeout + grace (a wedged child: killed, DEADLINE_EXCEEDED)."""
        deadline = self._t0 + self._timeout + self._grace
        while not self.done.wait(0.05):
            if is_active is not None and not is_active():
                self.cancel()
                raise HandoffError(self.target, grpc.StatusCode.CANCELLED, "the calling RPC ended")
            if time.perf_counter() > deadline and not self.done.is_set():
                why = (f"the hand-off sender process gave no answer {self._grace:g} s past the call's deadline "
                       f"({self._timeout:g} s)")
                if self.child is not None:
                    self.child.kill(why)
                self._finish({"code": "DEADLINE_EXCEEDED", "details": why, "chunks": 0})   # the stager stops
                raise HandoffError(self.target, grpc.StatusCode.DEADLINE_EXCEEDED, why)
        o = self._outcome
        if o["code"] != "OK":
            if self._error is not None:
                raise self._error
            if o["code"] == "CANCELLED" and self._cancelled:
                raise HandoffError(self.target, grpc.StatusCode.CANCELLED, "hand-off cancelled")
            raise HandoffError(self.target, grpc.StatusCode[o["code"]], o["details"])
        stats = BridgeStats.from_specs(self._plan.specs, tokens=self._position, chunks=o["chunks"],
                                       seconds=time.perf_counter() - self._t0)
        return self._deserialize(base64.b64decode(o["response"])), stats.to_proto()

    def join(self, timeout: float | None = None) -> None:
        """Waits for the stager thread (it ends once the source is exhausted or the push ended)."""
        if self._stager is not None:
            self._stager.join(timeout)


class SenderProcess:
    """The prefill worker's sender process, respawned on the first push after it died; close() on shutdown.
    slot_bytes bounds the chunk size it carries (fits()); per_stream: ring slots one push may hold."""

    def __init__(self, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_CHUNK_BYTES,
                 per_stream: int | None = None, workers: int | None = None, answer_grace_s: float = ANSWER_GRACE_S):
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

    def start_push(self, target: str, settings: Settings, plan: Plan, *, method: str,
                   deserialize: Callable[[bytes], object], timeout: float, position: int) -> ProcessPush:
        if not self.fits(plan.header.chunk_bytes):
            raise ValueError(f"chunk_bytes {plan.header.chunk_bytes} > the sender ring's slots ({self.slot_bytes})")
        meta = {"target": target, "method": method, "timeout": timeout, "settings": dataclasses.asdict(settings),
                "header": base64.b64encode(header_frame(plan.header)).decode()}
        json.dumps(meta)   # NOTE: fails here, not in the child, if a setting is not plain data
        return ProcessPush(target, plan, deserialize, position, timeout, self.answer_grace_s)._start(self.child(), meta)

    def close(self) -> None:
        with self._lock:
            self._closed, child, self._child = True, self._child, None
        if child is not None:
            child.close()
