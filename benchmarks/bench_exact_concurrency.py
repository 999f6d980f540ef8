"""Exact mode at 1 and 8 concurrent streams through an in-process router, prefill worker and decode
worker on the CPU (embedded default model, fp32, 48 new tokens, fp8 and mtp drafts). Prints one JSON
object: output tok/s of all streams per (engine, streams).

    OMP_NUM_THREADS=1 python benchmarks/bench_exact_concurrency.py
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor

from baton.client import Client
from baton.loading import load_model
from baton.settings import Settings
from decode_worker.serve import serve_decode
from prefill_worker.serve import serve_prefill
from router.__main__ import serve_router, stop_router

lm = load_model(None, dtype="fp32", device="cpu", mtp=True)
st = Settings()
ph, ps = serve_prefill(lm, max_len=256, slots=8, settings=st)
dh, ds = serve_decode(lm, engines=("bf16", "fp8", "mtp"), max_len=256, slots=8, settings=st, default_engine="fp8")
rh, rs = serve_router(prefill=[ph.address], decode=[dh.address], settings=st)
c = Client(rh.address)
while c.health() != "SERVING":
    time.sleep(0.05)
P = [f"def f{i}(x):\n    return x + {i}\n\n\ndef g{i}(" for i in range(8)]


def gen(i, eng):
    n = 0
    for d in c.generate(P[i], max_new_tokens=48, mode="exact", engine=eng, ignore_eos=True, timeout=300):
        n += len(d.token_ids)
    return n


out = {}
for eng in ("fp8", "mtp"):
    gen(0, eng)
    for N in (1, 8):
        t = time.monotonic()
        with ThreadPoolExecutor(N) as ex:
            tot = sum(ex.map(lambda i: gen(i, eng), range(N)))
        out[f"{eng}_{N}"] = round(tot / (time.monotonic() - t), 1)
print(json.dumps(out))
c.close()
stop_router(rh, rs, 0)
ph.stop(0)
dh.stop(0)
