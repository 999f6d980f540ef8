"""Gather: concurrent calls of one kind run together as one batched call (exact-mode verify blocks on
the prefill worker, Draft calls on the decode worker).

    g = Gather(run_batch, lock, expected=lambda: live_sessions)
    result = g.call(item)        # blocks; run_batch([item, ...]) -> [result, ...] ran it with others

Lifecycle of a call: it is queued; if no call is leading, it leads: it waits until `expected()` calls
are queued or `gather_s` passed (no wait when expected() <= 1), takes every queued call (with `cost`
and `budget`: the queued calls in order while their summed cost fits the budget, at least one; the
rest wait for the next leader, which may be one of them), runs
run_batch on them under `lock`, hands each its result (or the batch's exception), then passes the lead
to a waiting call, if any, and returns. No thread of its own: the callers take turns running batches,
so an idle Gather costs nothing. run_batch must give each item the result it would get alone (batch
invariance is the batch function's: baton/engine/speculation.py verify_blocks, batch.py rows_batch).
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class _Call:
    __slots__ = ("item", "done", "value", "error")

    def __init__(self, item):
        self.item, self.done, self.value, self.error = item, False, None, None


class Gather:
    def __init__(
        self,
        run_batch: Callable[[list], list],
        lock,
        *,
        expected: Callable[[], int] = lambda: 1,
        gather_s: float = 0.002,
        cost: Callable[[object], int] | None = None,
        budget: int = 0,
    ):
        self._run, self._lock, self._expected, self.gather_s = run_batch, lock, expected, gather_s
        self._cost, self.budget = cost, budget  # a batch: queued items in order while their cost <= budget
        self._cv = threading.Condition()
        self._queue: list[_Call] = []
        self._leading = False
        self.batches = 0  # stats: batches run, items in them, the largest
        self.items = 0
        self.max_items = 0

    def call(self, item):
        c = _Call(item)
        with self._cv:
            self._queue.append(c)
            self._cv.notify_all()
        while True:  # a leader's batch may leave this call queued (budget): lead again or wait again
            with self._cv:
                while not c.done and self._leading:
                    self._cv.wait()
                if c.done:
                    break
                self._leading = True
            self._lead()
        if c.error is not None:
            raise c.error
        return c.value

    def _take(self) -> list[_Call]:
        """Under _cv: the next batch off the queue (all of it, or the longest prefix within the budget;
        at least one item)."""
        if self._cost is None or not self.budget:
            batch, self._queue = self._queue, []
            return batch
        total, n = 0, 0
        for c in self._queue:
            total += self._cost(c.item)
            if n and total > self.budget:
                break
            n += 1
        batch, self._queue = self._queue[:n], self._queue[n:]
        return batch

    def _lead(self) -> None:
        try:
            with self._cv:  # let the other expected calls arrive
                end = time.monotonic() + self.gather_s
                while len(self._queue) < self._expected() and (left := end - time.monotonic()) > 0:
                    self._cv.wait(left)
                batch = self._take()
            try:
                with self._lock:
                    values = self._run([c.item for c in batch])
                err = None
            except BaseException as e:  # noqa: BLE001 - every caller of the batch gets it
                values, err = [None] * len(batch), e
            self.batches += 1
            self.items += len(batch)
            self.max_items = max(self.max_items, len(batch))
            with self._cv:
                for c, v in zip(batch, values):
                    c.value, c.error, c.done = v, err, True
        finally:
            with self._cv:
                self._leading = False
                self._cv.notify_all()  # a waiting call takes the lead for the next batch
