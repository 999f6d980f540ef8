"""Where the fixed ~6 us per rows GEMM goes (H200): times, per call inside one CUDA graph over distinct
weights (every call reads HBM), the rows GEMM next to kernels that only stream the same bytes with the
same grid, with a persistent grid, and an empty kernel. Also the small per-layer kernels of the step.
Prints one JSON object.

    python benchmarks/probe_overhead.py --out benchmarks/results/probe-overhead-h200-DATE.json

Differences between rows tell the cost of each stage (the method: leave one stage out, take differences).
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from baton.kernels import gdn, gdn_conv, gemv, rows  # noqa: E402


@triton.jit
def _empty(p):
    pass


@triton.jit
def _read_tiles(w_ptr, out_ptr, N, K, K_PER_SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # the GEMM's grid and loads, no math: sum of the bytes so nothing is dead
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = pid_s * K_PER_SPLIT
    p = w_ptr + rn[:, None].to(tl.int64) * K + (k0 + rk)[None, :]
    acc = tl.zeros((BN, BK), dtype=tl.int32)
    for k in range(0, K_PER_SPLIT, BK):
        acc += tl.load(p + k, eviction_policy="evict_first").to(tl.int32)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_s, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _read_persistent(w_ptr, out_ptr, n_bytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # program i streams bytes [i*CHUNK, (i+1)*CHUNK) as int32 words, BLOCK words per load
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (CHUNK // 4)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(0, CHUNK // 4, BLOCK):
        acc = acc ^ tl.load(w_ptr + base + i + offs, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def graph_us(body, calls: int, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up / compile
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    ts.sort()
    return round(ts[len(ts) // 2], 3)


def handoff(us: dict, C: int, dev) -> None:
    """The w8a8 hand-off's pieces at W = 16, rows = 1: GEMMs with x quantised in the loop or arriving as a
    QuantX, with the in-kernel split-K reduction or partials out; the norm plain, summing partials,
    quantising."""
    W, H = 16, 4096
    for N, K in ((4096, 4096), (12288, 4096), (4096, 12288), (24576, 4096)):
        ws = [(torch.randn(N, K, device=dev) * 0.05).to(torch.float8_e4m3fn) for _ in range(C)]
        sc = torch.rand(N, device=dev) + 0.5
        x = torch.randn(W, K, device=dev, dtype=torch.bfloat16)
        xq = rows.add_rmsnorm(x, None, torch.zeros(K, device=dev, dtype=torch.bfloat16), 1e-6, quant=True)[1]
        glu = N == 24576
        tag = f"{N}x{K}"
        us[f"h_gemm_{tag}"] = graph_us(lambda: [gemv.linear(x, w, sc, rows=1, glu=glu) for w in ws], C)
        us[f"h_gemm_{tag}_xq"] = graph_us(lambda: [gemv.linear(xq, w, sc, rows=1, glu=glu) for w in ws], C)
        if not glu:
            us[f"h_gemm_{tag}_partial"] = graph_us(lambda: [gemv.linear(x, w, sc, rows=1, partial=True) for w in ws], C)
            us[f"h_gemm_{tag}_xq_partial"] = graph_us(
                lambda: [gemv.linear(xq, w, sc, rows=1, partial=True) for w in ws], C
            )
            for split in (2, 4):
                c = gemv.pick_config(
                    W, N, K, gemv.sm_count(dev), fp8=True, block_n=64, block_k=128, split=split, num_stages=4
                )
                us[f"h_gemm_{tag}_xq_partial_s{split}"] = graph_us(
                    lambda: [gemv.linear(xq, w, sc, rows=1, partial=True, cfg=c) for w in ws], C
                )
        ws = None  # free the weights before the next shape
    xs = [torch.randn(W, H, device=dev, dtype=torch.bfloat16) for _ in range(C)]
    rw = torch.randn(H, device=dev, dtype=torch.bfloat16)
    us["h_norm"] = graph_us(lambda: [rows.add_rmsnorm(x, x, rw, 1e-6, rows=1) for x in xs], C)
    us["h_norm_quant"] = graph_us(lambda: [rows.add_rmsnorm(x, x, rw, 1e-6, rows=1, quant=True) for x in xs], C)
    for S in (1, 2, 4, 8):
        ps = [torch.randn(S, W, H, device=dev) for _ in range(C)]
        us[f"h_norm_parts{S}"] = graph_us(lambda: [rows.add_rmsnorm(p, x, rw, 1e-6, rows=1) for p, x in zip(ps, xs)], C)
        us[f"h_norm_parts{S}_quant"] = graph_us(
            lambda: [rows.add_rmsnorm(p, x, rw, 1e-6, rows=1, quant=True) for p, x in zip(ps, xs)], C
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--parts", default="grid,handoff", help="grid (GEMM vs read-only grids), handoff (w8a8 hand-off)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    dev = torch.device("cuda")
    C = a.calls
    res = {
        "command": " ".join(["python", "benchmarks/probe_overhead.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "calls": C,
        "us": {},
    }
    us = res["us"]
    out = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
    us["empty_kernel"] = graph_us(lambda: [_empty[(132,)](out) for _ in range(C)], C)
    for N, K in ((4096, 4096), (12288, 4096), (4096, 12288), (24576, 4096)) if "grid" in parts else ():
        ws = [(torch.randn(N, K, device=dev) * 0.05).to(torch.float8_e4m3fn) for _ in range(C)]
        sc = torch.rand(N, device=dev) + 0.5
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        nb = N * K
        tag = f"{N}x{K}"
        us[f"gemm_{tag}"] = graph_us(lambda: [gemv.linear(x, w, sc) for w in ws], C)
        cfg = gemv.pick_config(1, N, K, gemv.sm_count(dev), fp8=True)
        us[f"gemm_{tag}_cfg"] = cfg.__dict__
        for bn, split, warps, stages in (
            (cfg.block_n, cfg.split, cfg.num_warps, cfg.num_stages),
            (64, 1, 4, 4),
            (128, 4, 8, 4),
            (32, 1, 4, 4),
        ):
            kps = triton.cdiv(K, split)
            grid = (triton.cdiv(N, bn), split)
            us[f"read_tiles_{tag}_bn{bn}_s{split}_w{warps}_st{stages}"] = graph_us(
                lambda: [
                    _read_tiles[grid](
                        w.view(torch.uint8),
                        out,
                        N,
                        K,
                        K_PER_SPLIT=kps,
                        BN=bn,
                        BK=128,
                        num_warps=warps,
                        num_stages=stages,
                    )
                    for w in ws
                ],
                C,
            )
        for progs in (132, 264, 528):
            chunk = nb // progs // 4096 * 4096
            if chunk == 0:
                continue
            for block in (1024, 2048):
                us[f"read_persistent_{tag}_p{progs}_b{block}"] = graph_us(
                    lambda: [
                        _read_persistent[(progs,)](
                            w.view(torch.int32), out, nb, CHUNK=chunk, BLOCK=block, num_warps=4, num_stages=4
                        )
                        for w in ws
                    ],
                    C,
                )
        us[f"bytes_{tag}"] = nb
        ref = gemv.linear(x, ws[0], sc).float()
        for bn, bk, split, warps, stages in itertools.product((16, 32), (256, 512), (1, 2), (2, 4), (3, 5)):
            if split > 1 and N > 4096:
                continue
            c = gemv.Config(16, bn, bk, split, triton.cdiv(triton.cdiv(K, bk), split) * bk, warps, stages)
            key = f"gemm_{tag}_bn{bn}_bk{bk}_s{split}_w{warps}_st{stages}"
            try:
                err = ((gemv.linear(x, ws[0], sc, cfg=c).float() - ref).norm() / ref.norm()).item()
                us[key] = [graph_us(lambda: [gemv.linear(x, w, sc, cfg=c) for w in ws], C), round(err, 5)]
            except Exception as e:  # out of resources, unsupported dot
                us[key] = f"{type(e).__name__}: {str(e)[:120]}"
        ws = None  # free the weights before the next shape
    if "handoff" in parts:
        handoff(us, C, dev)
    # small per-layer kernels of the step, rows = 1
    H = 4096
    xs = [torch.randn(1, H, device=dev, dtype=torch.bfloat16) for _ in range(C)]
    rw = torch.randn(H, device=dev, dtype=torch.bfloat16)
    us["add_rmsnorm"] = graph_us(lambda: [rows.add_rmsnorm(x, x, rw, 1e-6) for x in xs], C)
    logits = torch.randn(1, 248320, device=dev, dtype=torch.bfloat16)
    us["argmax_248320"] = graph_us(lambda: [logits.argmax(-1) for _ in range(C)], C)
    nk, nv, dk, dv = 16, 32, 128, 128
    cdim = 2 * nk * dk + nv * dv
    cv_in = torch.randn(1, cdim, device=dev, dtype=torch.bfloat16)
    cst = [torch.randn(cdim, 3, device=dev, dtype=torch.bfloat16) for _ in range(C)]
    cw = torch.randn(cdim, 4, device=dev, dtype=torch.bfloat16)
    us["conv_rows"] = graph_us(lambda: [gdn_conv.conv_rows(cv_in, s, cw, 1) for s in cst], C)
    Ss = [torch.zeros(nv, dk, dv, device=dev) for _ in range(C)]
    b = torch.randn(1, nv, device=dev, dtype=torch.bfloat16)
    z = torch.randn(1, nv * dv, device=dev, dtype=torch.bfloat16)
    al, dtb, nw = torch.randn(nv, device=dev), torch.randn(nv, device=dev), torch.randn(dv, device=dev)
    us["gdn_rows"] = graph_us(lambda: [gdn.gdn_rows(cv_in, b, b, z, al, dtb, nw, S, 1, nk=nk, eps=1e-6) for S in Ss], C)
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
