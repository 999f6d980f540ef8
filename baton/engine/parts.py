"""Where a batch function's run goes, by part, in every served run (no profiler): host wall seconds added to
its Gather's `seconds` under "run_PART" (WorkerStats.gathered_s; bench_serve reports ROLE_gathered_run_PART_ms,
the mean a batch, beside ROLE_gathered_run_ms).

    clock = PartClock(gather.seconds)    None: a no-op clock (a direct call, a test)
    ...; clock.mark("pass")              the time since the last mark (or the clock's start) -> "run_pass"

A part's time is the host's: a part that ends in a host read of the GPU (the verify pass's picks, the Draft
chains' drafts) includes the wait for every kernel queued before it, its own and the earlier parts'. The
parts of one batch add up to its run, less the time before the clock started. Written by the batch's thread
under the worker's compute lock (one batch at a time), read unlocked by GetStats (a stats race, benign).
"""

from __future__ import annotations

import time


class PartClock:
    __slots__ = ("into", "t")

    def __init__(self, into: dict | None):
        self.into = into
        self.t = time.monotonic()

    def mark(self, part: str) -> None:
        if self.into is None:
            return
        now = time.monotonic()
        key = "run_" + part
        self.into[key] = self.into.get(key, 0.0) + (now - self.t)
        self.t = now
