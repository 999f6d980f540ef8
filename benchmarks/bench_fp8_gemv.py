"""FP8 (W8A8) Triton rows GEMM (baton/kernels/gemv.py) vs cuBLAS BF16 vs torch._scaled_mm at decode width M (default 16).

Shapes: Qwen3.5-9B decode (hidden 4096, intermediate 12288; 24 GDN + 8 attention layers, each with
an MLP; LM head 4096 -> 248320). Every figure is a CUDA-graph replay timed with CUDA events:
    per shape   one graph of --calls GEMMs cycling over enough weight copies (>= 4x L2) that each
                call reads its weight from HBM; us = graph time / calls
    step_sum    sum over the step of count x per-shape time
    step_graph  all 32 layers' projections + LM head (distinct weights) in one graph, layer order:
                the real per-step weight-GEMM cost (compare: BF16 M=16 5.11 ms, measured before)
TB/s = weight bytes read / time (FP8: e4m3 bytes + fp32 scales). `_scaled_mm` gets a pre-quantised
x (row-wise scales), so its time is a lower bound. --sweep also times a small grid of tile configs
per shape and reports the best next to the heuristic's (pick_config).

    python benchmarks/bench_fp8_gemv.py --out benchmarks/results/fp8-gemv-h200-DATE.json [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from baton.kernels import gemv as fk  # noqa: E402
from decode_worker.fp8 import quantize_rows  # noqa: E402

H, I, V = 4096, 12288, 248320
N_GDN, N_ATTN = 24, 8
# name: (N, K, count per decode step)
SHAPES = {
    "mlp_gate": (I, H, N_GDN + N_ATTN),
    "mlp_up": (I, H, N_GDN + N_ATTN),
    "mlp_down": (H, I, N_GDN + N_ATTN),
    "gdn_in_proj_qkv": (8192, H, N_GDN),
    "gdn_in_proj_z": (4096, H, N_GDN),
    "gdn_out_proj": (H, 4096, N_GDN),
    "attn_q_proj": (8192, H, N_ATTN),
    "attn_k_proj": (1024, H, N_ATTN),
    "attn_v_proj": (1024, H, N_ATTN),
    "attn_o_proj": (H, 4096, N_ATTN),
    "lm_head": (V, H, 1),
}
GDN_LAYER = ("gdn_in_proj_qkv", "gdn_in_proj_z", "gdn_out_proj", "mlp_gate", "mlp_up", "mlp_down")
ATTN_LAYER = ("attn_q_proj", "attn_k_proj", "attn_v_proj", "attn_o_proj", "mlp_gate", "mlp_up", "mlp_down")


def graph_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph that runs fn() once (after two eager warm-ups)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1))
    del g
    return statistics.median(times)


class Weights:
    """One (N, K) weight in the three formats: bf16 [N, K], e4m3 [N, K] + fp32 scale [N]."""

    def __init__(self, N: int, K: int, gen: torch.Generator):
        self.bf16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        self.fp8, self.scale = quantize_rows(self.bf16)
        self.scale_b = self.scale[None, :]  # [1, N] for _scaled_mm
        self.bytes_bf16 = self.bf16.numel() * 2
        self.bytes_fp8 = self.fp8.numel() + self.scale.numel() * 4


def make_x(M: int, K: int, gen: torch.Generator) -> dict:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, s = quantize_rows(x)  # row-wise x for _scaled_mm
    return {"bf16": x, "fp8": q, "scale": s[:, None].contiguous()}  # scale [M, 1]


def methods(cfg=None) -> dict:
    return {
        "triton_fp8": lambda x, w: fk.linear(x["bf16"], w.fp8, w.scale, cfg=cfg),
        "cublas_bf16": lambda x, w: torch.nn.functional.linear(x["bf16"], w.bf16),
        "scaled_mm_fp8": lambda x, w: torch._scaled_mm(
            x["fp8"], w.fp8.t(), scale_a=x["scale"], scale_b=w.scale_b, out_dtype=torch.bfloat16
        ),
    }


def time_shape(fn, x, copies, calls: int) -> float:
    def body():
        for i in range(calls):
            fn(x, copies[i % len(copies)])

    return graph_ms(body) * 1e3 / calls  # us per call


def bench_shapes(M: int, calls: int, l2_bytes: int, gen) -> tuple[list, dict]:
    rows, xs = [], {}
    for name, (N, K, count) in SHAPES.items():
        n_copies = max(1, min(calls, -(-4 * l2_bytes // (N * K))))  # >= 4x L2 of e4m3 bytes
        copies = [Weights(N, K, gen) for _ in range(n_copies)]
        x = xs.setdefault(K, make_x(M, K, gen))
        w = copies[0]
        y = fk.linear(x["bf16"], w.fp8, w.scale)
        ref = x["bf16"].float() @ (w.fp8.float() * w.scale[:, None]).T
        row = {
            "name": name,
            "N": N,
            "K": K,
            "count": count,
            "copies": n_copies,
            "config": fk.pick_config(M, N, K, fk.sm_count(x["bf16"].device), fp8=True).__dict__,
            "rel_err_vs_dequant_fp32": ((y.float() - ref).norm() / ref.norm()).item(),
            "rel_err_vs_bf16": (
                (y.float() - torch.nn.functional.linear(x["bf16"], w.bf16).float()).norm() / ref.norm()
            ).item(),
            "deterministic": all(torch.equal(y, fk.linear(x["bf16"], w.fp8, w.scale)) for _ in range(3)),
            "us": {},
            "tbps": {},
        }
        for meth, fn in methods().items():
            try:
                us = time_shape(fn, x, copies, calls)
            except Exception as e:  # e.g. no row-wise _scaled_mm
                row["us"][meth] = None
                row.setdefault("errors", {})[meth] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            nbytes = w.bytes_bf16 if meth == "cublas_bf16" else w.bytes_fp8
            row["us"][meth] = round(us, 3)
            row["tbps"][meth] = round(nbytes / us / 1e6, 3)
        print(f"{name:16s} N={N:6d} K={K:5d} " + " ".join(f"{k}={v}" for k, v in row["us"].items()), file=sys.stderr)
        rows.append(row)
        del copies
    step = {
        m: round(sum(r["count"] * r["us"][m] for r in rows) / 1e3, 4) if all(r["us"].get(m) for r in rows) else None
        for m in methods()
    }
    return rows, step


def bench_step_graph(M: int, gen) -> dict:
    """All decode-step weight GEMMs with distinct weights in one graph (layer order), per method."""
    layers = [GDN_LAYER] * 3 + [ATTN_LAYER]  # 3 GDN : 1 attention
    plan = [names for _ in range((N_GDN + N_ATTN) // 4) for names in layers] + [("lm_head",)]
    weights = [[Weights(*SHAPES[n][:2], gen) for n in names] for names in plan]
    xs = {K: make_x(M, K, gen) for K in {SHAPES[n][1] for n in SHAPES}}
    nbytes = {
        "bf16": sum(w.bytes_bf16 for ws in weights for w in ws),
        "fp8": sum(w.bytes_fp8 for ws in weights for w in ws),
    }
    out = {
        "gemms": sum(len(ws) for ws in weights),
        "bytes_bf16": nbytes["bf16"],
        "bytes_fp8": nbytes["fp8"],
        "ms": {},
        "tbps": {},
    }
    for meth, fn in methods().items():

        def body():
            for ws in weights:
                for w in ws:
                    fn(xs[w.bf16.shape[1]], w)

        try:
            ms = graph_ms(body, reps=10)
        except Exception as e:
            out["ms"][meth] = None
            out.setdefault("errors", {})[meth] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        b = nbytes["bf16"] if meth == "cublas_bf16" else nbytes["fp8"]
        out["ms"][meth] = round(ms, 4)
        out["tbps"][meth] = round(b / ms / 1e9, 3)
        print(f"step_graph {meth}: {ms:.3f} ms", file=sys.stderr)
    return out


def sweep(M: int, calls: int, l2_bytes: int, gen) -> list:
    """Best tile config per distinct (N, K) over a small grid; compile failures are skipped."""
    sms = fk.sm_count(torch.device("cuda"))
    grid = list(itertools.product((32, 64, 128), (128, 256), (2, 4), (3, 4)))  # block_n, block_k, pps, stages
    out = []
    for N, K in sorted({v[:2] for v in SHAPES.values()}):
        n_copies = max(1, min(calls, -(-4 * l2_bytes // (N * K))))
        copies = [Weights(N, K, gen) for _ in range(n_copies)]
        x = make_x(M, K, gen)
        heur = fk.pick_config(M, N, K, sms, fp8=True)
        results = []
        for bn, bk, pps, st in grid:
            cfg = fk.pick_config(M, N, K, sms, fp8=True, block_n=bn, block_k=bk, programs_per_sm=pps, num_stages=st)
            try:
                us = time_shape(lambda xx, w: fk.linear(xx["bf16"], w.fp8, w.scale, cfg=cfg), x, copies, calls)
            except Exception:
                continue
            results.append((us, cfg))
        heur_us = time_shape(lambda xx, w: fk.linear(xx["bf16"], w.fp8, w.scale, cfg=heur), x, copies, calls)
        best_us, best = min(results, key=lambda r: r[0])
        out.append(
            {
                "N": N,
                "K": K,
                "heuristic": heur.__dict__,
                "heuristic_us": round(heur_us, 3),
                "best": best.__dict__,
                "best_us": round(best_us, 3),
                "tried": len(results),
            }
        )
        print(f"sweep N={N} K={K}: heuristic {heur_us:.2f} us, best {best_us:.2f} us {best}", file=sys.stderr)
        del copies
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--m", type=int, default=16, help="rows (decode width W)")
    ap.add_argument("--calls", type=int, default=48, help="GEMMs per timed graph (per-shape figures)")
    ap.add_argument("--sweep", action="store_true", help="also time a small grid of tile configs")
    ap.add_argument("--no-step-graph", action="store_true", help="skip the whole-step graph (needs ~26 GB)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_gemv: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 * 2**20) or 60 * 2**20
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, step_sum = bench_shapes(a.m, a.calls, l2, gen)
    res = {
        "bench": "fp8_gemv",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/bench_fp8_gemv.py"] + (argv or sys.argv[1:])),
        "device": props.name,
        "sms": props.multi_processor_count,
        "l2_bytes": l2,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "M": a.m,
        "shapes": rows,
        "step_sum_ms": step_sum,
    }
    if not a.no_step_graph:
        res["step_graph"] = bench_step_graph(a.m, gen)
    if a.sweep:
        res["sweep"] = sweep(a.m, a.calls, l2, gen)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
