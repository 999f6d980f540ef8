"""baton/kernels/gemv.py: the skinny rows GEMM (bf16 weights, and W8A8 for FP8 weights).

CPU: the kernel runs under Triton's interpreter (TRITON_INTERPRET=1) in a subprocess, on fp32 data
(the 3.6 interpreter mishandles bf16 dots and rounds fp8 conversions differently, so the fp8 case
gets a loose bound there; the device tests below hold it to the reference). `-m gpu`: the compiled
kernel on the device, CUDA graphs and programmatic dependent launch included.
"""

import json
import os
import sys
from pathlib import Path

import prestart
import pytest
import torch

from decode_worker.fp8 import quantize_rows, w8a8_reference

triton = pytest.importorskip("triton")
from baton.kernels import gemv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


_INTERP = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import interp_shim
from baton.kernels import gemv
from decode_worker.fp8 import quantize_rows, w8a8_reference
torch.manual_seed(0)
out = []
cases = [(16, 16, 96, 256, 1, 128), (16, 3, 100, 300, 2, 128), (5, 5, 70, 1024, 4, 256), (40, 33, 64, 256, 2, 128),
         (16, 2, 64, 512, 2, 256)]
for M, rows, N, K, split, bk in cases:
    x = torch.randn(M, K)
    w = torch.randn(N, K) * 0.05
    q, s = quantize_rows(w)
    for kind in ("fp32", "fp8"):
        cfg = gemv.pick_config(M, N, K, 132, fp8=kind == "fp8", split=split, block_k=bk)
        run = (lambda xx, r: gemv.linear(xx, w, rows=r, cfg=cfg)) if kind == "fp32" else \
              (lambda xx, r: gemv.linear(xx, q, s, rows=r, cfg=cfg))
        y = run(x, rows)
        ref = x[:rows] @ w.T if kind == "fp32" else w8a8_reference(x[:rows], q, s)
        lone = torch.zeros_like(x); lone[0] = x[0]
        out.append(dict(kind=kind, M=M, rows=rows, split=cfg.split, bk=bk, shape=list(y.shape),
                        err=((y[:rows] - ref).norm() / ref.norm()).item(),
                        dead_zero=bool((y[rows:] == 0).all()), repeat=torch.equal(y, run(x, rows)),
                        row0=torch.equal(run(lone, 1)[0], y[0])))
from baton.kernels import rows as R
glu = []
for M, rows, I, K, split in [(16, 3, 96, 256, 1), (16, 16, 50, 512, 2)]:
    x = torch.randn(M, K)
    gate, up = torch.randn(I, K) * 0.05, torch.randn(I, K) * 0.05
    wi = gemv.interleave_glu(gate, up)
    assert torch.equal(wi[0::2], gate) and torch.equal(wi[1::2], up)
    q, s = quantize_rows(wi)
    for kind, args in (("fp32", (wi,)), ("fp8", (q, s))):
        cfg = gemv.pick_config(M, 2 * I, K, 132, fp8=kind == "fp8", split=split, block_k=128)
        fused = gemv.linear(x, *args, rows=rows, cfg=cfg, glu=True)
        full = gemv.linear(x, *args, rows=rows, cfg=cfg)
        two = R.silu_mul(torch.cat([full[:, 0::2], full[:, 1::2]], 1))
        glu.append(dict(kind=kind, split=cfg.split, shape=list(fused.shape), equal=torch.equal(fused, two),
                        dead_zero=bool((fused[rows:] == 0).all()), live=bool(fused[:rows].abs().sum() > 0)))
# the w8a8 hand-off (baton/engine/fast_rows.py): GEMM partials -> add_rmsnorm(quant) -> GEMM on QuantX is
# bitwise GEMM -> add_rmsnorm -> GEMM, for splits 1, 2, 4, dead rows, K not a multiple of 128, and glu
hand = []
for W, n, H, K, split in [(16, 1, 256, 512, 4), (16, 5, 384, 256, 2), (8, 8, 256, 128, 1), (16, 3, 200, 96, 2)]:
    qo, so = quantize_rows(torch.randn(H, K) * 0.05)                # out projection K -> H
    q, s = quantize_rows(torch.randn(2 * K, H) * 0.05)              # next projection H -> 2K (also glu)
    x, res, wn = torch.randn(W, K), torch.randn(W, H), torch.randn(H) * 0.1
    cfg = gemv.pick_config(W, H, K, 132, fp8=True, split=split, block_k=128)
    y = gemv.linear(x, qo, so, rows=n, cfg=cfg)
    r1, xn = R.add_rmsnorm(y, res, wn, 1e-6)
    P = gemv.linear(x, qo, so, rows=n, cfg=cfg, partial=True)
    r2, xq = R.add_rmsnorm(P, res, wn, 1e-6, rows=n, quant=True)
    a, b = gemv.linear(xn, q, s, rows=n), gemv.linear(xq, q, s, rows=n)
    ga, gb = gemv.linear(xn, q, s, rows=n, glu=True), gemv.linear(xq, q, s, rows=n, glu=True)
    _, x0 = R.add_rmsnorm(res, None, wn, 1e-6)                      # layer 0: no partials, no residual
    _, x0q = R.add_rmsnorm(res, None, wn, 1e-6, quant=True)
    hand.append(dict(split=cfg.split, parts=P.shape[0], res=torch.equal(r1[:n], r2[:n]),
                     out=torch.equal(a[:n], b[:n]), glu=torch.equal(ga[:n], gb[:n]), live=bool(a[:n].abs().sum() > 0),
                     dead_zero=bool((b[n:] == 0).all()),
                     first=torch.equal(gemv.linear(x0, q, s, rows=n)[:n], gemv.linear(x0q, q, s, rows=n)[:n])))
# the same partials hand-off for a float (bf16 on the GPU) weight: the bf16 engine's out_proj / down
for W, n, H, K, split in [(16, 2, 256, 512, 4), (16, 16, 128, 256, 2)]:
    wo, x, res, wn = torch.randn(H, K) * 0.05, torch.randn(W, K), torch.randn(W, H), torch.randn(H) * 0.1
    cfg = gemv.pick_config(W, H, K, 132, fp8=False, split=split, block_k=128)
    r1, y1 = R.add_rmsnorm(gemv.linear(x, wo, rows=n, cfg=cfg), res, wn, 1e-6)
    P = gemv.linear(x, wo, rows=n, cfg=cfg, partial=True)
    r2, y2 = R.add_rmsnorm(P, res, wn, 1e-6, rows=n)
    hand.append(dict(split=cfg.split, parts=P.shape[0], res=torch.equal(r1[:n], r2[:n]), out=torch.equal(y1[:n], y2[:n]),
                     glu=True, live=bool(y1[:n].abs().sum() > 0), dead_zero=True, first=True))
# Config.xm (the x rows on the MMA's M side): the same values through every epilogue (split 1 / 2, glu,
# partial, QuantX); on the GPU the sweep and the GPU tests check the bits (benchmarks/sweep_rows_m.py --xm 1)
import dataclasses
xm = []
for M, rows, N, K, split in [(70, 70, 96, 256, 1), (80, 33, 64, 512, 2)]:
    x = torch.randn(M, K)
    w = torch.randn(N, K) * 0.05
    q, s = quantize_rows(w)
    for kind, args in (("fp32", (w,)), ("fp8", (q, s))):
        cfg = gemv.pick_config(M, N, K, 132, fp8=kind == "fp8", split=split, block_k=128)
        cx = dataclasses.replace(cfg, xm=True, block_m=64, block_n=128)
        same = lambda **kw: torch.equal(gemv.linear(x, *args, rows=rows, cfg=cfg, **kw),
                                        gemv.linear(x, *args, rows=rows, cfg=cx, **kw))
        r = dict(kind=kind, split=cfg.split, plain=same(), glu=same(glu=True))
        if split > 1:
            r["partial"] = torch.equal(gemv.linear(x, *args, rows=rows, cfg=cfg, partial=True)[:, :rows],
                                       gemv.linear(x, *args, rows=rows, cfg=cx, partial=True)[:, :rows])
        if kind == "fp8":
            _, xq = R.add_rmsnorm(x, None, torch.ones(K), 1e-6, quant=True)
            r["quantx"] = torch.equal(gemv.linear(xq, q, s, rows=rows, cfg=cfg), gemv.linear(xq, q, s, rows=rows, cfg=cx))
        xm.append(r)
print("RESULT" + json.dumps(dict(cases=out, glu=glu, hand=hand, xm=xm)))
"""


def _interp_job():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return prestart.Job("interp-gemv", [sys.executable, "-c", _INTERP], cwd=str(ROOT), env=env)


# started in the background at collection (tests/prestart.py)
PRESTART = {"test_kernel_under_triton_interpreter": _interp_job}


def test_kernel_under_triton_interpreter():
    p = prestart.run(_interp_job(), timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.split("RESULT", 1)[1])
    res = got["cases"]
    assert {r["split"] for r in res} >= {1, 2, 4}  # one-pass and last-arrival epilogues
    assert any(r["bk"] == 256 for r in res)  # fp8: 2 quantisation groups per K step
    for r in res:
        assert r["shape"][0] == r["M"], r
        assert r["err"] < (1e-5 if r["kind"] == "fp32" else 0.1), r
        assert r["dead_zero"] and r["repeat"] and r["row0"], r
    # glu epilogue: bitwise GEMM on interleaved rows + rows.silu_mul, in both epilogues, both weight kinds
    assert {(g["kind"], g["split"]) for g in got["glu"]} == {("fp32", 1), ("fp32", 2), ("fp8", 1), ("fp8", 2)}
    for g in got["glu"]:
        assert g["equal"] and g["dead_zero"] and g["live"], g
    # fp8 hand-off: split-K partials summed by the norm, the norm quantising for the next GEMM, bitwise
    assert {h["split"] for h in got["hand"]} == {1, 2, 4}
    for h in got["hand"]:
        assert h["parts"] == h["split"] and all(h[k] for k in ("res", "out", "glu", "live", "dead_zero", "first")), h
    # the plain orientation (Config.xm): every epilogue gives swap-AB's values
    assert {(r["kind"], r["split"]) for r in got["xm"]} == {("fp32", 1), ("fp32", 2), ("fp8", 1), ("fp8", 2)}
    for r in got["xm"]:
        assert all(v for k, v in r.items() if k not in ("kind", "split")), r
        assert "partial" in r or r["split"] == 1


def test_pick_config(monkeypatch):
    from baton.kernels import gemv_config

    monkeypatch.setattr(gemv_config, "XM_TABLE", False)  # TUNED_BATCH alone (the xm table: the next test)
    for N, K in [(1024, 4096), (4096, 4096), (12288, 4096), (4096, 12288), (248320, 4096), (100, 300)]:
        for fp8 in (True, False):
            c = gemv.pick_config(16, N, K, 132, fp8=fp8)
            assert c.k_per_split % c.block_k == 0 and (c.split - 1) * c.k_per_split < K <= c.split * c.k_per_split
            assert all(c == gemv.pick_config(m, N, K, 132, fp8=fp8) for m in (1, 7))  # M <= 16: one config
            assert not fp8 or c.block_k % gemv.FP8_GROUP == 0  # whole quantisation groups per step
            tuned = gemv.TUNED.get((fp8, N, K))
            if tuned:
                assert (c.block_n, c.block_k, c.split, c.num_warps, c.num_stages) == tuned
    assert gemv.pick_config(40, 1024, 4096, 132, fp8=True).block_m == 64  # no batch entry: BATCH_BLOCK_M
    for (fp8, N, K), entries in gemv.TUNED_BATCH.items():  # M > 16: the rows tile and warps, never the K order
        c16 = gemv.pick_config(16, N, K, 132, fp8=fp8)
        for M in (17, 32, 40, 64, 72, 128, 144, 320):
            c = gemv.pick_config(M, N, K, 132, fp8=fp8)
            same = ("block_n", "block_k", "split", "k_per_split", "num_stages")
            assert all(getattr(c, f) == getattr(c16, f) for f in same), (N, K, M, c, c16)
            _, bm, warps = next(e for e in entries if e[0] is None or M <= e[0])
            assert (c.block_m, c.num_warps) == (min(bm, 1 << (M - 1).bit_length()), warps), (N, K, M, c)
            assert c.block_m < 2 * M  # never a tile of more padding than rows
        assert gemv.pick_config(72, N, K, 100, fp8=fp8).block_m == 64  # an untuned GPU: the heuristic
    for (fp8, N, K), t in gemv.TUNED_PARTIAL.items():  # partials out: the consumer's own table
        c = gemv.pick_config(16, N, K, 132, fp8=fp8, partial=True)
        assert (c.block_n, c.block_k, c.split, c.num_warps, c.num_stages) == t


def test_the_plain_orientation_table_changes_no_k_order(monkeypatch):
    from baton.kernels import gemv_config

    monkeypatch.setattr(gemv_config, "XM_TABLE", True)
    for (fp8, N, K), (first, bm, bn, warps) in gemv_config.TUNED_BATCH_XM.items():
        c16 = gemv.pick_config(16, N, K, 132, fp8=fp8)
        for M in (17, 64, 72, 128, 129, 144, 320):
            c = gemv.pick_config(M, N, K, 132, fp8=fp8)
            assert (c.block_k, c.split, c.k_per_split) == (c16.block_k, c16.split, c16.k_per_split), (N, K, M)
            assert c.xm == (M >= first) and (not c.xm or (c.block_m, c.block_n, c.num_warps) == (bm, bn, warps))
        assert not gemv.pick_config(320, N, K, 132, fp8=fp8, split=c16.split).xm  # a sweep's overrides: as asked
    monkeypatch.setattr(gemv_config, "XM_TABLE", False)
    assert not any(gemv.pick_config(320, N, K, 132, fp8=fp8).xm for fp8, N, K in gemv_config.TUNED_BATCH_XM)


def test_rejects_mismatched_weights():
    x = torch.randn(2, 64)
    q, s = quantize_rows(torch.randn(8, 64))
    with pytest.raises(AssertionError):
        gemv.linear(x, q)  # fp8 without a scale
    with pytest.raises(AssertionError):
        gemv.linear(x, torch.randn(8, 32))  # K mismatch


# ---- GPU ---------------------------------------------------------------------------------------------
GPU_SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (248320, 4096), (100, 300), (1000, 1000)]


def _case(N, K, M, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    q, s = quantize_rows(w)
    return x, w, q, s


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", GPU_SHAPES)
@pytest.mark.parametrize("M", [1, 16, 40])
def test_gpu_matches_reference(N, K, M):
    x, w, q, s = _case(N, K, M)
    y = gemv.linear(x, q, s)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert rel_err(y, w8a8_reference(x, q, s)) < 1e-2
    assert rel_err(y, x.float() @ (q.float() * s[:, None]).T) < 5e-2  # + activation quantisation
    yb = gemv.linear(x, w)
    assert rel_err(yb, x.float() @ w.float().T) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", GPU_SHAPES)
def test_gpu_deterministic_and_row_invariant(N, K):
    x, w, q, s = _case(N, K, 16)
    for args in ((q, s), (w,)):
        y = gemv.linear(x, *args)
        for _ in range(3):
            assert torch.equal(gemv.linear(x, *args), y)
        assert torch.equal(gemv.linear(x[:1], *args), y[:1])  # M = 1 uses the M = 16 tiles
        part = gemv.linear(x, *args, rows=5)
        assert torch.equal(part[:5], y[:5]) and (part[5:] == 0).all()  # rows: live prefix only
        x2 = torch.randn_like(x)
        x2[5] = x[5]
        assert torch.equal(gemv.linear(x2, *args)[5], y[5])


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_and_pdl(monkeypatch):
    """Split-K (last-arrival reduce, counters reset) and one-pass tiles, replayed with new inputs; PDL
    launches (BATON_PDL=1, opt-in) give the same bits as plain ones."""
    x, w, q, s = _case(4096, 4096, 16)
    _, _, qh, sh = _case(65536, 4096, 16, seed=1)
    static_x = x.clone()

    def body():
        a = gemv.linear(static_x, q, s, rows=3)
        b = gemv.linear(a, w)  # the next kernel reads the previous one's output
        return a, b, gemv.linear(b, qh, sh)

    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        body()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = body()
    for seed in range(3):
        static_x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        g.replay()
        torch.cuda.synchronize()
        eager = body()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager))
        monkeypatch.setenv("BATON_PDL", "1")
        pdl = body()
        monkeypatch.delenv("BATON_PDL")
        assert all(torch.equal(o, p) for o, p in zip(outs, pdl))


@pytest.mark.gpu
@pytest.mark.parametrize("I,K", [(12288, 4096), (1000, 512)])
def test_gpu_glu_epilogue_is_gemm_then_silu_mul_bitwise(I, K):
    """The fp8 MLP's gate|up GEMM with silu(gate)*up in its epilogue == the unfused GEMM on the same
    interleaved weight followed by rows.silu_mul, bit for bit (live rows; dead rows 0), with PDL too."""
    from baton.kernels import rows as R

    x, w, q, s = _case(2 * I, K, 16)
    for args in ((q, s), (w,)):
        for r in (1, 16):
            fused = gemv.linear(x, *args, rows=r, glu=True)
            full = gemv.linear(x, *args, rows=r)
            two = R.silu_mul(torch.cat([full[:, 0::2], full[:, 1::2]], 1))
            assert fused.shape == (16, I) and torch.equal(fused, two)
            assert (fused[r:] == 0).all() and fused[:r].abs().sum() > 0
    plain = gemv.linear(x, q, s, glu=True)
    os.environ["BATON_PDL"] = "1"  # PDL launch + L2 weight prefetch: the same bits
    try:
        pdl = gemv.linear(x, q, s, glu=True)
    finally:
        del os.environ["BATON_PDL"]
    assert torch.equal(pdl, plain)
