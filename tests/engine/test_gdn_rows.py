"""baton/kernels/gdn.py gdn_rows: the delta rule spread over dv slices (several programs per value head)
and the per-row gated norm, under Triton's interpreter on CPU (fp32): against a torch reference of the
recurrence, checkpoints, dead rows, the ping-pong output state, the quantised output for an fp8
out_proj (bitwise the GEMM's own quantisation of the bf16 output), and inputs taken straight from the
projection GEMM's split-K partials (bitwise its reduced output)."""

import json
import os
import sys
from pathlib import Path

import prestart
import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

_INTERP = r"""
import json, sys, torch
import torch.nn.functional as F
sys.path.insert(0, "tests")
import interp_shim
from baton.kernels import gdn as G, gdn_conv as GC, gemv, rows as R
from decode_worker.fp8 import quantize_rows
torch.manual_seed(0)
W, n, nk, Hv, dk, dv, eps = 6, 4, 2, 4, 32, 64, 1e-6          # dv = 64: 2 programs per value head
cv = torch.randn(W, 2 * nk * dk + Hv * dv)
b, a, z = torch.randn(W, Hv), torch.randn(W, Hv), torch.randn(W, Hv * dv)
A_log, dtb, nw = torch.randn(Hv) * 0.5, torch.randn(Hv) * 0.5, torch.randn(dv) * 0.2 + 1
S0 = torch.randn(Hv, dk, dv) * 0.1

def reference():
    S, ys = S0.clone(), []
    g = Hv // nk
    for t in range(n):
        q = cv[t, :nk * dk].view(nk, dk).repeat_interleave(g, 0)
        k = cv[t, nk * dk:2 * nk * dk].view(nk, dk).repeat_interleave(g, 0)
        v = cv[t, 2 * nk * dk:].view(Hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        decay = torch.exp(-torch.exp(A_log) * F.softplus(a[t] + dtb))
        S = S * decay[:, None, None]
        u = (v - torch.einsum("hkv,hk->hv", S, k)) * torch.sigmoid(b[t])[:, None]
        S = S + k[:, :, None] * u[:, None, :]
        o = torch.einsum("hkv,hk->hv", S, q)
        zz = z[t].view(Hv, dv)
        ys.append((o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * nw * F.silu(zz)).reshape(-1))
    return S, torch.stack(ys)

S_ref, y_ref = reference()
S = S0.clone()
ck = torch.zeros(W, Hv, dk, dv)
y = G.gdn_rows(cv, b, a, z, A_log, dtb, nw, S, n, nk=nk, eps=eps, ckpt=ck)
S_in, S_out = S0.clone(), torch.zeros_like(S0)
y2 = G.gdn_rows(cv, b, a, z, A_log, dtb, nw, S_in, n, nk=nk, eps=eps, S_out=S_out)
yq = G.gdn_rows(cv, b, a, z, A_log, dtb, nw, S0.clone(), n, nk=nk, eps=eps, quant=True)
wq, ws = quantize_rows(torch.randn(48, Hv * dv) * 0.05)
out = dict(
    y_err=float((y[:n] - y_ref).abs().max()), S_err=float((S - S_ref).abs().max()),
    dead_zero=bool((y[n:] == 0).all()), ckpt_last=bool(torch.equal(ck[n - 1], S)),
    pingpong=bool(torch.equal(S_out, S) and torch.equal(S_in, S0) and torch.equal(y2, y)),
    quantx=isinstance(yq, gemv.QuantX),
    quant_gemm=bool(torch.equal(gemv.linear(yq, wq, ws, rows=n)[:n], gemv.linear(y, wq, ws, rows=n)[:n])))
# a projection GEMM's split-K partials (mixed | z | b | a columns) feed conv_rows and gdn_rows directly:
# bitwise what they compute from that GEMM's own output
C, Kin = 2 * nk * dk + Hv * dv, 256
wp, sp = quantize_rows(torch.randn(C + Hv * dv + 2 * Hv, Kin) * 0.05)
xin = torch.randn(W, Kin)
cfg = gemv.pick_config(W, wp.shape[0], Kin, 132, fp8=True, split=2, block_k=128)
sizes = [C, Hv * dv, Hv, Hv]
f = gemv.linear(xin, wp, sp, rows=n, cfg=cfg).split(sizes, -1)
P = gemv.linear(xin, wp, sp, rows=n, cfg=cfg, partial=True)
p = P.split(sizes, -1)
w4, st = torch.randn(C, 4), torch.randn(C, 3)
st1, st2, S1, S2 = st.clone(), st.clone(), S0.clone(), S0.clone()
cv1, cv2 = GC.conv_rows(f[0], st1, w4, n), GC.conv_rows(p[0], st2, w4, n)
y1 = G.gdn_rows(cv1, f[2], f[3], f[1], A_log, dtb, nw, S1, n, nk=nk, eps=eps)
y2 = G.gdn_rows(cv2, p[2], p[3], p[1], A_log, dtb, nw, S2, n, nk=nk, eps=eps)
q1 = G.gdn_rows(cv1, f[2], f[3], f[1], A_log, dtb, nw, S0.clone(), n, nk=nk, eps=eps, quant=True)
q2 = G.gdn_rows(cv2, p[2], p[3], p[1], A_log, dtb, nw, S0.clone(), n, nk=nk, eps=eps, quant=True)
out.update(parts=P.shape[0], partial_conv=bool(torch.equal(cv1[:n], cv2[:n]) and torch.equal(st1, st2)),
           partial_gdn=bool(torch.equal(y1, y2) and torch.equal(S1, S2) and torch.equal(q1.q[:n], q2.q[:n])
                            and torch.equal(q1.s[:n], q2.s[:n])), partial_live=bool(y1[:n].abs().sum() > 0))
print("RESULT" + json.dumps(out))
"""


def _interp_job():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return prestart.Job("interp-gdn-rows", [sys.executable, "-c", _INTERP], cwd=str(ROOT), env=env)


# started in the background at collection (tests/prestart.py)
PRESTART = {"test_gdn_rows_under_triton_interpreter": _interp_job}


def test_gdn_rows_under_triton_interpreter():
    p = prestart.run(_interp_job(), timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.split("RESULT", 1)[1])
    assert r["y_err"] < 1e-4 and r["S_err"] < 1e-5, r
    assert r["dead_zero"] and r["ckpt_last"] and r["pingpong"], r
    assert r["quantx"] and r["quant_gemm"], r
    assert r["parts"] == 2 and r["partial_conv"] and r["partial_gdn"] and r["partial_live"], r


@pytest.mark.gpu
@pytest.mark.parametrize("quant,ckpt", [(False, False), (True, False), (False, True)], ids=["bf16", "quant", "ckpt"])
def test_gpu_gdn_rows_block_equals_single_rows_at_9b_dims(quant, ckpt):
    """Row invariance of the compiled kernels at the Qwen3.5-9B GDN dims (16 key / 32 value heads of
    128, 4 dv slices per head): a 5-row block gives bitwise the outputs and state of 5 one-row calls
    (one binary for every n: rows.py's do_not_specialize). With ckpt, the block (as an mtp verify
    block) writes per-row checkpoints and the single rows (as AR steps) do not: checkpoint t is bitwise
    the state after t+1 single rows (one binary for both: the checkpoint flag is a runtime argument)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from baton.kernels import gdn as G
    from baton.kernels import gdn_conv as GC

    g = torch.Generator(device="cuda").manual_seed(0)
    W, n, nk, Hv, dk, dv = 16, 5, 16, 32, 128, 128
    C = 2 * nk * dk + Hv * dv
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, z = torch.randn(W, C, generator=g, **bf), torch.randn(W, Hv * dv, generator=g, **bf)
    b, a = torch.randn(W, Hv, generator=g, **bf), torch.randn(W, Hv, generator=g, **bf)
    w4, cst = torch.randn(C, 4, generator=g, **bf) * 0.5, torch.randn(C, 3, generator=g, **bf)
    A_log, dtb = torch.randn(Hv, device="cuda") * 0.5, torch.randn(Hv, device="cuda") * 0.5
    nw, S0 = torch.randn(dv, **bf) * 0.2 + 1, torch.randn(Hv, dk, dv, device="cuda", generator=g) * 0.1

    ck_conv = torch.zeros(W, C, 3, **bf) if ckpt else None
    ck_S = torch.zeros(W, Hv, dk, dv, device="cuda") if ckpt else None

    def step(lo, hi, st, S, cc=None, cs=None):
        cv = GC.conv_rows(x[lo:hi].contiguous(), st, w4, hi - lo, ckpt=cc)
        y = G.gdn_rows(
            cv,
            b[lo:hi].contiguous(),
            a[lo:hi].contiguous(),
            z[lo:hi].contiguous(),
            A_log,
            dtb,
            nw,
            S,
            hi - lo,
            nk=nk,
            eps=1e-6,
            quant=quant,
            ckpt=cs,
        )
        return (y.q, y.s) if quant else (y,)

    st_b, S_b = cst.clone(), S0.clone()
    block = step(0, n, st_b, S_b, ck_conv, ck_S)
    st_a, S_a = cst.clone(), S0.clone()
    for t in range(n):
        one = step(t, t + 1, st_a, S_a)
        assert all(
            torch.equal(
                o[0].view(torch.uint8) if o.dtype == torch.float8_e4m3fn else o[0],
                blk[t].view(torch.uint8) if blk.dtype == torch.float8_e4m3fn else blk[t],
            )
            for o, blk in zip(one, block)
        ), t
        if ckpt:
            assert torch.equal(ck_conv[t], st_a) and torch.equal(ck_S[t], S_a), f"checkpoint {t}"
    assert torch.equal(st_a, st_b) and torch.equal(S_a, S_b)
