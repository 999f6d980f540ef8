"""StepScheduler: one thread runs the AR steps of every joined session, together, one step at a time.

Lifecycle of a job (one Decode call of one bf16 / fp8 session):
    join(runner, slot, max_new_tokens, ends) -> Job    registered; takes part from the next step on
    Job.next() -> int | None    asks for the next token and blocks until a step produced it; None once
                                the job is done (max_new_tokens reached, or the last token was an end)
    Job.close()                 leaves at the next step boundary (the consumer stopped early)
A step: every job that is asking, grouped by runner; each group is one `step(runner, slots)` call under
the engine's compute lock, which feeds every slot its pending token and sets the slot's next one
(ModelRunner.ar_batch). A job is in a step only while its consumer asks, so a session's state is always
exactly that of the tokens its consumer was given: nothing runs ahead, nothing is undone.
Gathering: a step starts once every job is asking, or `gather_s` after the first one asked, so the
consumers that just got a token join the same next step instead of one step each.
Batch invariance is the step function's: ar_batch gives each slot the bits it would get alone.
"""

from __future__ import annotations

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
    produced: int = 0
    done: bool = False
    asking: bool = False
    token: int | None = None
    error: BaseException | None = None
    _ready: threading.Event = field(default_factory=threading.Event)

    def next(self) -> int | None:
        """The job's next token (blocks for one step), or None once it is done."""
        if self.done:
            return None
        self._ready.clear()
        self._sched._ask(self)
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self.token

    def close(self) -> None:
        self._sched._leave(self)


class StepScheduler:
    def __init__(
        self,
        step: Callable[[object, list[int]], list[int]],
        lock: threading.Lock,
        *,
        gather_s: float = 0.002,
        name: str = "baton-steps",
    ):
        """step(runner, slots) -> each slot's new token; run under `lock` (the engine's compute lock)."""
        self._step, self._lock, self.gather_s = step, lock, gather_s
        self._cv = threading.Condition()
        self._jobs: list[Job] = []
        self._stopped = False
        self.steps = 0  # steps run, and rows in them (stats; batch size = rows / steps)
        self.rows = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def join(self, runner, slot: int, max_new_tokens: int, ends) -> Job:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        job = Job(runner, slot, max_new_tokens, frozenset(ends), self)
        with self._cv:
            if self._stopped:
                raise RuntimeError("the step scheduler is stopped")
            if any(j.slot == slot and j.runner is runner for j in self._jobs):
                raise RuntimeError(f"slot {slot} already has a running decode")
            self._jobs.append(job)
        return job

    def close(self) -> None:
        """Stops the thread; jobs still asking get RuntimeError."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(5)

    # ---- consumer side ----------------------------------------------------------------------------
    def _ask(self, job: Job) -> None:
        with self._cv:
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

    # ---- the thread -------------------------------------------------------------------------------
    def _gather(self) -> list[Job] | None:
        """Waits for a step's jobs: all joined jobs asking, or gather_s after the first asked."""
        with self._cv:
            while not self._stopped and not any(j.asking for j in self._jobs):
                self._cv.wait()
            end = time.monotonic() + self.gather_s
            while not self._stopped and not all(j.asking for j in self._jobs):
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            if self._stopped:
                for j in self._jobs:
                    if j.asking:
                        j.error = RuntimeError("the step scheduler is stopped")
                        j._ready.set()
                return None
            return [j for j in self._jobs if j.asking]

    def _run(self) -> None:
        while True:
            batch = self._gather()
            if batch is None:
                return
            groups: dict[int, list[Job]] = {}
            for j in batch:
                groups.setdefault(id(j.runner), []).append(j)
            for jobs in groups.values():
                try:
                    with self._lock:
                        toks = self._step(jobs[0].runner, [j.slot for j in jobs])
                except BaseException as e:  # noqa: BLE001 - handed to each consumer, the thread goes on
                    toks, err = [None] * len(jobs), e
                else:
                    err = None
                self.steps += 1
                self.rows += len(jobs)
                with self._cv:
                    for j, t in zip(jobs, toks):
                        j.asking, j.token, j.error = False, t, err
                        if err is None:
                            j.produced += 1
                            if t in j.ends or j.produced >= j.max_new_tokens:
                                j.done = True
                                if j in self._jobs:
                                    self._jobs.remove(j)
                        j._ready.set()
