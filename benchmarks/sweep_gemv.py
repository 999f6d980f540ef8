"""Tile-config sweep of the skinny rows GEMM (baton/kernels/gemv.py) for the merged projection shapes of
the fused rows path (baton/engine/fast_rows.py), FP8 (W8A8) and BF16 weights, next to cuBLAS BF16.
(gemv-sweep-h200-2026-11-30-w8a8.json also has the W8A16 kernel this one replaced: "old_w8a16_us".) x is [16, K] with `--rows` valid rows (1 = an AR step). Prints one JSON object.

    python benchmarks/sweep_gemv.py --out benchmarks/results/gemv-sweep-h200-DATE.json

Every time is a CUDA-graph replay over enough weight copies that each call reads HBM (see
bench_fp8_gemv.py). Each shape also checks the kernel against a torch reference of the same arithmetic
(fp8: tests/engine/test_gemv.py's `w8a8_reference`), bitwise repeatability across graph replays, and row
invariance (rows=1 vs rows=16 on row 0).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from baton.kernels import gemv  # noqa: E402
from benchmarks.bench_fp8_gemv import Weights, make_x, time_shape  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from decode_worker.fp8 import w8a8_reference  # noqa: E402

H, I, V = 4096, 12288, 248320
# merged shapes of the Qwen3.5-9B step: name -> (N, K, count per step)
SHAPES = {
    "gdn_qkvz": (12288, H, 24),
    "gdn_out": (H, 4096, 24),
    "attn_qkv": (10240, H, 8),
    "attn_o": (H, 4096, 8),
    "mlp_gate_up": (2 * I, H, 32),
    "mlp_down": (H, I, 32),
    "lm_head": (V, H, 1),
    "gdn_ba": (64, H, 24),
}
# block_n, block_k, programs per SM, warps, stages
GRID = list(itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (4, 8), (3, 4, 6)))


def _check(fn, ref, x16, x1) -> dict:
    y = fn(x16, 16)
    return {
        "rel_err": ((y.float() - ref).norm() / ref.norm()).item(),
        "repeat": all(torch.equal(y, fn(x16, 16)) for _ in range(3)),
        "row0": torch.equal(fn(x1, 1)[0], y[0]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1, help="valid x rows of the 16 (1 = an AR step)")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--kinds", default="fp8,bf16")
    ap.add_argument("--max-block-n", type=int, default=128)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    sms = gemv.sm_count(torch.device("cuda"))
    res = {
        "command": " ".join(["python", "benchmarks/sweep_gemv.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "rows": a.rows,
        "shapes": [],
    }
    kinds = a.kinds.split(",")
    for name in a.shapes.split(","):
        N, K, count = SHAPES[name]
        copies = [Weights(N, K, gen) for _ in range(max(1, min(a.calls, -(-4 * l2 // (N * K)))))]
        x = make_x(16, K, gen)
        x1 = x["bf16"][:1].contiguous()
        w0 = copies[0]
        row = {
            "name": name,
            "N": N,
            "K": K,
            "count": count,
            "cublas_bf16_us": time_shape(
                lambda xx, w: torch.nn.functional.linear(xx["bf16"], w.bf16), x, copies, a.calls
            ),
        }
        for kind in kinds:

            def run(cfg, kind=kind):
                if kind == "fp8":
                    return lambda xx, w: gemv.linear(xx["bf16"], w.fp8, w.scale, rows=a.rows, cfg=cfg)
                return lambda xx, w: gemv.linear(xx["bf16"], w.bf16, rows=a.rows, cfg=cfg)

            fp8 = kind == "fp8"
            heur = gemv.pick_config(16, N, K, sms, fp8=fp8)
            best = (time_shape(run(heur), x, copies, a.calls), heur)
            row[f"{kind}_heuristic_us"], row[f"{kind}_heuristic"] = best[0], heur.__dict__
            for bn, bk, pps, warps, stages in GRID:
                if bn > a.max_block_n:
                    continue
                cfg = gemv.pick_config(
                    16,
                    N,
                    K,
                    sms,
                    fp8=fp8,
                    block_n=bn,
                    block_k=bk,
                    programs_per_sm=pps,
                    num_warps=warps,
                    num_stages=stages,
                )
                try:
                    us = time_shape(run(cfg), x, copies, a.calls)
                except Exception as e:  # e.g. out of shared memory
                    row.setdefault("errors", []).append(f"{cfg}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                best = min(best, (us, cfg), key=lambda b: b[0])
            row[f"{kind}_best_us"], row[f"{kind}_best"] = best[0], best[1].__dict__
            row[f"{kind}_best_tbps"] = N * K * (1 if fp8 else 2) / best[0] / 1e6
            if fp8:
                ref = w8a8_reference(x["bf16"], w0.fp8, w0.scale)
                fn = lambda xx, r: gemv.linear(xx, w0.fp8, w0.scale, rows=r, cfg=best[1])  # noqa: E731
            else:
                ref = x["bf16"].float() @ w0.bf16.float().T
                fn = lambda xx, r: gemv.linear(xx, w0.bf16, rows=r, cfg=best[1])  # noqa: E731
            row[f"{kind}_check"] = _check(fn, ref, x["bf16"], x1)
        row["cublas_bf16_tbps"] = N * K * 2 / row["cublas_bf16_us"] / 1e6
        print(json.dumps(row), flush=True)
        res["shapes"].append(row)
        del copies
    for k in ["cublas_bf16_us"] + [f"{kd}_{w}_us" for kd in kinds for w in ("heuristic", "best")]:
        if all(k in r for r in res["shapes"]):
            res[f"step_{k[:-3]}_ms"] = sum(r[k] * r["count"] for r in res["shapes"]) / 1e3
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
