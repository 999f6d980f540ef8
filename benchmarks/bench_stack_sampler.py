"""What one sample of baton/stack_sampler.py costs: a Sampler.sample() over --threads parked threads whose stacks
are --depth frames deep (the sampler holds the GIL that long: its share of a period is the overhead).

    python benchmarks/bench_stack_sampler.py [--threads 40] [--depth 24] [--samples 200] [--out R.json]

Prints JSON: ms_per_sample, and the share of one core at the default period (BATON_STACK_INTERVAL_MS).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton import stack_sampler  # noqa: E402
from benchmarks.report import emit, header  # noqa: E402

DEFAULT_PERIOD_MS = 10.0  # baton/stack_sampler.py's BATON_STACK_INTERVAL_MS default


def _park(depth: int, stop: threading.Event) -> None:
    if depth > 1:
        return _park(depth - 1, stop)
    stop.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=40)
    ap.add_argument("--depth", type=int, default=24, help="frames of each parked thread's stack (about)")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    stop = threading.Event()
    threads = [threading.Thread(target=_park, args=(a.depth - 3, stop)) for _ in range(a.threads)]
    for t in threads:
        t.start()
    try:
        s = stack_sampler.Sampler(1.0)  # not started: sample() is timed here, on this thread
        t0 = time.perf_counter()
        for _ in range(a.samples):
            s.sample()
        ms = (time.perf_counter() - t0) / a.samples * 1e3
    finally:
        stop.set()
        for t in threads:
            t.join()
    emit(
        header(__file__, argv)
        | {
            "threads": a.threads,
            "depth": a.depth,
            "samples": a.samples,
            "ms_per_sample": round(ms, 4),
            "share_at_default_period": round(ms / DEFAULT_PERIOD_MS, 4),
        },
        a.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
