"""StepScheduler: one thread runs the AR steps of every joined session, together, one step at a time.

Lifecycle of a job (one Decode call of one bf16 / fp8 session):
    join(runner, slot, max_new_tokens, ends, ahead=0) -> Job    registered; steps from the next step on
    Job.next() -> int | None    the next token: from the job's queue, else blocks until a step made one;
                                None once the job is done (max_new_tokens reached, or the last token was
                                an end) and its queue is drained
    Job.take() -> list | None   every queued token at once (blocks for one when none is queued): a reader
                                that fell behind sends them as one message, so under load the messages
                                grow instead of the reader falling out of the steps
    Job.close()                 leaves at the next step boundary (the consumer stopped early); returns
                                once no step holds the job, so the caller may free the slot (and its KV
                                pages) right after: a step gathered before the close skips it
A step: every job that wants a token, grouped by runner; each group is one `step(runner, slots)` call under
the engine's compute lock, which feeds every slot its pending token and sets the slot's next one
(ModelRunner.ar_batch). The new token goes to the job's queue.
A job wants a token while it is not done and either its consumer is asking (ahead = 0: the session's
state is always exactly that of the tokens its consumer was given) or its queue holds fewer than `ahead`
tokens (ahead > 0: steps run back to back, without waiting for the consumers; a consumer that stops
early leaves the state up to `ahead` tokens past what it read, so only a session that is released at
the end of its call may run ahead).
Gathering: a step starts once every job wants a token, or `gather_s` after the first one did, so the
consumers that just got a token join the same next step instead of one step each.
The pipeline (with `launch`, as DecodeEngine runs it): step t + 1 is launched before the tokens of step t
are collected, so the host's gather, launch and token hand-out overlap the device's step. Step t + 1
holds the jobs that want a token now and are not in step t, and the jobs of step t that will still want
one once its token lands: run-ahead jobs (ahead > 0) with room in their queue and tokens left. A job of
step t whose token is an end is done; the token step t + 1 made for it is dropped (its state is past
the end, which only a run-ahead session, released at the end of its call, may be). A job with ahead = 0
is never in two uncollected steps, so its state stays exactly that of the tokens its consumer got.
close() waits until no uncollected step holds the job.
Where the thread's time goes (`phase_s`, seconds since fill_stats' last reset; WorkerStats.step_phase_s):
"idle" (no job joined), "held" (jobs joined, none wants a token and no step is in flight: every consumer is
behind, or every run-ahead queue is full), "gather" (the gather_s window), "lock" (waiting for the compute
lock: a LoadState commit, a Draft, a Release holds it), "launch" (the launch call: the host's part of a
step; unpipelined, the whole step), "collect" (waiting for a step's tokens: the device), "deliver" (the
tokens handed out). `held_rows`: jobs joined but left out of a pipelined step (their run-ahead queue full,
or done).
Batch invariance is the step function's: ar_batch gives each slot the bits it would get alone.
Rounds (`multi=True`, fast-mode MTP: decode_worker/mtp.py): a step is a speculation round that gives each
job a list of tokens (1 to K+1), called as step(runner, slots, left) with each job's tokens left. The
round's list is one queue item (Job.next() returns it: one message a round), cut after its first end
token or at max_new_tokens (the tokens after are dropped, as for a run-ahead job's extra step; fast mtp's
rounds give none past either: their accept stops at an end, DecodeSession.round_ends, and round_cap caps
K by the tokens left, so the session's state is exactly that of the tokens handed out); `ahead`
then counts rounds. Rounds may be pipelined too (`launch` with multi, decode_worker/mtp_launch.py:
a plain round is a launched AR step, a speculative one is computed inside launch); `left` is each job's
tokens left as the scheduler knows them (not counting a step in flight), and a job of a round in flight
takes the next round as a run-ahead job of one token would (its extra tokens are dropped).
settle(): a launch that computes at once calls it (in the scheduler's thread) once it has read the steps in
flight, so their tokens reach the consumers before its compute instead of after it (a new session's first
plain round otherwise waited for the speculative round after it: ~300 ms on the CPU at 8 streams). Its
time counts as "collect" / "deliver", not as the launch's. Such a launch's own tokens are on the host when
it returns: a launch result with `ready = True` is handed out at once, not one launch later.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(eq=False)
class Job:
    runner: object
    slot: int
    max_new_tokens: int
    ends: frozenset
    _sched: StepScheduler
    ahead: int = 0
    produced: int = 0
    done: bool = False
    asking: bool = False
    error: BaseException | None = None
    queue: collections.deque = field(default_factory=collections.deque)
    _ready: threading.Event = field(default_factory=threading.Event)
    joined: float = field(default_factory=time.perf_counter)  # when join() made it (StepScheduler.first_s)

    @property
    def wants(self) -> bool:
        """Takes part in the next step (read under the scheduler's lock)."""
        return not self.done and (self.asking or len(self.queue) < self.ahead)

    def next(self):
        """The job's next token (multi: its next round's list of tokens; blocks for a step when none is
        queued), or None once it is done."""
        while True:
            with self._sched._cv:
                if self.queue:
                    tok = self.queue.popleft()
                    if self.ahead:
                        self._sched._cv.notify_all()  # room in the queue
                    return tok
                if self.error is not None:
                    raise self.error
                if self.done:
                    return None
                self._ready.clear()
                self._sched._ask(self)
            self._ready.wait()

    def take(self) -> list | None:
        """Every queued item at once, in order (blocks for a step when none is queued), or None once the
        job is done and drained."""
        first = self.next()
        if first is None:
            return None
        with self._sched._cv:
            more = list(self.queue)
            self.queue.clear()
            if more and self.ahead:
                self._sched._cv.notify_all()  # room in the queue
        return [first, *more]

    def close(self) -> None:
        self._sched._leave(self)


def _computed_at_once(step: Callable) -> Callable:
    """The unpipelined launch: run the step now, return a collect() that hands back its tokens."""

    def launch(runner, slots, *more):
        tokens = step(runner, slots, *more)
        return lambda: tokens

    return launch


def p50_p99(xs) -> tuple[float, float]:
    """(p50, p99) of a window of durations; (0, 0) when it is empty."""
    xs = sorted(xs)
    return (xs[len(xs) // 2], xs[min(len(xs) - 1, int(0.99 * len(xs)))]) if xs else (0.0, 0.0)


class StepScheduler:
    def __init__(
        self,
        step: Callable[[object, list[int]], list[int]],
        lock: threading.Lock,
        *,
        launch: Callable[[object, list[int]], Callable[[], list[int]]] | None = None,
        gather_s: float = 0.002,
        name: str = "baton-steps",
        multi: bool = False,
    ):
        """step(runner, slots) -> each slot's new token; run under `lock` (the engine's compute lock).
        launch(runner, slots) -> a callable returning those tokens: the pipelined form (step t + 1 is
        launched before step t's tokens are collected); without it every step is step().
        multi: rounds (module doc): step(runner, slots, left) -> each slot's list of tokens (launch, if
        given, takes the same arguments)."""
        self._lock, self.gather_s, self.multi = lock, gather_s, multi
        self._pipelined = launch is not None
        self._launch = launch or _computed_at_once(step)
        self._cv = threading.Condition()
        self._jobs: list[Job] = []
        self._running: collections.Counter[Job] = collections.Counter()  # jobs of uncollected steps
        self._stopped = False
        self.steps = 0  # steps run, and rows in them (stats; batch size = rows / steps)
        self.rows = 0
        self.max_rows = 0  # the largest step
        self.step_s: collections.deque[float] = collections.deque(maxlen=4096)  # recent step durations
        # from one launch to the next while a step was in flight (pipelined: the step period the sessions see)
        self.interval_s: collections.deque[float] = collections.deque(maxlen=4096)
        # join -> a job's first tokens out; read and reset by its owner (DecodeEngine.fill_step_stats)
        self.first_s: collections.deque[float] = collections.deque(maxlen=4096)
        self._last_launch = 0.0
        self.phase_s: collections.Counter[str] = collections.Counter()
        self.held_rows = 0
        self.phase_since = time.monotonic()
        self._waiting: list | None = None  # [phase, since]: the thread's wait for a job in progress
        # the steps launched and not collected, (jobs, get, error, launched at): the thread's; settle() empties it
        self._inflight: list[tuple[list[Job], Callable[[], list[int]] | None, BaseException | None, float]] = []
        self._settle_s = 0.0  # the time settle() took inside the current launch
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def join(self, runner, slot: int, max_new_tokens: int, ends, ahead: int = 0) -> Job:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        job = Job(runner, slot, max_new_tokens, frozenset(ends), self, ahead=max(0, ahead))
        with self._cv:
            if self._stopped:
                raise RuntimeError("the step scheduler is stopped")
            if any(j.slot == slot and j.runner is runner for j in self._jobs):
                raise RuntimeError(f"slot {slot} already has a running decode")
            self._jobs.append(job)
            self._cv.notify_all()  # a run-ahead job wants a token at once
        return job

    def fill_stats(self, out, device_windows: list, reset: bool = False) -> None:
        """WorkerStats' step fields (`out`): steps, rows, the windows' p50 / p99 (step, period, and the
        runners' device times `device_windows`), the phases; reset: the windows start again."""
        out.step_s_p50, out.step_s_p99 = p50_p99(self.step_s)
        out.step_interval_s_p50, out.step_interval_s_p99 = p50_p99(self.interval_s)
        out.step_device_s_p50, out.step_device_s_p99 = p50_p99([t for w in device_windows for t in w])
        with self._cv:  # the thread's wait in progress counts up to now
            phases = collections.Counter(self.phase_s)
            if self._waiting is not None:
                now = time.perf_counter()
                phases[self._waiting[0]] += now - self._waiting[1]
                if reset:
                    self._waiting[1] = now
            for phase, secs in phases.items():
                out.step_phase_s[phase] = secs
            out.step_phase_window_s = time.monotonic() - self.phase_since
            out.step_held_rows = self.held_rows
            out.steps, out.step_rows, out.max_step_rows = self.steps, self.rows, self.max_rows
            if reset:
                for w in [self.step_s, self.interval_s, *device_windows]:
                    w.clear()
                self.phase_s, self.held_rows, self.phase_since = collections.Counter(), 0, time.monotonic()

    def close(self) -> None:
        """Stops the thread; jobs still asking get RuntimeError."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(5)

    # ---- consumer side ----------------------------------------------------------------------------
    def _ask(self, job: Job) -> None:
        """Under self._cv: the consumer of `job` waits for its next token."""
        if self._stopped:
            job.error = RuntimeError("the step scheduler is stopped")
            job._ready.set()
            return
        job.asking = True
        self._cv.notify_all()

    def _leave(self, job: Job) -> None:
        with self._cv:
            job.done, job.asking = True, False
            if job in self._jobs:
                self._jobs.remove(job)
            self._cv.notify_all()
            while self._running[job]:  # a step already running with it: its slot is in use until it ends
                self._cv.wait()

    # ---- the thread -------------------------------------------------------------------------------
    def _gather(self, inflight: collections.Counter | None = None) -> list[Job] | None:
        """Waits for a step's jobs: all joined jobs wanting a token, or gather_s after the first did.
        With a step in flight (`inflight`: its jobs) it does not wait: the jobs that want a token now,
        and those of the step in flight that will still want one once its token lands (run-ahead jobs
        with room in their queue and tokens left); [] when there are none."""
        with self._cv:
            if inflight:
                if self._stopped:
                    return None
                batch = [j for j in self._jobs if (j.wants and not inflight[j]) or (inflight[j] and self._goes_on(j))]
                self.held_rows += len(self._jobs) - len(batch)
                return batch
            while not self._stopped and not any(j.wants for j in self._jobs):
                self._waiting = ["held" if self._jobs else "idle", time.perf_counter()]  # fill_stats reads it
                self._cv.wait()
                phase, since = self._waiting
                self._waiting = None
                self._spent(phase, since)
            t0 = time.perf_counter()
            end = time.monotonic() + self.gather_s
            while not self._stopped and not all(j.wants for j in self._jobs):
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            self._spent("gather", t0)
            if self._stopped:
                for j in self._jobs:
                    if j.asking:
                        j.error = RuntimeError("the step scheduler is stopped")
                        j._ready.set()
                return None
            return [j for j in self._jobs if j.wants]

    def _spent(self, phase: str, since: float) -> float:
        """Adds the time since `since` to phase_s[phase]; returns now (perf_counter)."""
        now = time.perf_counter()
        self.phase_s[phase] += now - since
        return now

    @staticmethod
    def _goes_on(j: Job) -> bool:
        """A job of the step in flight takes the next step too: it may run ahead, and after the token in
        flight it still has room in its queue and tokens to make (if that token is an end, the extra
        step's token is dropped: only a session released at the end of its call runs ahead)."""
        return not j.done and j.ahead > 0 and len(j.queue) + 1 < j.ahead and j.produced + 1 < j.max_new_tokens

    def settle(self) -> None:
        """Hands out the tokens of every step in flight now. Only from a launch, in the scheduler's thread
        (module doc): a launch about to compute at once calls it after reading those steps."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("StepScheduler.settle: only from a launch, in the scheduler's thread")
        t0 = time.perf_counter()
        while self._inflight:
            self._deliver(*self._inflight.pop(0))
        self._settle_s += time.perf_counter() - t0

    def _run(self) -> None:
        inflight = self._inflight  # (jobs, get, error, launched at) of each uncollected step, oldest first
        while True:
            batch = self._gather(collections.Counter(j for jobs, *_ in inflight for j in jobs))
            if batch is None:
                for step in inflight:
                    self._deliver(*step)
                return
            launched = []
            groups: dict[int, list[Job]] = {}
            for j in batch:
                groups.setdefault(id(j.runner), []).append(j)
            for jobs in groups.values():
                with self._cv:  # closed since the gather: left out (its slot may be freed already)
                    jobs = [j for j in jobs if not j.done]
                    self._running.update(jobs)
                if not jobs:
                    continue
                t0 = time.perf_counter()
                if not launched:  # the iteration's first launch; with a step in flight, one step period
                    if inflight:
                        self.interval_s.append(t0 - self._last_launch)
                    self._last_launch = t0
                t1 = t0
                self._settle_s = 0.0
                try:
                    more = ([j.max_new_tokens - j.produced for j in jobs],) if self.multi else ()
                    with self._lock:
                        t1 = time.perf_counter()
                        get, err = self._launch(jobs[0].runner, [j.slot for j in jobs], *more), None
                except BaseException as e:  # noqa: BLE001 - handed to each consumer, the thread goes on
                    get, err = None, e
                self.phase_s["lock"] += t1 - t0
                self.phase_s["launch"] += time.perf_counter() - t1 - self._settle_s
                launched.append((jobs, get, err, t0))
            if not self._pipelined:  # each step's tokens now
                for step in launched:
                    self._deliver(*step)
                continue
            while inflight:  # step t's tokens, with step t + 1 already launched (unless settle() took them)
                self._deliver(*inflight.pop(0))
            for step in launched:  # a step computed at once (its get has ready = True) goes out now
                if getattr(step[1], "ready", False):
                    self._deliver(*step)
                else:
                    inflight.append(step)

    def _deliver(self, jobs: list[Job], get, err: BaseException | None, t0: float) -> None:
        """Collects a step's tokens (get()) and hands each job its token, or the step's error."""
        t1 = time.perf_counter()
        if err is None:
            try:
                toks = get()
            except BaseException as e:  # noqa: BLE001 - handed to each consumer, the thread goes on
                err = e
        if err is not None:
            toks = [None] * len(jobs)
        t2 = self._spent("collect", t1)
        self.step_s.append(t2 - t0)
        self.steps += 1
        self.rows += len(jobs)
        self.max_rows = max(self.max_rows, len(jobs))
        with self._cv:
            self._running -= collections.Counter(jobs)  # (drops the jobs no step holds any more)
            for j, t in zip(jobs, toks):
                if j.done:  # ended at the step before (an end token, an error) or closed: dropped
                    continue
                j.asking, j.error = False, err
                if err is not None:  # the consumer raises it (after its queued tokens)
                    j.done = True
                    if j in self._jobs:
                        self._jobs.remove(j)
                else:
                    got = []
                    for tok in t if self.multi else (t,):
                        got.append(tok)
                        j.produced += 1
                        if tok in j.ends or j.produced >= j.max_new_tokens:
                            j.done = True
                            if j in self._jobs:
                                self._jobs.remove(j)
                            break
                    if got:  # (a round of a job that ended in the round before gives none)
                        j.queue.append(got if self.multi else got[0])
                        if j.produced == len(got):  # its first tokens: the wait since join()
                            self.first_s.append(time.perf_counter() - j.joined)
                j._ready.set()
            self._cv.notify_all()
        self._spent("deliver", t2)
