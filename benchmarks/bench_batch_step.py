"""The batched AR step alone (fused_batch.BatchedAR under CUDA graphs), at several batch sizes: GPU time
per step, tokens/s of all rows, and the bandwidth floor at that batch, for bf16 and fp8; optionally the
per-part GPU time of one batched step, and HF transformers `generate` at batch N. Prints one JSON object.

    python benchmarks/bench_batch_step.py --random-init qwen3.5-9b --context 512 --batches 1,8,32,64,128 \
        [--engines bf16,fp8] [--profile] [--hf-new 32] --out R.json

Every slot sits at position `context` (state zero: the step's cost does not depend on its values). One
point: `reps` back-to-back step() calls (replay + token read-back, as the step scheduler runs them).
floor_tok_s = B / ((weights + B * (GDN state read+write + KV of `context` tokens)) / measured HBM bw).
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine import graph  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from baton.loading import random_model  # noqa: E402
from baton.random_init import shape  # noqa: E402
from benchmarks.bench_decode import hbm_bandwidth, step_bytes  # noqa: E402
from benchmarks.profile_step import group  # noqa: E402
from benchmarks.report import emit, machine  # noqa: E402


def _profile(r: ModelRunner, slots: list[int]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    b = r.batched
    b.slots[: len(slots)].copy_(torch.tensor(slots))
    p = len(slots)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        b.compute(p)
        torch.cuda.synchronize()
    parts = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            parts[group(e.name)] += e.device_time
    return {k: round(v / 1e3, 3) for k, v in parts.most_common()}


def _hf(model, cfg, batch: int, context: int, new: int) -> float:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hc = Qwen3_5TextConfig.from_dict(cfg.hf_text_config)
    with torch.device("cuda"):
        hf = Qwen3_5ForCausalLM(hc).to(torch.bfloat16).eval()
    hf.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}, strict=False)
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device="cuda")
    hf.generate(ids[:, :16], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del hf
    torch.cuda.empty_cache()
    return batch * (out.shape[1] - context) / dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--random-init", default="qwen3.5-9b")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--engines", default="bf16,fp8")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--hf-new", type=int, default=0, help="HF generate at each batch with this many new tokens")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    cfg = shape(a.random_init)
    res = {
        "command": " ".join(["python", "benchmarks/bench_batch_step.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "context": a.context,
        "hbm_bytes_per_s": hbm_bandwidth(),
        "results": {},
    }
    lm = random_model(cfg, dtype="bf16", device="cuda", seed=0, mtp=False)
    S = max(batches)
    for e in a.engines.split(","):
        model = lm.model
        if e == "fp8":
            from decode_worker.fp8 import quantize_model

            model = copy.deepcopy(lm.model)
            quantize_model(model, "full")
        r = ModelRunner(model, slots=S, max_len=a.context + a.reps + 64, width=16)
        r.enable_batching(S)
        t0 = time.perf_counter()
        gs = graph.capture_all(r, ns={"arb": r.batched.buckets})
        one = step_bytes(model, r.state, 0)  # weights + one row's GDN state (context 0)
        row_state = sum(t[0].numel() * t.element_size() for t in r.state.recurrent.values()) * 2
        row_kv = r.state.kv_bytes_per_token() * a.context
        weights = one - row_state
        pts = []
        for b in batches:
            slots = list(range(b))
            r.state.position.fill_(a.context)
            r.ar_batch(slots)  # warm
            times = []
            for _ in range(a.reps):
                t1 = time.perf_counter()
                r.ar_batch(slots)
                times.append(time.perf_counter() - t1)
            step = statistics.median(times)
            floor = b / ((weights + b * (row_state + row_kv)) / res["hbm_bytes_per_s"])
            pt = {
                "batch": b,
                "step_ms": step * 1e3,
                "tok_s": b / step,
                "floor_tok_s": floor,
                "of_floor": b / step / floor,
            }
            if a.profile:
                r.state.position.fill_(a.context)
                pt["parts_ms"] = _profile(r, slots)
            pts.append(pt)
            print(pt, file=sys.stderr, flush=True)
        res["results"][e] = {"capture_s": time.perf_counter() - t0, "graphs": gs.graphs, "points": pts}
        del r
        torch.cuda.empty_cache()
    if a.hf_new:
        res["hf"] = []
        for b in batches:
            try:
                res["hf"].append({"batch": b, "tok_s": _hf(lm.model, cfg, b, a.context, a.hf_new)})
            except Exception as ex:  # noqa: BLE001 - recorded, the run goes on
                res["hf"].append({"batch": b, "error": repr(ex)[:300]})
            print(res["hf"][-1], file=sys.stderr, flush=True)
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
