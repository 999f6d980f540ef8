"""baton/kernels/rows.py gdn_rows: the delta rule spread over dv slices (several programs per value head)
and the per-row gated norm, under Triton's interpreter on CPU (fp32): against a torch reference of the
recurrence, checkpoints, dead rows, the ping-pong output state, and the quantised output for an fp8
out_proj (bitwise the GEMM's own quantisation of the bf16 output)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

_INTERP = r"""
import json, sys, torch
import torch.nn.functional as F
sys.path.insert(0, "tests")
import interp_shim
from baton.kernels import gemv, rows as R
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
y = R.gdn_rows(cv, b, a, z, A_log, dtb, nw, S, n, nk=nk, eps=eps, ckpt=ck)
S_in, S_out = S0.clone(), torch.zeros_like(S0)
y2 = R.gdn_rows(cv, b, a, z, A_log, dtb, nw, S_in, n, nk=nk, eps=eps, S_out=S_out)
yq = R.gdn_rows(cv, b, a, z, A_log, dtb, nw, S0.clone(), n, nk=nk, eps=eps, quant=True)
wq, ws = quantize_rows(torch.randn(48, Hv * dv) * 0.05)
out = dict(
    y_err=float((y[:n] - y_ref).abs().max()), S_err=float((S - S_ref).abs().max()),
    dead_zero=bool((y[n:] == 0).all()), ckpt_last=bool(torch.equal(ck[n - 1], S)),
    pingpong=bool(torch.equal(S_out, S) and torch.equal(S_in, S0) and torch.equal(y2, y)),
    quantx=isinstance(yq, gemv.QuantX),
    quant_gemm=bool(torch.equal(gemv.linear(yq, wq, ws, rows=n)[:n], gemv.linear(y, wq, ws, rows=n)[:n])))
print("RESULT" + json.dumps(out))
"""


def test_gdn_rows_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _INTERP], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.split("RESULT", 1)[1])
    assert r["y_err"] < 1e-4 and r["S_err"] < 1e-5, r
    assert r["dead_zero"] and r["ckpt_last"] and r["pingpong"], r
    assert r["quantx"] and r["quant_gemm"], r
