"""CPU throughput of ModelRunner.rows_batch (one eager step over B sessions' AR rows) against B
sequential one-slot rows() calls, on the embedded default model. Prints JSON.

    python benchmarks/bench_rows_batch.py [--dtype fp32 bf16] [--batch 1 2 4 8 16] [--steps 16]

Each session is prefilled with the same-length random prompt, then decodes greedily one row per step;
both modes start from the same states and must produce the same tokens (checked: "tokens_equal").
tok/s = B * steps / wall time of the steps (best of --repeats runs: the CPU is shared, the minimum is the
least disturbed).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from baton.engine.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH, ModelRunner
from baton.loading import load_model


def _prefill(r: ModelRunner, B: int, prompt: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [r.prefill(s, torch.randint(0, r.cfg.vocab_size, (prompt,), generator=g).tolist()) for s in range(B)]


def _run(r: ModelRunner, B: int, steps: int, batched: bool, prompt: int) -> tuple[float, list[list[int]]]:
    nxt = _prefill(r, B, prompt, seed=B)
    out: list[list[int]] = [[] for _ in range(B)]
    t0 = time.perf_counter()
    for _ in range(steps):
        if batched:
            res = r.rows_batch([(s, [nxt[s]]) for s in range(B)])
        else:
            res = [r.rows(s, [nxt[s]]) for s in range(B)]
        nxt = [t[0] for t in res]
        for s in range(B):
            out[s].append(nxt[s])
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN)
    ap.add_argument("--width", type=int, default=DEFAULT_WIDTH)
    a = ap.parse_args()
    rows = []
    for dt in a.dtype:
        lm = load_model(None, dtype=dt, device="cpu", mtp=False)
        r = ModelRunner(lm.model, slots=max(a.batch), max_len=a.max_len, width=a.width)
        _run(r, 1, 2, True, a.prompt)  # warm-up
        for B in a.batch:
            res = {}
            for batched in (False, True):
                times = []
                for _ in range(a.repeats):
                    dt_s, toks = _run(r, B, a.steps, batched, a.prompt)
                    times.append(dt_s)
                res[batched] = (min(times), toks)
            seq_t, seq_tok = res[False]
            bat_t, bat_tok = res[True]
            row = {
                "dtype": dt,
                "B": B,
                "steps": a.steps,
                "sequential_rows_tok_s": round(B * a.steps / seq_t, 1),
                "rows_batch_tok_s": round(B * a.steps / bat_t, 1),
                "speedup": round(seq_t / bat_t, 2),
                "tokens_equal": seq_tok == bat_tok,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        json.dumps(
            {
                "model": "baton/assets/default-model",
                "width": a.width,
                "max_len": a.max_len,
                "prompt": a.prompt,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
