"""Exact mode at several concurrencies through an in-process router, prefill worker and decode worker on
the CPU (embedded default model, fp32). Prints one JSON object: output tok/s of all streams per
(engine, streams).

    OMP_NUM_THREADS=1 python benchmarks/bench_exact_concurrency.py [--streams 1,8] [--engines fp8,mtp]
                                                                    [--new 48] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit, machine  # noqa: E402

PROMPTS = [f"def f{i}(x):\n    return x + {i}\n\n\ndef g{i}(" for i in range(64)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", default="1,8")
    p.add_argument("--engines", default="fp8,mtp")
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from baton.client import Client
    from baton.loading import load_model
    from baton.settings import Settings
    from decode_worker.serve import serve_decode
    from prefill_worker.serve import serve_prefill
    from router.__main__ import serve_router, stop_router

    streams = [int(n) for n in a.streams.split(",")]
    slots = max(streams)
    lm = load_model(None, dtype="fp32", device="cpu", mtp=True)
    st = Settings()
    ph, _ = serve_prefill(lm, max_len=256, slots=slots, settings=st)
    dh, _ = serve_decode(lm, engines=("bf16", "fp8", "mtp"), max_len=256, slots=slots, settings=st)
    rh, rs = serve_router(prefill=[ph.address], decode=[dh.address], settings=st)
    c = Client(rh.address)
    while c.health() != "SERVING":
        time.sleep(0.05)

    def gen(i: int, engine: str) -> int:
        n = 0
        for d in c.generate(
            PROMPTS[i], max_new_tokens=a.new, mode="exact", engine=engine, ignore_eos=True, timeout=600
        ):
            n += len(d.token_ids)
        return n

    res = {
        "command": " ".join(["python", "benchmarks/bench_exact_concurrency.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "tok_s": {},
    }
    try:
        for engine in a.engines.split(","):
            gen(0, engine)  # warm-up
            for n in streams:
                t0 = time.monotonic()
                with ThreadPoolExecutor(n) as ex:
                    total = sum(ex.map(lambda i, e=engine: gen(i, e), range(n)))
                res["tok_s"][f"{engine}_{n}"] = round(total / (time.monotonic() - t0), 1)
    finally:
        c.close()
        stop_router(rh, rs, 0)
        ph.stop(0)
        dh.stop(0)
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
