"""The device parts of one exact-mode round at B sessions, timed alone in one process (issue 21's exact
targets): what a round would cost if the two workers' gathers merged every session into one batch and
nothing else ran on the GPU. Compare with bench_serve's round_ms_p50 (the served round) to see how much
of a served round is the passes themselves and how much is split batches, the two processes sharing
one GPU, and the host.

    python benchmarks/bench_exact_passes.py --random-init qwen3.5-9b --batch 1,8,16,32 --k 8 \
        --out benchmarks/results/exact-passes-h100-DATE.json

One runner as the decode worker builds it (row checkpoints, batching on, every graph captured), B slots
prefilled with --prompt tokens. Per B, the median over --reps of each part (wall time of the call, which
ends with its host read of the picks: the pass is done):
    verify_ms    rows_batch of B blocks of K+1 rows: the prefill worker's Verify pass
    verdict_ms   rows_batch of B blocks of `accepted` rows: the decode worker's verdict rows (mtp drafts)
    pairs_ms     mtp_batch of B groups of `accepted` pairs: their pending MTP pairs, the chain's first step
    step_ms      mtp_batch of B groups of 1 pair: one later chain step (a round runs K - 1 of them)
    ar_ms        ar_batch of the B slots: one fast bf16 step (the baseline's cost a token)
    rewind_ms    snapshot_slots + restore_slots of the B slots: a Verify batch's snapshot and its cut
                 blocks' restore (graph replays: baton/engine/slot_copies.py); rewind_eager_ms the same as
                 eager copy launches (BATON_SLOT_COPIES=0), in the same process (not in round_ms)
round_ms = verify + verdict + pairs + (K - 1) x step, and tok_s = B x tokens_per_round / round_ms, with
tokens_per_round = accepted + 1 (the controlled drafter's mean at p = 0.95, K = 8 is ~7.3: --accepted 6).
The positions advance by each timed pass (windows sized for it); no state is restored (timing only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.runner import ModelRunner  # noqa: E402
from benchmarks.report import emit, header  # noqa: E402


def _timed(fn, reps: int, sync) -> float:
    """Median wall ms of fn() over reps calls (one warm-up call first)."""
    fn()
    xs = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        xs.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(xs), 3)


def measure(r: ModelRunner, B: int, k: int, accepted: int, prompt: int, reps: int) -> dict:
    """The parts of a round at B sessions on runner r (module doc)."""
    V, dev = r.cfg.vocab_size, r.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for s in range(r.state.slots):
        r.state.reset(s)
    slots = list(range(B))
    for s in slots:
        r.prefill(s, [(13 * i + 7 * s) % V for i in range(prompt)])
    H = r.cfg.hidden_size
    out = {"batch": B}
    out["verify_ms"] = _timed(
        lambda: r.rows_batch([(s, [1 + i for i in range(k + 1)]) for s in slots], True, []), reps, sync
    )
    out["verdict_ms"] = _timed(
        lambda: r.rows_batch([(s, [3 + i for i in range(accepted)]) for s in slots], True, []), reps, sync
    )
    if r.has_mtp:
        h = torch.zeros((accepted, H), dtype=r.mtp_h.dtype, device=dev)
        pos = [int(p) for p in r.state.position[:B].tolist()]

        def pairs(n):
            return lambda: r.mtp_batch(
                [(s, h[:n], [5 + i for i in range(n)], pos[j] - accepted) for j, s in enumerate(slots)]
            )

        out["pairs_ms"] = _timed(pairs(accepted), reps, sync)
        out["step_ms"] = _timed(pairs(1), reps, sync)
    out["ar_ms"] = _timed(lambda: r.ar_batch(slots), reps, sync)
    st, copies = r.state, r.state.slot_copies  # a Verify batch's snapshot and the cut blocks' restore
    out["rewind_ms"] = _timed(lambda: (st.snapshot_slots(slots), st.restore_slots(slots)), reps, sync)
    if copies is not None:  # the same copies as eager launches (BATON_SLOT_COPIES=0), for the A/B
        st.slot_copies = None
        out["rewind_eager_ms"] = _timed(lambda: (st.snapshot_slots(slots), st.restore_slots(slots)), reps, sync)
        st.slot_copies = copies
    chain = out.get("pairs_ms", 0.0) + (k - 1) * out.get("step_ms", 0.0)
    out["round_ms"] = round(out["verify_ms"] + out["verdict_ms"] + chain, 3)
    out["tok_s"] = round(B * (accepted + 1) / out["round_ms"] * 1e3, 1)
    out["ar_tok_s"] = round(B / out["ar_ms"] * 1e3, 1)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--random-init", default="qwen3.5-9b", help="a random model of this shape")
    ap.add_argument("--batch", default="1,8,16,32", help="sessions B, comma-separated")
    ap.add_argument("--k", type=int, default=8, help="drafts a round (verify blocks of K+1 rows)")
    ap.add_argument("--accepted", type=int, default=6, help="drafts accepted a round (verdict rows, pairs)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-graphs", action="store_true", help="eager passes (the CPU, or to compare)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from baton.loading import random_model
    from baton.random_init import shape

    dev = torch.device(a.device)
    batches = [int(x) for x in a.batch.split(",")]
    if not 1 <= a.accepted <= a.k:
        ap.error("--accepted must be in 1..--k")
    lm = random_model(shape(a.random_init), dtype="bf16" if dev.type == "cuda" else "fp32", device=dev, seed=0)
    max_len = a.prompt + (4 * a.reps + 8) * (a.k + 1) + 64  # every timed pass advances the positions
    r = ModelRunner(lm.model, slots=max(batches) + 1, max_len=max_len, width=a.k + 2, checkpoints=True)
    captured = None
    if dev.type == "cuda":
        r.enable_batching()
        if not a.no_graphs:
            from baton.engine import graph

            print("bench_exact_passes: capturing graphs", file=sys.stderr)
            st = graph.capture_all(r, max_draft=a.k)
            captured = {"graphs": st.graphs, "capture_s": round(st.seconds, 1)}
    points = []
    for B in batches:
        print(f"bench_exact_passes: B={B}", file=sys.stderr)
        points.append(measure(r, B, a.k, a.accepted, a.prompt, a.reps))
        print(points[-1], file=sys.stderr)
    res = {
        **header(__file__, argv),
        "model": a.random_init,
        "k": a.k,
        "accepted": a.accepted,
        "captured": captured,
        "points": points,
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
