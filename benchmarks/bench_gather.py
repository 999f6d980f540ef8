"""The Gather's own cost (baton/engine/gather.py): N sessions calling once a round through two Gathers that
share one lock, as exact mode's on one GPU (the Draft's ROUND_BARRIER on the decode worker, the Verify's
ROUND_SETTLE on the prefill worker; until 2026-12-05 both PERIODIC: results/gather-cpu-2026-12-05.json),
each batch a fixed sleep (a captured pass: the same for 1 or 64 sessions). What grows with N is the Gather's: its leader's wait for the calls it expects, and the host CPU of its threads' wake-ups.

    python benchmarks/bench_gather.py [--sessions 1,8,32,64] [--rounds 100] [--pass-ms 2] [--out R.json]

Prints JSON: per N, round_ms (wall per round: two passes are the ideal), cpu_ms_per_round (the process's
CPU time a round), batches and their mean calls, and the first Gather's wait / lock / run ms a batch.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.gather import ROUND_BARRIER, ROUND_SETTLE, Gather  # noqa: E402
from benchmarks.report import emit, header  # noqa: E402


class _Session:
    def __init__(self, i: int):
        self.id = f"s{i}"


def point(n: int, rounds: int, pass_ms: float) -> dict:
    gpu = threading.Lock()

    def run(items):
        time.sleep(pass_ms / 1e3)
        return items

    draft = Gather(run, gpu, expected=lambda: n, **ROUND_BARRIER)
    verify = Gather(run, gpu, expected=lambda: n, **ROUND_SETTLE)
    start = threading.Barrier(n + 1)

    def session(i: int) -> None:
        s = _Session(i)
        start.wait()
        for r in range(rounds):
            draft.call((s, r))
            verify.call((s, r))
        draft.forget(s.id)
        verify.forget(s.id)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    c0, t0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    per_batch = {k: round(1e3 * v / draft.batches, 3) for k, v in draft.seconds.items()}
    return {
        "sessions": n,
        "round_ms": round(1e3 * wall / rounds, 3),
        "ideal_round_ms": 2 * pass_ms,
        "cpu_ms_per_round": round(1e3 * cpu / rounds, 3),
        "batches": draft.batches,
        "mean_calls": round(draft.items / draft.batches, 2),
        "draft_batch_ms": per_batch,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="1,8,32,64")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--pass-ms", type=float, default=2.0, help="each batch's pass (a sleep)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    emit(
        header(__file__, argv)
        | {
            "pass_ms": a.pass_ms,
            "rounds": a.rounds,
            "points": [point(int(n), a.rounds, a.pass_ms) for n in a.sessions.split(",")],
        },
        a.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
