"""Equal prompts in one prefill pass (an `n` > 1 request's choices, best-of-n) against as many distinct prompts
of the same length: the pass computes the equal ones once and copies the state (baton/engine/prefill.py
shared_pieces). Prints one JSON object: the median wall time of a pass of N equal prompts, of N distinct
prompts, and of one prompt alone.

    python benchmarks/bench_shared_prompt.py                                   # CPU, the embedded model
    python benchmarks/bench_shared_prompt.py --device cuda --random-init qwen3.5-9b --prompt 512 --n 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.prefill import Piece, run_pass  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from benchmarks.report import emit, header  # noqa: E402

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "baton" / "assets" / "default-model"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-init", default=None, help="a shape of baton/random_init.py (default: the embedded model)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.random_init:
        from baton.loading import random_model
        from baton.random_init import shape

        lm = random_model(shape(a.random_init), dtype="bf16", device=a.device, seed=0, mtp=True)
    else:
        from baton.loading import load_model

        lm = load_model(DEFAULT_DIR, dtype="fp32" if a.device == "cpu" else "bf16", device=a.device)
    r = ModelRunner(lm.model, slots=a.n, max_len=a.prompt + 64, width=8)
    rng = random.Random(0)
    same = [rng.randrange(lm.cfg.vocab_size) for _ in range(a.prompt)]
    distinct = [[rng.randrange(lm.cfg.vocab_size) for _ in range(a.prompt)] for _ in range(a.n)]

    def timed(ps) -> float:
        run_pass(r, ps)  # warm-up
        out = []
        for _ in range(a.reps):
            _sync(a.device)
            t0 = time.perf_counter()
            run_pass(r, ps)
            _sync(a.device)
            out.append(time.perf_counter() - t0)
        return round(statistics.median(out) * 1e3, 2)

    equal_ms = timed([Piece(s, list(same)) for s in range(a.n)])
    distinct_ms = timed([Piece(s, distinct[s]) for s in range(a.n)])
    one_ms = timed([Piece(0, list(same))])
    res = {
        **header(__file__, argv),
        "device": a.device,
        "model": a.random_init or "embedded default",
        "prompt_tokens": a.prompt,
        "n": a.n,
        "equal_ms": equal_ms,
        "distinct_ms": distinct_ms,
        "one_ms": one_ms,
        "distinct_over_equal": round(distinct_ms / equal_ms, 2),
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
