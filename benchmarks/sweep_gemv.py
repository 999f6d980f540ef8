"""Tile-config sweep of the split-K Triton GEMV (decode_worker/fp8_kernel.py) at decode width M = 16, for
the merged projection shapes the fused rows path runs (baton/models/fast_rows.py), with FP8 weights
and with BF16 weights (scale = 1), next to cuBLAS BF16. Prints one JSON object.

    python benchmarks/sweep_gemv.py --out benchmarks/results/gemv-sweep-h200-DATE.json

Every time is a CUDA-graph replay over enough weight copies that each call reads HBM (see
bench_fp8_gemv.py). "best" is the fastest config of the grid; the kernel is bitwise repeatable per
config, and every M <= 16 shares one config, so any choice keeps row invariance.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402

import torch  # noqa: E402

from benchmarks.bench_fp8_gemv import Weights, make_x, time_shape  # noqa: E402
from decode_worker import fp8_kernel as fk  # noqa: E402

H, I, V = 4096, 12288, 248320
# merged shapes of the Qwen3.5-9B step: name -> (N, K, count per step)
SHAPES = {"gdn_qkvz": (12288, H, 24), "gdn_out": (H, 4096, 24), "attn_qkv": (10240, H, 8), "attn_o": (H, 4096, 8),
          "mlp_gate_up": (2 * I, H, 32), "mlp_down": (H, I, 32), "lm_head": (V, H, 1)}
GRID = list(itertools.product((32, 64, 128), (256, 512), (2, 4), (4, 8)))   # block_n, block_k, pps, warps
BF16_SWEEP = {"gdn_qkvz", "gdn_out", "attn_qkv", "attn_o", "mlp_down"}   # where cuBLAS is weakest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    sms = fk.sm_count(torch.device("cuda"))
    res = {"command": " ".join(["python", "benchmarks/sweep_gemv.py"] + (argv or sys.argv[1:])),
           "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "M": a.m, "shapes": []}
    for name, (N, K, count) in SHAPES.items():
        copies = [Weights(N, K, gen) for _ in range(max(1, min(a.calls, -(-4 * l2 // (N * K)))))]
        ones = torch.ones(N, device="cuda")
        x = make_x(a.m, K, gen)
        row = {"name": name, "N": N, "K": K, "count": count,
               "cublas_bf16_us": time_shape(lambda xx, w: torch.nn.functional.linear(xx["bf16"], w.bf16), x, copies,
                                            a.calls)}
        for wdt in ("fp8", "bf16") if name in BF16_SWEEP else ("fp8",):
            def run(cfg, wdt=wdt):
                if wdt == "fp8":
                    return lambda xx, w: fk.w8a16_linear(xx["bf16"], w.fp8, w.scale, cfg)
                return lambda xx, w: fk.w8a16_linear(xx["bf16"], w.bf16, ones, cfg)
            heur = fk.pick_config(a.m, N, K, sms)
            best = (time_shape(run(heur), x, copies, a.calls), heur)
            row[f"{wdt}_heuristic_us"] = best[0]
            for bn, bk, pps, warps in GRID:
                cfg = fk.pick_config(a.m, N, K, sms, block_n=bn, block_k=bk, programs_per_sm=pps, num_warps=warps)
                try:
                    us = time_shape(run(cfg), x, copies, a.calls)
                except Exception:
                    continue
                best = min(best, (us, cfg), key=lambda b: b[0])
            row[f"{wdt}_best_us"], row[f"{wdt}_best"] = best[0], best[1].__dict__
            nbytes = N * K * (1 if wdt == "fp8" else 2)
            row[f"{wdt}_best_tbps"] = nbytes / best[0] / 1e6
        row["cublas_bf16_tbps"] = N * K * 2 / row["cublas_bf16_us"] / 1e6
        print(json.dumps(row), flush=True)
        res["shapes"].append(row)
        del copies
    for k in ("cublas_bf16_us", "fp8_heuristic_us", "fp8_best_us"):
        res[f"step_{k[:-3]}_ms"] = sum(r[k] * r["count"] for r in res["shapes"]) / 1e3
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
