"""A model of fast mtp's draft-length controller under a heavy batch (baton/engine/draft_length.py), no GPU.

One controller for a batch of sessions that ramps from 1 to --hi sessions, then wanders between --lo and --hi
(sessions joining and leaving); drafts right with probability --p; a plain round (K = 0) costs 4 ms + 0.1 ms a
session and a speculative one 10 ms + 0.5 ms a session and drafted row + 1 ms a draft (the shape of the H200's
32-stream rounds: a K = 4 round of 28 sessions ~85 ms against a 7 ms step); with probability --spike a prefill
pass beside the steps slows the next 5 plain rounds --spike-x times. Prints JSON: per policy the share of the
time spent in speculative rounds and the tokens a second, against plain rounds only (what issue 21 asks the
controller to match within 5% where speculation does not pay).

    python benchmarks/sim_draft_length.py                       # the controller at HEAD against plain rounds
    python benchmarks/sim_draft_length.py --probe-share 0.05    # dear probes at 5% (the default until ce7c515)
    python benchmarks/sim_draft_length.py --waves               # a closed loop's waves instead (below)

--waves: the batch of a closed loop instead of a wandering one. --hi clients each send a request of --tokens
tokens and, once it ends, the next after a first token 0.3-0.7 s away (a prefill under load), all starting
together: sessions end in waves, so the batch drops to a few and grows again. Costs from stop 52's H100 at
32 streams (a plain round ~9.6 ms, K = 1 / 3 / 4 rounds ~58 / 112 / 131 ms); --warmup 1,8 runs the bench's
warm-up points first (60 rounds at each batch).

A model, not a measurement: its costs are assumed; the GPU's figures come from bench_serve (mtp_rounds_by_k).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.draft_length import DraftLength  # noqa: E402


def cost(k: int, b: int) -> float:
    return 4e-3 + 1e-4 * b if k == 0 else 10e-3 + 5e-4 * b * (k + 1) + 1e-3 * k


def run(seed: int, args, plain: bool) -> tuple[float, float]:
    """-> (share of seconds in speculative rounds, tokens a second) after the ramp."""
    kw = {} if args.probe_share is None else {"probe_share": args.probe_share}
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0, **kw), random.Random(seed)
    b, spike, spent, toks, ramp = 1, 0, [0.0, 0.0], 0, 2 * args.hi
    for r in range(args.rounds):
        b = min(args.hi, 1 + r // 2) if r < ramp else max(args.lo, min(args.hi, b + rng.choice([-1, 0, 0, 1])))
        k = 0 if plain else c.next_k(batch=b)
        if rng.random() < args.spike:
            spike = 5
        slow = args.spike_x if spike > 0 and k == 0 else 1.0
        spike -= 1
        secs = cost(k, b) * slow * (1 + 0.05 * rng.uniform(-1, 1))
        acc = [0] * b
        for i in range(b):
            while acc[i] < k and rng.random() < args.p:
                acc[i] += 1
        c.observe_round(k, acc, 0.0, secs)
        if r >= ramp:
            spent[1 if k else 0] += secs
            toks += sum(a + 1 for a in acc)
    return spent[1] / sum(spent), toks / sum(spent)


def wave_cost(k: int, b: int) -> float:
    return 7e-3 + 8e-5 * b if k == 0 else 10e-3 + 8e-4 * b + 7e-4 * b * k


def run_waves(seed: int, args, plain: bool, seconds: float = 10.0) -> tuple[float, float]:
    """-> (share of seconds in speculative rounds, tokens a second) of the closed loop (--waves, module doc)."""
    kw = {} if args.probe_share is None else {"probe_share": args.probe_share}
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0, **kw), random.Random(seed)
    for b in [int(x) for x in args.warmup.split(",") if x]:  # the bench's warm-up points: rounds at b sessions
        for _ in range(60):
            k = 0 if plain else c.next_k(batch=b)
            acc = []
            for _ in range(b):
                m = 0
                while m < k and rng.random() < args.p:
                    m += 1
                acc.append(m)
            c.observe_round(k, acc, 0.0, wave_cost(k, b))
    n = args.hi
    left, back, t, toks, spec = [args.tokens] * n, [0.0] * n, 0.0, 0, 0.0
    while t < seconds:
        live = [i for i in range(n) if left[i] > 0 or back[i] <= t]
        if not live:
            t = min(back)
            continue
        for i in live:
            left[i] = left[i] if left[i] > 0 else args.tokens
        k = 0 if plain else c.next_k(batch=len(live))
        secs = wave_cost(k, len(live)) * (1 + 0.05 * rng.uniform(-1, 1))
        acc = []
        for i in live:
            m = 0
            while m < k and rng.random() < args.p:
                m += 1
            acc.append(m)
            got = min(m + 1, left[i])
            left[i] -= got
            toks += got
            if left[i] <= 0:
                back[i] = t + secs + rng.uniform(0.3, 0.7)
        c.observe_round(k, acc, 0.0, secs)
        t += secs
        spec += secs if k else 0.0
    return spec / t, toks / t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3000, help="rounds a run (default 3000)")
    p.add_argument("--seeds", type=int, default=8, help="runs, one seed each (default 8)")
    p.add_argument("--lo", type=int, default=20, help="fewest sessions after the ramp (default 20)")
    p.add_argument("--hi", type=int, default=32, help="most sessions (default 32)")
    p.add_argument("--p", type=float, default=0.9, help="a draft's chance to be right (default 0.9)")
    p.add_argument("--spike", type=float, default=0.03, help="chance a round starts a prefill pass (default 0.03)")
    p.add_argument("--spike-x", type=float, default=2.5, help="plain rounds' slow-down beside it (default 2.5)")
    p.add_argument("--probe-share", type=float, default=None, help="DraftLength's probe_share (default: its own)")
    p.add_argument("--waves", action="store_true", help="a closed loop of --hi clients (module doc)")
    p.add_argument("--tokens", type=int, default=256, help="--waves: tokens a request (default 256)")
    p.add_argument(
        "--warmup",
        default="",
        help="--waves: first 60 rounds at each of these batches, e.g. 1,8 (bench_serve's points)",
    )
    args = p.parse_args(argv)
    out = {"benchmark": "sim_draft_length", "command": " ".join(["python", *sys.argv]), "model": "assumed costs"}
    for name, plain in (("adaptive", False), ("plain", True)):
        got = [(run_waves if args.waves else run)(s, args, plain) for s in range(args.seeds)]
        out[name] = {
            "spec_share": round(sum(g[0] for g in got) / len(got), 4),
            "tok_s": round(sum(g[1] for g in got) / len(got), 1),
            "tok_s_by_seed": [round(g[1], 1) for g in got],
        }
    out["adaptive_over_plain"] = round(out["adaptive"]["tok_s"] / out["plain"]["tok_s"], 4)
    by_seed = zip(out["adaptive"]["tok_s_by_seed"], out["plain"]["tok_s_by_seed"])
    out["worst_seed_over_plain"] = round(min(a / b for a, b in by_seed), 4)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
