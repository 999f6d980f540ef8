"""The rows GEMM (baton/kernels/gemv.py) at batch sizes M > 16: which BLOCK_M / warps / stages serve a
batched step (M = sessions) and a batched verify (M = sessions x (K + 1)) best, with every row bitwise the
M <= 16 kernel's (batch invariance). Prints one JSON object.

    python benchmarks/sweep_rows_m.py --ms 16,32,64,72,128,144,288,320 --out R.json

For each merged projection of the 9B step (bf16 and fp8 weights) and each M: the time of gemv.linear with
today's config (pick_config: BLOCK_M 16, then up to BATCH_BLOCK_M), with each variant (BLOCK_M, warps,
stages; BLOCK_N, BLOCK_K and the K split stay the M <= 16 config's, so the K order of a row cannot change),
and cuBLAS BF16 at M. A variant counts only if its first 16 rows are torch.equal to the M = 16 kernel's
on the same x rows. "step_ms": the count-weighted sum over one forward (24 GDN + 8 attention layers + the
LM head) for today's config, the best bitwise variant a shape, and cuBLAS.

Every time is a CUDA-graph replay over enough weight copies that each call reads HBM (bench_fp8_gemv.py).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from baton.kernels import gemv, wide  # noqa: E402
from benchmarks.bench_fp8_gemv import Weights, make_x, time_shape  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from benchmarks.sweep_gemv import SHAPES as GEMV_SHAPES  # noqa: E402
from benchmarks.sweep_gemv import H  # noqa: E402

# the fused rows path's merged projections (baton/engine/fast_rows.py) -> (N, K, count per forward): sweep_gemv's,
# with the GDN in-projection as the fused path runs it (qkv | z | b | a in one GEMM)
SHAPES = {"gdn_qkvzba": (12352, H, 24)}
SHAPES.update((k, v) for k, v in GEMV_SHAPES.items() if k not in ("gdn_qkvz", "gdn_ba"))


def variants(base: gemv.Config, M: int, block_ms, warps, stages, block_ns=(), xms=(False,)) -> list[gemv.Config]:
    """base with BLOCK_M / BLOCK_N / warps / stages / orientation varied (never the K order: BLOCK_K, split,
    k_per_split kept; BLOCK_N only sets how many weight rows share a program). xm: the x rows on the MMA's
    M side (Config.xm), tiles of >= 64 rows."""
    out = []
    grid = itertools.product(xms, block_ms, block_ns or [base.block_n], warps, stages or [base.num_stages])
    for xm, bm, bn, w, s in grid:
        if bm < 16 or (bm > 16 and bm // 2 >= M) or (xm and (bm < 64 or bn < 32)):
            continue  # a tile of rows more than twice M: only padding
        out.append(gemv.Config(bm, bn, base.block_k, base.split, base.k_per_split, w, s, xm))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16,32,64,72,128,144,288,320")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--block-ms", default="32,64,128,256")
    ap.add_argument("--block-ns", default="base", help="BLOCK_N (weight rows a program) to try; base: M <= 16's")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--xm", default="0", help="orientations: 0 swap-AB (today), 1 x rows on the MMA's M side")
    ap.add_argument("--stages", default="base", help="num_stages to try; base: the M <= 16 config's")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    ms = [int(m) for m in a.ms.split(",")]
    block_ms = [int(b) for b in a.block_ms.split(",")]
    warps = [int(w) for w in a.warps.split(",")]
    xms = [x == "1" for x in a.xm.split(",")]
    block_ns = [] if a.block_ns == "base" else [int(b) for b in a.block_ns.split(",")]
    stages = [] if a.stages == "base" else [int(s) for s in a.stages.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    sms = gemv.sm_count(torch.device("cuda"))
    res = {
        "benchmark": "sweep_rows_m",
        "command": " ".join(["python", "benchmarks/sweep_rows_m.py"] + (argv or sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "batch_block_m": gemv.BATCH_BLOCK_M,
        "rows": [],
    }
    top = max(ms)
    for name in a.shapes.split(","):
        N, K, count = SHAPES[name]
        n_copies = max(1, min(a.calls, -(-4 * l2 // (N * K))))
        copies = [Weights(N, K, gen) for _ in range(n_copies)]
        xs = make_x(top, K, gen)
        for kind in a.kinds.split(","):
            fp8 = kind == "fp8"

            def lin(x, w, cfg, fp8=fp8):
                return gemv.linear(x, w.fp8, w.scale, cfg=cfg) if fp8 else gemv.linear(x, w.bf16, cfg=cfg)

            w0 = copies[0]
            ref16 = lin(xs["bf16"][:16].contiguous(), w0, gemv.pick_config(16, N, K, sms, fp8=fp8))
            for M in ms:
                x = {"bf16": xs["bf16"][:M].contiguous()}
                base = gemv.pick_config(M, N, K, sms, fp8=fp8)
                row = {"name": name, "kind": kind, "N": N, "K": K, "M": M, "count": count}
                row["today"] = base.__dict__
                row["today_us"] = time_shape(lambda xx, w, c=base: lin(xx["bf16"], w, c), x, copies, a.calls)
                row["today_bitwise"] = torch.equal(lin(x["bf16"], w0, base)[: min(M, 16)], ref16[: min(M, 16)])
                if not fp8:
                    row["cublas_us"] = time_shape(
                        lambda xx, w: torch.nn.functional.linear(xx["bf16"], w.bf16), x, copies, a.calls
                    )
                if not fp8 and base.split == 1:  # the prefill's GEMM (x rows on the MMA's M side, BLOCK_K 64)
                    row["wide_us"] = time_shape(lambda xx, w: wide.linear(xx["bf16"], w.bf16), x, copies, a.calls)
                    yw = wide.linear(x["bf16"], w0.bf16)[: min(M, 16)]
                    row["wide_bitwise"] = torch.equal(yw, ref16[: min(M, 16)])
                    row["wide_max_diff"] = (yw.float() - ref16[: min(M, 16)].float()).abs().max().item()
                    bk0, wide.BLOCK_K = wide.BLOCK_K, 128  # the rows kernel's BLOCK_K: does the K chunking matter?
                    try:
                        yw = wide.linear(x["bf16"], w0.bf16)[: min(M, 16)]
                        row["wide_bk128_bitwise"] = torch.equal(yw, ref16[: min(M, 16)])
                        row["wide_bk128_us"] = time_shape(
                            lambda xx, w: wide.linear(xx["bf16"], w.bf16), x, copies, a.calls
                        )
                    except Exception as e:
                        row["wide_bk128_error"] = f"{type(e).__name__}: {str(e)[:80]}"
                    finally:
                        wide.BLOCK_K = bk0
                tried = []
                for cfg in variants(base, M, block_ms, warps, stages, block_ns, xms):
                    try:
                        y = lin(x["bf16"], w0, cfg)
                        us = time_shape(lambda xx, w, c=cfg: lin(xx["bf16"], w, c), x, copies, a.calls)
                    except Exception as e:  # e.g. out of shared memory / registers
                        tried.append({"cfg": cfg.__dict__, "error": f"{type(e).__name__}: {str(e)[:80]}"})
                        continue
                    ok = torch.equal(y[: min(M, 16)], ref16[: min(M, 16)])
                    tried.append(
                        {
                            "bm": cfg.block_m,
                            "bn": cfg.block_n,
                            "w": cfg.num_warps,
                            "s": cfg.num_stages,
                            "us": us,
                            "bitwise": ok,
                        }
                    )
                good = [t for t in tried if t.get("bitwise")]
                if good:
                    best = min(good, key=lambda t: t["us"])
                    row["best"] = best
                    row["best_us"] = best["us"]
                row["variants"] = tried
                print(
                    f"{name:12s} {kind} M={M:4d} today {row['today_us']:8.1f} us"
                    f" best {row.get('best_us', float('nan')):8.1f} {row.get('best')}"
                    f" cublas {row.get('cublas_us', float('nan')):8.1f}"
                    f" wide {row.get('wide_us', float('nan')):8.1f} {row.get('wide_bitwise')}"
                    f" bk128 {row.get('wide_bk128_us', float('nan')):8.1f} {row.get('wide_bk128_bitwise')}",
                    file=sys.stderr,
                    flush=True,
                )
                res["rows"].append(row)
        del copies
    steps = {}
    for kind in a.kinds.split(","):
        for M in ms:
            rs = [r for r in res["rows"] if r["kind"] == kind and r["M"] == M]
            pt = {}
            for key in ("today_us", "best_us", "cublas_us"):
                if rs and all(key in r for r in rs):
                    pt[key[:-3] + "_ms"] = round(sum(r[key] * r["count"] for r in rs) / 1e3, 3)
            steps[f"{kind}@{M}"] = pt
    res["step_ms"] = steps
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
