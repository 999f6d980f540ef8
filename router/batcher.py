"""The router's round batcher: exact mode's Draft (or Verify) calls of many sessions to one worker, sent as one
DraftMany (VerifyMany) RPC instead of one RPC each.

    b = batcher_of(worker, "Draft")          # one per worker and method (Worker.batchers); None: not batched
    ticket = b.submit(session_id, request, timeout)
    response = ticket.result()               # the item's own DraftResponse, or raises (below)
    forget(session_id, worker, ...)          # the session left these workers (finished, migrated)

Why: each unary call costs the router's and the worker's process CPU, all under their GILs, and a round's
calls then reach the worker one by one: at 32 exact sessions on an H100 the Draft leader waited ~21 ms a
round for the last of them (benchmarks/results/gpu-h100-2026-12-06-slim-xm.md). One RPC a worker a round
takes the per-call cost once: a round of 32 sessions' Draft calls, client and server in one process on a
2-core VM, 637 us of CPU a session and 15.4 ms a round as unary calls, 86 us and 2.8 ms as one DraftMany
(benchmarks/bench_round_batcher.py, results/round-batcher-cpu-2026-12-06.json).

Lifecycle of a batch: the first caller to wait for its item's answer (Ticket.result) while its item is queued and
no batch is forming leads the batch; a submitter need not wait at once (exact mode submits the next round's
Draft before it sends the round's tokens: router/exact.py), and its queued item goes with whoever leads. The
leader waits until every
live session of this batcher that may come is queued (live: submitted within LIVE_S and not forgotten; may
come: not waiting on a batch elsewhere, such as its Verify while this is a Draft batcher: where the two
workers' rounds pipeline, half the sessions are always there; exact sessions submit once a round, so in
lockstep they are all here at once and nobody waits), or until SETTLE_S passed
with no new item, at most MAX_WAIT_S; then it takes the queue (every item queued so far, whether its
caller waits or not), and the next caller to wait for an item queued after that leads the next batch while
this one is in flight. Taking the queue and giving up the lead are one step under the batcher's lock, so a
caller that finds a batch forming has its item in it. The leader sends the batch (its timeout: the longest of its items'), and
hands each item its outcome. A worker that answers UNIMPLEMENTED (an older build) is not batched again:
its items, and later calls, go as unary calls (Calls.batched). Splitting a round into two batches costs no
tokens and little time: the workers' gathers merge concurrent calls (baton/engine/gather.py: the Draft
round barrier, the Verify round groups).

An item's outcome: its response; ItemError (an RpcError with the item's own code and details: the caller
triages it as it would its unary call's); the whole RPC's RpcError; Unbatched (send it as a unary call).
A ticket's own deadline is the caller's: result() raises a DEADLINE_EXCEEDED ItemError when it passes,
whatever the batch still does. cancel() (the client went away) wakes its caller with CancelledError; a
queued item is dropped, one in flight is answered to nobody (the router releases the session anyway).
Batch invariance is the workers': a session's drafts and verdict are the same in any batch.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc

from baton.v1 import decode_pb2, prefill_pb2

LIVE_S = 0.5  # a session that submitted within this long is expected in the next batch (unless forgotten)
SETTLE_S = 0.0015  # a leader missing someone sends once no item arrived for this long ...
MAX_WAIT_S = 0.008  # ... and at most this long after it started leading
log = logging.getLogger("baton.router")
ENV = "BATON_BATCHED_ROUNDS"  # "0": exact mode's Draft / Verify go as unary calls (A/B)

# method -> (its batched method, that method's request type)
METHODS = {
    "Draft": ("DraftMany", decode_pb2.DraftManyRequest),
    "Verify": ("VerifyMany", prefill_pb2.VerifyManyRequest),
}
_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def batcher_of(worker, method: str) -> "RoundBatcher | None":
    """The worker's batcher of `method` (made on first use), or None: not batched (ENV off, not a round
    method, or the worker answered UNIMPLEMENTED)."""
    if method not in METHODS or not enabled():
        return None
    with _LOCK:
        b = worker.batchers.get(method)
        if b is None:
            b = worker.batchers[method] = RoundBatcher(worker, method)
    return None if b.unsupported else b


def forget(sid: str, *workers) -> None:
    """Session `sid` left these workers (its request ended, it migrated): their batchers stop expecting it."""
    for w in workers:
        for b in list(w.batchers.values()):
            b.forget(sid)


class ItemError(grpc.RpcError):
    """One item's status inside a batched RPC, or its own deadline: triaged as its unary call's RpcError."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Unbatched(Exception):
    """The worker does not serve the batched method: send this item as a unary call."""


class CancelledError(grpc.FutureCancelledError):
    """The ticket was cancelled (its client went away): as a cancelled grpc future's result()."""


_CODES = {c.value[0]: c for c in grpc.StatusCode}
# session id -> the Ticket its caller waits on (any batcher): a session waiting on another worker's batch
# (its Verify, while this is the Draft batcher) cannot come now, so no leader waits for it
_BUSY: dict = {}
_BUSY_LOCK = threading.Lock()


def _unbusy(t: "Ticket") -> None:
    """t's session no longer waits on t (answered, or its caller stopped waiting)."""
    with _BUSY_LOCK:
        if _BUSY.get(t.sid) is t:
            del _BUSY[t.sid]


class Ticket:
    __slots__ = ("sid", "request", "deadline", "timeout", "done", "outcome", "cancelled", "batcher", "sent", "answered")

    def __init__(self, batcher: "RoundBatcher", sid: str, request, timeout: float):
        self.batcher, self.sid, self.request = batcher, sid, request
        self.timeout, self.deadline = timeout, time.monotonic() + timeout
        self.done = threading.Event()
        self.outcome = None  # the response, or the exception to raise
        self.cancelled = False
        self.sent = False  # taken into a batch (in flight or answered)
        self.answered = 0.0  # time.monotonic() when its outcome came (0: not yet)

    def cancel(self) -> None:
        """Wakes its caller with CancelledError; an item not yet sent leaves the queue (nobody counts it)."""
        self.batcher._drop(self)
        self.done.set()

    def abandon(self) -> None:
        """Cancelled before (or instead of) its caller waiting: dropped from a batch not yet sent, answered to
        nobody if one is in flight; its session no longer counts as busy here."""
        self.cancel()
        _unbusy(self)

    def result(self):
        """Waits for the outcome (leading a batch first if this item is queued and none is forming)."""
        try:
            self.batcher._lead(self)
            if not self.done.wait(max(0.0, self.deadline - time.monotonic())):
                raise ItemError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout:.1f}s")
        finally:
            _unbusy(self)
        if self.cancelled:
            raise CancelledError()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class RoundBatcher:
    def __init__(self, worker, method: str):
        self.worker, self.method = worker, method
        self.many, self.request_type = METHODS[method]
        self.unsupported = False
        self._cv = threading.Condition()
        self._queue: list[Ticket] = []
        self._leading = False
        self._last_arrival = 0.0
        self._seen: dict[str, float] = {}  # session id -> its last submit
        self.batches = 0  # stats: batched RPCs sent and the items in them
        self.items = 0

    def submit(self, sid: str, request, timeout: float) -> Ticket:
        t = Ticket(self, sid, request, timeout)
        with self._cv:
            now = self._last_arrival = time.monotonic()
            self._seen[sid] = now
            with _BUSY_LOCK:
                _BUSY[sid] = t
            self._queue.append(t)
            if self._leading:
                self._cv.notify()  # the forming batch's leader counts its queue again
        return t

    def _drop(self, t: Ticket) -> None:
        with self._cv:
            t.cancelled = True
            if not t.sent and t in self._queue:
                self._queue.remove(t)

    def forget(self, sid: str) -> None:
        with self._cv:
            if self._seen.pop(sid, None) is not None:
                self._cv.notify()

    def _expected(self, now: float) -> int:
        """Under _cv: the live sessions (module doc); long-gone ones are dropped."""
        for sid in [s for s, t in self._seen.items() if now - t > 8 * LIVE_S]:
            del self._seen[sid]
        return sum(1 for sid, t in self._seen.items() if now - t <= LIVE_S and self._may_come(sid))

    def _may_come(self, sid: str) -> bool:
        """Whether live session `sid` may still join the batch forming here: not waiting on another batch (of
        another batcher, or one of this batcher's already sent), or queued here."""
        t = _BUSY.get(sid)
        return t is None or (t.batcher is self and not t.sent)

    def _lead(self, t: Ticket) -> None:
        """t's caller: leads a batch if t waits in the queue and no batch is forming (else returns at once)."""
        with self._cv:
            if t.sent or t.cancelled or self._leading:
                return
            self._leading = True
            start = time.monotonic()
            while True:
                now = time.monotonic()
                if len(self._queue) >= self._expected(now):
                    break
                left = min(self._last_arrival + SETTLE_S, start + MAX_WAIT_S) - now
                if left <= 0:
                    break
                self._cv.wait(left)
            batch = [x for x in self._queue if not x.cancelled]
            for x in batch:
                x.sent = True
            self._queue, self._leading = [], False
        if batch:
            self._send(batch)

    def _send(self, batch: list[Ticket]) -> None:
        req = self.request_type(requests=[t.request for t in batch])
        timeout = max(t.deadline for t in batch) - time.monotonic()
        try:
            resp = getattr(self.worker.stub, self.many)(req, timeout=max(timeout, 0.001))
            if len(resp.outcomes) != len(batch):
                raise ItemError(
                    grpc.StatusCode.INTERNAL, f"{self.many}: {len(resp.outcomes)} outcomes for {len(batch)}"
                )
            outcomes = [
                o.response
                if not o.status.code
                else ItemError(_CODES.get(o.status.code, grpc.StatusCode.UNKNOWN), o.status.message)
                for o in resp.outcomes
            ]
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True
                e = Unbatched()
            outcomes = [e] * len(batch)
        except ValueError:  # "Channel closed": the worker left the pool
            outcomes = [ItemError(grpc.StatusCode.UNAVAILABLE, "worker removed from the pool")] * len(batch)
        except Exception as e:  # noqa: BLE001 - a bug here must not leave the other callers waiting
            log.exception("%s to %s failed", self.many, self.worker.address)
            outcomes = [ItemError(grpc.StatusCode.INTERNAL, f"router: {self.many}: {type(e).__name__}: {e}")] * len(
                batch
            )
        self.batches += 1
        self.items += len(batch)
        now = time.monotonic()
        for t, o in zip(batch, outcomes):
            t.outcome, t.answered = o, now
            _unbusy(t)  # answered: its caller comes back to a batcher soon (it may come again)
            t.done.set()
