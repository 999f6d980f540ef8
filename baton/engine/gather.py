"""Gather: concurrent calls of one kind run together as one batched call (exact-mode verify blocks on
the prefill worker, Draft calls on the decode worker).

    g = Gather(run_batch, lock, expected=lambda: live_sessions)
    result = g.call(item)        # blocks; run_batch([item, ...]) -> [result, ...] ran it with others
    results = g.call_many(items) # one caller's items (a batched RPC's) as if each called from its own thread

Lifecycle of a call: it is queued; if no call is leading, it leads: it waits until the calls it expects
are queued or the window passed (no wait when it expects <= 1), then takes `lock` and, holding it, every
call queued by then (calls that arrived while it waited for the lock join; with `cost` and `budget`: the
queued calls in order while their summed cost fits the budget, at least one, a call whose `share` key an
earlier one of the batch has costing nothing (run_batch computes them once: equal prompts); the rest wait
for the next leader, which may be one of them), runs run_batch on them, hands each its result (or the batch's
exception), then passes the lead to the first queued call, if any, and returns. Wake-ups: each call waits
on its own event, set when it is done or the lead passes to it; only the leader waits on the condition,
which an arrival notifies alone (one wake-up a call and a batch, not one of every waiting call at each
arrival: at 64 sessions the process's CPU a round went 12.4 -> 4.7 ms, benchmarks/bench_gather.py,
results/gather-cpu-2026-12-05.json). No thread of its own: the callers
take turns running batches, so an idle Gather costs nothing. run_batch must give each item the result it
would get alone (batch invariance is the batch function's: baton/engine/speculation.py verify_blocks,
batch.py rows_batch).

Periodic callers (`key`: item -> the caller, a session; PERIODIC: the decode worker's fast-mode MTP rounds,
and exact mode's gathers until 2026-12-05): sessions call once a round, so
sessions that once ran in different batches would keep alternating (one group verifying while the other
drafts), each group paying a whole pass: on one GPU that is twice the passes of one group. With `key`, a
caller that has called at least twice is due again at its last call + its period (an EMA of its
intervals) + a tenth of its period for jitter, and is live while less than two periods have passed since
its last call. A leader
  * waits for the live callers due within max_wait_s (until the latest one's due time): they join this
    batch, and a pass of memory-bound rows costs about the same for 1 or 16 sessions;
  * else, unless its batch holds the anchor (the live caller seen first), waits the whole max_wait_s:
    each round such a group drifts that much later, towards the group due next, until that one is due
    within the window and they merge. The anchor's group never drifts, so the groups cannot all drift
    alike (as evenly spaced groups that each waited for the next would), and a newcomer drifts into the
    long-running group rather than the other way round;
  * else waits gather_s for `expected()` calls, as without `key`.
Merged callers stay one batch a round. A caller that stops calling is live for two more periods at most;
`forget(key)` (the session ended) ends that at once. `expected()` always caps what a leader waits for.

Round barrier (`barrier=True`, ROUND_BARRIER: exact mode's Draft where the two workers share one GPU): a
leader waits for every live keyed caller not queued yet, each until its due time plus a quarter of its
period, at most max_wait_s, recomputed at every arrival and `forget`; not for a caller whose period is past
SLOW x the median (a slow reader would hold every session to its pace). Sessions out of phase merge at the
first round where the leading group is here (the group verifying arrives within a period), and a newcomer
(not live before its second call) is waited for from its second call on. Only one side of a round may be
a barrier: two would wait for each other (the Draft group for the Verify group and back) until both time
out. The other side (Verify) gathers by round groups (below). PERIODIC's rule did not merge served sessions:
requests of 9-35 rounds, each a new key, ended before their groups drifted together (CPU, 8 exact sessions:
batches of 4.2 of 8, results/exact-cpu-2026-12-05-periodic.json; with the barrier 6.0, -round-barrier.json).

Round groups (`group`: item -> (round id, size) or None; ROUND_SETTLE's, exact mode's Verify): the
sessions that drafted in one Draft batch carry its tag (DraftResponse.round, relayed by the router), so a
Verify leader whose own call is tagged waits until all `size` calls of its round are queued, at most
group_wait_s, and then does not settle. Settling alone split the rounds: at 32 sessions on the H100 Draft
batches held 26, Verify passes 16 (calls over 1 ms apart through the router's threads), each paying the
whole weight read; with the tags 26 and 26 (benchmarks/results/gpu-h100-2026-12-06.md).

Giving way (`give_way`; exact mode's Verify beside prefill passes, ~190 ms each at 32 streams, mostly host
launches): a job holding the lock calls give_way() between its steps (a prefill pass: each layer); if a
leader waits for the lock, the job releases it until that leader took it, then takes it back. A Verify then
waits for a layer, not the rest of a pass (at 32 streams on the H100 it waited 30 ms a batch). The two touch
distinct slots, so neither changes the other's numbers (row and batch invariance).

Bursts (`settle_s`, prefill prompts): calls sent together reach the worker a few ms apart (the server
hands them to its threads one by one), so `expected()` cannot see the late ones, and the first would run
alone. The leader also waits until settle_s passes with no new call, at most gather_s: a lone call pays
settle_s once (3 ms against a prefill pass of 75 ms or more), a burst runs as one batch.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Hashable

from baton.engine.gather_periods import Periods

# Gather options for calls made once a round by sessions (items whose first element is the session): PERIODIC
# for fast-mode MTP rounds (decode_worker/mtp.py decode). 50 ms: the most a leader waits for a late group.
PERIODIC = dict(key=lambda item: item[0].id, max_wait_s=0.05)
# A round barrier for exact mode's Draft calls (module doc): each live session is waited for until it is due
# (at most 250 ms: a round of 64 sessions); the Verify side gathers plainly, settling for 1 ms.
ROUND_BARRIER = dict(key=lambda item: item[0].id, max_wait_s=0.25, barrier=True)
# ... and the Verify side's: a merged group's calls arrive a few ms apart, so a pass waits until none arrived for
# 1 ms, at most 5 ms, unless every session's call is here (pipelined(): no settling, GATHER_S)
# A call tagged with its Draft round (module doc, "Round groups") waits for the round's others, at most 30 ms.
ROUND_SETTLE = dict(
    gather_s=0.005,
    settle_s=0.001,
    expected_all=True,
    group=lambda item: getattr(item, "round", None),
    group_wait_s=0.03,
)
GATHER_S = 0.002  # a plain leader's wait for the calls it expects


# A batch's times (Gather.seconds, WorkerStats.gathered_s): its leader waiting for the calls it expects,
# then for the compute lock, then the batch function's run.
TIMES = ("wait", "lock", "run")


def fill_stats(out, gathers) -> None:
    """WorkerStats' gathered_batches / _items / _s / _gave_way: these Gathers' counters summed."""
    out.gathered_batches, out.gathered_items = sum(g.batches for g in gathers), sum(g.items for g in gathers)
    out.gathered_gave_way = sum(g.gave_way for g in gathers)
    for k in {k: None for g in gathers for k in g.seconds}:  # TIMES, and the run's parts (baton/engine/parts.py)
        out.gathered_s[k] = sum(g.seconds.get(k, 0.0) for g in gathers)


def unwrap(got):  # a batch function's per-item result: raised if an exception (the item failed alone)
    if isinstance(got, BaseException):
        raise got
    return got


class _Call:
    __slots__ = ("item", "done", "value", "error", "wake")

    def __init__(self, item, wake: threading.Event):
        self.item, self.done, self.value, self.error = item, False, None, None
        self.wake = wake  # set when the call is done, or when the lead passes to it (shared by a call_many)


class Gather:
    def __init__(
        self,
        run_batch: Callable[[list], list],
        lock,
        *,
        expected: Callable[[], int] = lambda: 1,
        gather_s: float = GATHER_S,
        cost: Callable[[object], int] | None = None,
        budget: int = 0,
        share: Callable[[object], Hashable | None] | None = None,
        key: Callable[[object], Hashable] | None = None,
        max_wait_s: float = 0.0,
        settle_s: float = 0.0,
        barrier: bool = False,
        expected_all: bool = False,
        group: Callable[[object], tuple[Hashable, int] | None] | None = None,
        group_wait_s: float = 0.0,
    ):
        self._run, self._lock, self._expected, self.gather_s = run_batch, lock, expected, gather_s
        self.settle_s = settle_s  # also wait until no call has arrived for this long (at most gather_s)
        self._last_arrival = 0.0
        self._cost, self.budget, self._share = cost, budget, share  # a batch: in order while cost <= budget
        self._key, self.max_wait_s, self.barrier = key, max_wait_s, barrier and key is not None
        self._awaited: set = set()  # a barrier's leader: the keys it still waits for (arrivals, forget() drop them)
        # expected() counts every caller that can come (Verify: the sessions): all of them queued, no settling
        self.expected_all = expected_all
        self._group, self.group_wait_s = group, group_wait_s  # a tagged leader waits for its round's calls
        self._taken = threading.Condition()  # give_way(): leaders waiting for the lock, and taking it
        self._lock_wanted, self._lock_taken, self.gave_way = 0, 0, 0  # gave_way: stats, the times it did
        self._periods = Periods()  # keyed callers' call periods (baton/engine/gather_periods.py)
        self._cv = threading.Condition()
        self._queue: list[_Call] = []
        self._leading = False
        self._next: _Call | None = None  # the queued call the lead passed to, until its thread takes it
        self.batches = 0  # stats: batches run, items in them, the largest
        self.items = 0
        self.max_items = 0
        self.seconds = dict.fromkeys(TIMES, 0.0)  # stats: summed over the batches (TIMES)

    def pipelined(self) -> None:
        """Plain from now on: no keying (PERIODIC's or ROUND_BARRIER's), no settling; a leader waits only for
        expected() calls, at most GATHER_S. For calls whose groups pipeline through workers on different
        devices (not rounds_share_a_device)."""
        with self._cv:
            self._key, self.max_wait_s, self.barrier = None, 0.0, False
            self.settle_s, self.gather_s = 0.0, GATHER_S
            self._group = None
            self._periods.clear()

    def call(self, item):
        """Runs `item` in a batch (module doc) -> its result; the batch's exception is raised."""
        (c,) = self._join([item])
        if c.error is not None:
            raise c.error
        return c.value

    def call_many(self, items: list) -> list:
        """Runs `items` (one caller's, e.g. a batched RPC's; distinct keys) in batches, as if each were
        called at once from its own thread -> per item its result, or the exception its batch raised."""
        return [c.error if c.error is not None else c.value for c in self._join(items)]

    def _join(self, items: list) -> list[_Call]:
        """Queues items as calls sharing one wake-up event, then takes the lead whenever it passes to one
        of them, until every one is done."""
        if not items:
            return []
        wake = threading.Event()
        calls = [_Call(it, wake) for it in items]
        with self._cv:
            self._last_arrival = time.monotonic()
            if self._key is not None:
                for c in calls:
                    k = self._key(c.item)
                    self._periods.arrived(k, self._last_arrival)
                    self._awaited.discard(k)
            self._queue.extend(calls)
            if not self._leading:
                self._leading, self._next = True, calls[0]
            else:
                self._cv.notify()  # only the leader waits on _cv: the others on their calls' event
        while True:  # a batch may leave some of them queued (budget): one of them may lead again
            with self._cv:
                if all(c.done for c in calls):
                    return calls
                own = next((c for c in calls if c is self._next), None)
                if own is not None:
                    self._next = None  # this thread leads the next batch
            if own is None:
                wake.wait()
                wake.clear()
            else:
                self._lead(own)

    def _take(self) -> list[_Call]:
        """Under _cv: the next batch off the queue (all of it, or the longest prefix within the budget;
        at least one item)."""
        if self._cost is None or not self.budget:
            batch, self._queue = self._queue, []
            return batch
        total, n, shared = 0, 0, set()
        for c in self._queue:
            k = self._share(c.item) if self._share is not None else None
            total += 0 if k is not None and k in shared else self._cost(c.item)
            shared.add(k)
            if n and total > self.budget:
                break
            n += 1
        batch, self._queue = self._queue[:n], self._queue[n:]
        return batch

    def forget(self, key: Hashable) -> None:
        """The caller `key` ended (its session was released): leaders stop expecting it."""
        with self._cv:
            self._periods.forget(key)
            if key in self._awaited:
                self._awaited.discard(key)
                self._cv.notify()  # the barrier's leader waiting for it stops

    def _wanted(self, now: float) -> list[tuple[int, float]]:
        """Under _cv: [(calls to wait for, until when: a monotonic time), ...]: the leader waits while
        any of them is short of its calls and not past its time."""
        cap = self._expected()
        base = (cap, now + self.gather_s)  # expected() calls for gather_s, with or without key
        if self._key is None:
            return [base]
        if self.barrier:  # the leader's own wait (_lead: _awaited)
            return [base]
        queued = {self._key(c.item) for c in self._queue}
        window = now + max(self.max_wait_s, self.gather_s, 0.25 * self._periods.shortest())
        live, near, until, anchor = 0, 0, now + self.gather_s, (float("inf"), False)
        for k, last, period, first in self._periods.live(now):
            anchor = min(anchor, (first, k in queued))
            if k in queued:
                continue
            live += 1
            if last + period <= window:  # due within the window (+ a tenth of its period for jitter)
                near, until = near + 1, max(until, last + period + max(self.gather_s, 0.1 * period))
        if live > near and not anchor[1]:  # not the anchor's batch, and a group due later: drift a window
            return [base, (min(cap, len(self._queue) + live), max(until, window))]
        return [base, (min(cap, len(self._queue) + near), until)]

    def give_way(self, timeout_s: float = 1.0) -> bool:
        """Called by a job holding this Gather's lock (module doc, "Giving way"): when a leader waits for the
        lock, release it until a leader has taken it (at most timeout_s), then block until it is free again
        and take it back. -> whether it gave way."""
        with self._taken:
            if not self._lock_wanted:
                return False
            n = self._lock_taken
        self._lock.release()
        try:
            with self._taken:
                self._taken.wait_for(lambda: self._lock_taken != n or not self._lock_wanted, timeout_s)
        finally:
            self._lock.acquire()
        self.gave_way += 1
        return True

    def _round_here(self, tag: tuple[Hashable, int]) -> bool:
        """Under _cv: whether every call of the round `tag` = (id, size) is queued."""
        n = 0
        for c in self._queue:
            t = self._group(c.item)
            n += t is not None and t[0] == tag[0]
        return n >= tag[1]

    def _lead(self, own: _Call) -> _Call | None:
        """One batch, led by the thread of call `own` (it holds the lead: _leading). Returns the queued call
        the lead passed to (the first in the queue, woken unless it is `own`), or None: the lead is free and
        the next call to arrive takes it."""
        try:
            with self._cv:  # let the other expected calls arrive
                start = time.monotonic()
                waits = self._wanted(start)
                if self.barrier:  # arrivals (call) and forget() drop keys from _awaited
                    queued = {self._key(c.item) for c in self._queue}
                    self._awaited, until = self._periods.barrier(start, queued, self.gather_s, self.max_wait_s)
                tag = self._group(own.item) if self._group is not None else None
                while True:
                    now, cap = time.monotonic(), self._expected()
                    grouped = tag is not None and self._round_here(tag)  # its round's calls: nothing else to wait for
                    left = [end - now for want, end in waits if len(self._queue) < min(want, cap) and end > now]
                    if grouped:
                        left = []
                    elif tag is not None and now < start + self.group_wait_s:
                        left.append(start + self.group_wait_s - now)
                    if self._awaited and len(self._queue) < cap and until > now:
                        left.append(until - now)
                    # every caller that can come is here, or every call of the leader's round
                    settled = grouped or (self.expected_all and len(self._queue) >= cap)
                    if self.settle_s > 0 and not settled:  # a burst's calls still arriving: until settle_s passes
                        quiet = self._last_arrival + self.settle_s - now  # with none
                        if quiet > 0 and now < start + self.gather_s:
                            left.append(min(quiet, start + self.gather_s - now))
                    if not left:
                        break
                    self._cv.wait(max(left))
                self._awaited = set()
            waited = time.monotonic()
            with self._taken:
                self._lock_wanted += 1
            with self._lock:
                with self._taken:
                    self._lock_wanted, self._lock_taken = self._lock_wanted - 1, self._lock_taken + 1
                    self._taken.notify_all()
                locked = time.monotonic()
                with self._cv:  # holding the lock: the calls queued while it was taken join this batch
                    batch = self._take()
                try:
                    values = self._run([c.item for c in batch])
                    err = None
                except BaseException as e:  # noqa: BLE001 - every caller of the batch gets it
                    values, err = [None] * len(batch), e
            t = self.seconds
            t["wait"], t["lock"], t["run"] = (
                t["wait"] + waited - start,
                t["lock"] + locked - waited,
                t["run"] + (time.monotonic() - locked),
            )
            self.batches += 1
            self.items += len(batch)
            self.max_items = max(self.max_items, len(batch))
            with self._cv:
                for c, v in zip(batch, values):
                    c.value, c.error, c.done = v, err, True
            for c in batch:
                c.wake.set()
        finally:
            with self._cv:  # the lead passes to the first queued call, if any (it leads the next batch)
                nxt = self._queue[0] if self._queue else None
                self._leading, self._next = nxt is not None, nxt
            if nxt is not None:
                nxt.wake.set()
        return nxt
