"""The line of new requests waiting for a session slot: the router's admission queue.

A new request whose start finds the workers' session slots full (start_session's RESOURCE_EXHAUSTED: every
decode worker full, or the prefill worker's slots) waits here instead of being refused at once, in order of
priority (GenerateRequest.priority, vLLM's: lower first), then first come first served, until a request ends
(its slots are free again) or its wait runs out (RouterConfig.queue_s, or the request's deadline first): then
the refusal stands, as RESOURCE_EXHAUSTED. While anyone waits, a new request joins the line instead of trying
first, behind every waiter of its priority or a lower value, so a waiting request is never passed by a later
one of its own priority or a higher value. A request that is not refused for slots never waits: with the
line empty it tries at once, so prompts arriving together still reach the prefill worker together (batched
prefill). Running requests are never preempted.

    line = SlotLine(queue_s)
    h = line.start(lambda: start_session(...), deadline, cancelled, priority=0)   # start_session's handle
    line.freed()                                                       # a request ended (its Calls closed)

Lifecycle of a waiter: joins at its priority's tail; waits until it is the head and either it has not tried yet, a
request ended since its last try, or RETRY_S passed (slots freed elsewhere: a TTL, another router); tries; refused again for slots: waits for the next end; anything else
(started, another error, cancelled, its wait out) leaves the line, and the next head tries at once (one end
may have freed several slots). A restart or migration of a running request does not queue (router/exact.py):
it holds its place already.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from typing import Callable, TypeVar

import grpc

from baton.rpc import StatusError
from router.calls import Cancelled

T = TypeVar("T")
POLL_S = 0.1  # how often a waiter looks at its request's cancellation
RETRY_S = 0.5  # the head tries again this often without an end seen here (slots freed by TTLs, other routers)


def refused_for_slots(e: StatusError) -> bool:
    return e.code == grpc.StatusCode.RESOURCE_EXHAUSTED


class SlotLine:
    def __init__(self, wait_s: float):
        self.wait_s = wait_s  # the longest a request waits in line (0: refuse at once, as before the line)
        self._cv = threading.Condition()
        self._line: list[tuple[int, int]] = []  # the waiters' (priority, arrival number), sorted: the head first
        self._arrivals = itertools.count()
        self._ends = 0  # requests ended so far (freed)
        self.waited = 0  # requests that joined the line, and of those the ones that started from it
        self.started = 0

    def __len__(self) -> int:
        return len(self._line)

    def freed(self) -> None:
        """A request ended: its sessions are released, so a waiting head may try again."""
        with self._cv:
            self._ends += 1
            self._cv.notify_all()

    def start(
        self,
        attempt: Callable[[], T],
        deadline: float,
        cancelled: Callable[[], bool] = lambda: False,
        priority: int = 0,
    ) -> T:
        """attempt() (start_session), in line when the slots are full (module doc). deadline: time.monotonic()
        by which the request must end; priority: its place in line (lower first). Raises what attempt raises;
        Cancelled when cancelled while waiting."""
        with self._cv:
            direct, seen = not self._line, self._ends
        last: StatusError | None = None
        if direct:
            try:
                return attempt()
            except StatusError as e:
                if not refused_for_slots(e) or self.wait_s <= 0:
                    raise
                last = e
        t0 = time.monotonic()
        tried = t0
        end = min(deadline, t0 + self.wait_s)
        with self._cv:
            me = (priority, next(self._arrivals))
            bisect.insort(self._line, me)
            self.waited += 1
        try:
            while True:
                with self._cv:
                    while not (
                        self._line[0] == me
                        and (last is None or self._ends > seen or time.monotonic() >= tried + RETRY_S)
                    ):
                        if cancelled():
                            raise Cancelled()
                        left = end - time.monotonic()
                        if left <= 0:
                            ahead = self._line.index(me)
                            why = last.message if last is not None else "the workers' session slots are in use"
                            raise StatusError(
                                grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{why} (waited {time.monotonic() - t0:.1f}s in line, {ahead} ahead)",
                            )
                        self._cv.wait(min(left, POLL_S))
                    seen, tried = self._ends, time.monotonic()
                try:
                    h = attempt()
                except StatusError as e:
                    if not refused_for_slots(e):
                        raise
                    last = e
                    continue
                with self._cv:
                    self.started += 1
                return h
        finally:
            with self._cv:
                self._line.remove(me)
                self._cv.notify_all()
