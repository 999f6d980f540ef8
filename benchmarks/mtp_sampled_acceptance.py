"""MTP acceptance at T > 0 on the embedded default model (CPU, fp32): fast-mode mtp sessions, seeded,
64 tokens from three prompts at T = 0.7 and 1.0; prints whether each output equals the exact engine's
seeded AR decode and the mean accepted length per round.

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/mtp_sampled_acceptance.py
"""

from baton.engine.runner import ModelRunner
from baton.engine.sampling import Params
from baton.loading import load_model, resolve_model_dir
from baton.tokenizer import Tokenizer
from decode_worker.engine import DecodeEngine
from prefill_worker.engine import ExactEngine

lm = load_model(None, dtype="fp32", device="cpu", mtp=True)
tok = Tokenizer.from_dir(resolve_model_dir(None))
ex = ExactEngine(ModelRunner(lm.model, slots=1, max_len=256))
r = ModelRunner(lm.model, slots=1, max_len=256, checkpoints=True)
eng = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp")
tot_acc = []
for T in (0.7, 1.0):
    rs = []
    same = True
    for i, prompt in enumerate(
        ["def fibonacci(n):", "import os\nimport sys\n", "class Config:\n    def __init__(self"]
    ):
        p = Params(temperature=T, seed=11 + i)
        ids = tok.encode(prompt)
        ref = ex.generate(ids, 64, sampling=p)
        s, first = ex.prefill(ids, sampling=p)
        tensors, pos, nxt = ex.export(s.id)
        d = eng.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine="mtp")
        ex.release(s.id)
        r.sampling.set(d.slot, p)
        out = [first] + [t for b in eng.decode(d.id, 63, k=4) for t in b]
        same &= out == ref
        rs.append(d.mean_accept_len)
        eng.release(d.id)
    print(T, "identical", same, "mean accept len", [round(x, 2) for x in rs])
