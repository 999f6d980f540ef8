"""One LoadState call streamed by the hand-off sender process (baton/handoff/sender/process.py): its stager thread
and its outcome, with handoff.Push's contract (result(is_active) / cancel() / join()).

    stager thread   encode.chunk_segments(plan) -> per chunk: a free ring slot of the child
                    (_Child.take), stage_into (CUDA: D2H on the copy stream, posted one chunk behind the
                    copies queued; CPU: one copy), CHUNK(slot, index, n); END(next_token) after the last
    result()        waits for the child's DONE; never past the call's timeout + grace (a wedged child is
                    killed: DEADLINE_EXCEEDED); a caller that went away: CANCEL, then CANCELLED
With a timeline (baton/handoff/timeline.py; the push's `timeline` is not None), the stager stamps the last chunk's
prefill.last_chunk_ready / _slot / _staged, prefill.end_posted and each CHUNK post (series prefill.staged);
result() merges the child's marks (its DONE JSON) and the receiver's (the LoadState answer's bridge).
"""

from __future__ import annotations

import base64
import threading
import time
from typing import TYPE_CHECKING, Callable

import grpc

from baton.handoff.admission import wait_admitted
from baton.handoff.encode import Plan, chunk_segments
from baton.handoff.push import HandoffError
from baton.handoff.sender.ipc import CANCEL, CHUNK, END
from baton.handoff.staging import stage_into
from baton.handoff.timeline import CLOCK_ID, Timeline, now
from baton.handoff.wire import BridgeStats

if TYPE_CHECKING:
    from baton.handoff.sender.process import _Child

ANSWER_GRACE_S = 10.0  # past a push's deadline: no DONE by then means the child is wedged
CANCEL_SEND_S = 2.0  # a CANCEL not sent by then: the child is not reading its control channel


class _Stop(Exception):
    """The push ended (answered, cancelled, failed) or its child died: stop staging."""


class ProcessPush:
    """One LoadState call streamed by the sender process; handoff.Push's contract."""

    def __init__(
        self,
        target: str,
        plan: Plan,
        deserialize: Callable[[bytes], object],
        position: int,
        timeout: float,
        grace: float = ANSWER_GRACE_S,
        timeline: bool = False,
    ):
        self.target, self._plan, self._deserialize, self._position = target, plan, deserialize, position
        self._timeout, self._grace = timeout, grace
        self.sid, self.child, self.held = 0, None, 0  # held: ring slots this push owns (under child._cv)
        self.done = threading.Event()
        self.admission = threading.Event()  # ADMIT from the child: the decode worker reserved the slot
        self._outcome: dict | None = None
        self._error: BaseException | None = None  # raised while staging (e.g. the prefill failed)
        self._cancelled = False
        self._t0 = time.perf_counter()
        self._stager: threading.Thread | None = None
        self.timeline = Timeline({"prefill": CLOCK_ID}) if timeline else None

    def _start(self, child: "_Child", meta: dict) -> "ProcessPush":
        if not child.open(self, meta):
            self._finish({"code": "UNAVAILABLE", "details": child.dead, "chunks": 0})
            return self
        self._stager = threading.Thread(target=self._stage, daemon=True, name=f"baton-sender-stage-{self.sid}")
        self._stager.start()
        return self

    def _stage(self) -> None:
        child, p, sid, tl = self.child, self._plan, self.sid, self.timeline
        pending = None  # (slot, index, n, done event): a CUDA chunk whose copy is queued
        staged: list[int] = []  # with a timeline: each chunk staged (stamped just before its CHUNK)
        ready = got = 0  # ... when the latest chunk's tensors were pulled / its slot taken
        try:
            for index, segs in chunk_segments(p.specs, p.tensor_source, p.chunks, p.ready_now):
                n = sum(b - a for _, _, a, b in segs)
                if tl is not None:
                    ready = now()
                slot = child.take(self)
                if tl is not None:
                    got = now()
                try:
                    pinned = any(t.is_cuda for t, _, _, _ in segs) and child.pin()
                    n, done = stage_into(child.slot(slot, n), segs, by_address=pinned)
                except BaseException:
                    child.give(slot)
                    raise
                if pending is not None:
                    pending[3].synchronize()  # NOTE: no GIL while waiting
                    if tl is not None:  # NOTE: each stamp before its message: the child reads it after
                        staged.append(now())
                    child.post(CHUNK, sid, *pending[:3])
                    pending = None
                if done is not None:
                    pending = (slot, index, n, done)
                else:
                    if tl is not None:
                        staged.append(now())
                    child.post(CHUNK, sid, slot, index, n)
            if pending is not None:
                pending[3].synchronize()
                if tl is not None:
                    staged.append(now())
                child.post(CHUNK, sid, *pending[:3])
                pending = None
            token = p.token()
            if not 0 <= token < 1 << 63:
                raise ValueError(f"next_token {token} out of range")
            end = now() if tl is not None else 0
            child.post(END, sid, n=token)
            if tl is not None:
                tl.update(
                    {
                        "prefill.end_posted": end,
                        "prefill.last_chunk_ready": ready,
                        "prefill.last_chunk_slot": got,
                        "prefill.last_chunk_staged": staged[-1],
                    }
                    if staged
                    else {},
                    series={"prefill.staged": staged},
                )
        except _Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - result() raises it
            self._error = e
            self.cancel()
        finally:
            if pending is not None:
                if pending[3] is not None:
                    pending[3].synchronize()  # the copy must land before the slot is reused
                child.give(pending[0])
            child.leave()

    def _finish(self, outcome: dict) -> None:
        if self.timeline is not None:
            self.timeline.mark("prefill.reply_received")
        self._outcome = outcome
        self.done.set()
        with self.child._cv:
            self.child._cv.notify_all()  # a stager waiting for a slot stops

    def cancel(self) -> None:
        self._cancelled = True
        if not self.done.is_set() and self.child is not None:
            try:
                self.child.conn.send(CANCEL, self.sid, timeout=CANCEL_SEND_S)
            except TimeoutError:
                self.child.kill(
                    f"the hand-off sender process does not read its control channel (a CANCEL "
                    f"waited {CANCEL_SEND_S:g} s)"
                )
            except OSError:
                pass

    def admitted(self, is_active: Callable[[], bool] | None = None) -> bool:
        """handoff.Push.admitted: the child relays the decode worker's admission (ADMIT)."""
        return wait_admitted(self.admission, self.done.is_set, is_active)

    def result(self, is_active: Callable[[], bool] | None = None):
        """(the decode worker's answer, BridgeReport), or HandoffError as handoff.Push.result; never waits
        more than the push's timeout + grace (a wedged child: killed, DEADLINE_EXCEEDED)."""
        deadline = self._t0 + self._timeout + self._grace
        while not self.done.wait(0.05):
            if is_active is not None and not is_active():
                self.cancel()
                raise HandoffError(self.target, grpc.StatusCode.CANCELLED, "the calling RPC ended")
            if time.perf_counter() > deadline and not self.done.is_set():
                why = (
                    f"the hand-off sender process gave no answer {self._grace:g} s past the call's deadline "
                    f"({self._timeout:g} s)"
                )
                if self.child is not None:
                    self.child.kill(why)
                self._finish({"code": "DEADLINE_EXCEEDED", "details": why, "chunks": 0})  # the stager stops
                raise HandoffError(self.target, grpc.StatusCode.DEADLINE_EXCEEDED, why)
        o = self._outcome
        if o["code"] != "OK":
            if self._error is not None:
                raise self._error
            if o["code"] == "CANCELLED" and self._cancelled:
                raise HandoffError(self.target, grpc.StatusCode.CANCELLED, "hand-off cancelled")
            raise HandoffError(self.target, grpc.StatusCode[o["code"]], o["details"])
        stats = BridgeStats.from_specs(
            self._plan.specs, tokens=self._position, chunks=o["chunks"], seconds=time.perf_counter() - self._t0
        )
        resp, report = self._deserialize(base64.b64decode(o["response"])), stats.to_proto()
        report.draft_only = self._plan.header.draft_only
        if self.timeline is not None:
            self.join(1.0)  # NOTE: the stager stamps its last marks just after END went out
            self.timeline.merge_json(o.get("timeline", {}))
            bridge = getattr(resp, "bridge", None)
            if bridge is not None and bridge.HasField("timeline"):
                self.timeline.merge_proto(bridge.timeline)
            report.timeline.CopyFrom(self.timeline.to_proto())
        return resp, report

    def join(self, timeout: float | None = None) -> None:
        """Waits for the stager thread (it ends once the source is exhausted or the push ended)."""
        if self._stager is not None:
            self._stager.join(timeout)
