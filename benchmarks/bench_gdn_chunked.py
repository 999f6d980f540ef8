"""The CPU prefill's delta rule alone (baton/models/gdn_ops.py `chunked`): its time for one sequence of the
tiny model's GDN shape (2 key heads, 4 value heads, 16-wide), and whether cutting the sequence at the given
points leaves the whole sequence's bits. Prints one JSON object (and writes it to --out).

    python benchmarks/bench_gdn_chunked.py --tokens 813 --cuts 768 --reps 20 --out FILE

Run at two commits from their checkouts to compare versions of `chunked` on one machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baton.models import gdn_ops  # noqa: E402
from benchmarks.report import emit, header  # noqa: E402


def run(q, k, v, g, beta, cuts: list[int]):
    """chunked over the pieces between `cuts`, the state carried: -> (outputs, final state)."""
    T, Hv, dv = v.shape
    S = torch.zeros(Hv, q.shape[-1], dv)
    outs, a = [], 0
    for b in [*cuts, T]:
        outs.append(gdn_ops.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], S))
        a = b
    return torch.cat(outs), S


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=813, help="the sequence's length")
    ap.add_argument("--cuts", default="768", help="comma-separated cut points for the bits check ('' = none)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls of the whole sequence (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    ap.add_argument("--out", default=None, help="the JSON's path (else stdout only)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    T, Hk, Hv, d = a.tokens, 2, 4, 16
    q, k, v = torch.randn(T, Hk, d), torch.randn(T, Hk, d), torch.randn(T, Hv, d)
    g, beta = -torch.rand(T, Hv) * 0.1, torch.rand(T, Hv)
    run(q, k, v, g, beta, [])
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        o, S = run(q, k, v, g, beta, [])
        times.append(time.perf_counter() - t0)
    cuts = [int(c) for c in a.cuts.split(",") if c]
    oc, Sc = run(q, k, v, g, beta, cuts)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    times.sort()
    res = header(__file__, argv) | {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "commit": commit,
        "tokens": T,
        "threads": a.threads,
        "ms_median": round(times[len(times) // 2] * 1e3, 3),
        "ms_min": round(times[0] * 1e3, 3),
        "cuts": cuts,
        "cut_bits_equal": torch.equal(o, oc) and torch.equal(S, Sc),
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
