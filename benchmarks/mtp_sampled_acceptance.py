"""MTP acceptance at T > 0 on the embedded default model (CPU, fp32): fast-mode mtp sessions, seeded,
64 tokens from three prompts at T = 0.7 and 1.0. Prints one JSON object: per T, whether every output
equals the exact engine's seeded AR decode, and the mean accepted tokens per round of each prompt.

    OMP_NUM_THREADS=2 python benchmarks/mtp_sampled_acceptance.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:\n    def __init__(self"]


def main() -> int:
    from baton.engine.runner import ModelRunner
    from baton.engine.sampling import Params
    from baton.loading import load_model, resolve_model_dir
    from baton.tokenizer import Tokenizer
    from decode_worker.engine import DecodeEngine
    from prefill_worker.engine import ExactEngine

    lm = load_model(None, dtype="fp32", device="cpu", mtp=True)
    tok = Tokenizer.from_dir(resolve_model_dir(None))
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=256))
    r = ModelRunner(lm.model, slots=1, max_len=256, checkpoints=True)
    eng = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length="fixed")
    out = {}
    for T in (0.7, 1.0):
        accept, same = [], True
        for i, prompt in enumerate(PROMPTS):
            p = Params(temperature=T, seed=11 + i)
            ids = tok.encode(prompt)
            ref = exact.generate(ids, 64, sampling=p)
            s, first = exact.prefill(ids, sampling=p)
            tensors, pos, nxt = exact.export(s.id)
            d = eng.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine="mtp")
            exact.release(s.id)
            r.sampling.set(d.slot, p)
            got = [first] + [t for b in eng.decode(d.id, 63, k=4) for t in b]
            same &= got == ref
            accept.append(round(d.mean_accept_len, 2))
            eng.release(d.id)
        out[f"T{T}"] = {"identical": same, "mean_accept_len": accept}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
