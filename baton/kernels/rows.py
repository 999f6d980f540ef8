"""Fused Triton kernels for the fixed-width rows step (baton/engine/fast_rows.py).

Every kernel here is row-invariant by construction: output row t is computed by the same
instructions from row t's inputs (and, for the recurrences, from the rows before it), whatever
the number n of valid rows is. The row count is do_not_specialize everywhere: Triton otherwise
compiles an int argument equal to 1 as a constant, so an AR step (n = 1) would run a different
binary (its loop unrolled, other layouts and reduction orders) than a verify block (n = K+1).
That is what keeps AR steps, verify blocks and re-advances bitwise equal when they run through
these kernels (docs/CONTRACTS.md, "exactness contract").

    add_rmsnorm(x, res, w)         res' = x + res (rounded to x.dtype); y = res' / rms * (1 + w)
    silu_mul(gu [W, 2I])           silu(gu[:, :I]) * gu[:, I:]
    (GDN conv_rows / gdn_rows: baton/kernels/gdn.py, built on _ld / _store_w8a8 here)
    qk_rope_kv(...)                q/k RMSNorm + partial RoPE; k and v rows < n written into the window
    attention_rows(...)            split-window attention up to each row's position, output gate applied

No host syncs and no allocation beyond the outputs, so all of them are CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels import gemv
from baton.kernels.pdl import launch_kw, pdl_enter


def _p2(n: int) -> int:
    return triton.next_power_of_2(int(n))


@triton.jit
def _ld(ptr, off, mask, s_part, PARTS: tl.constexpr, DT: tl.constexpr):
    """x[off] of an activation, or (PARTS > 0) of the split-K partials [PARTS, ...] fp32 of the GEMM that
    makes it (gemv.linear(partial=True)): summed in the order s = 0, 1, ... from 0.0 and rounded to DT,
    bitwise that GEMM's own epilogue. Masked-off elements are 0."""
    if PARTS == 0:
        v = tl.load(ptr + off, mask=mask, other=0.0)
    else:
        tot = 0.0
        for s in tl.static_range(PARTS):
            tot += tl.load(ptr + s * s_part + off, mask=mask, other=0.0)
        v = tot.to(DT)
    return v


@triton.jit
def _store_w8a8(y, q_ptr, s_ptr, N, DT: tl.constexpr, BLOCK: tl.constexpr):
    """One row y [BLOCK] fp32 (columns >= N are 0), rounded to DT, quantised as gemv's K loop would do it
    (gemv.QuantX): q_ptr[:N] e4m3, s_ptr[:cdiv(N, 128)] = amax / 448 of each 128-column group."""
    G: tl.constexpr = BLOCK // 128
    yg = tl.reshape(y.to(DT).to(tl.float32), (G, 128))                           # [G, 128]
    amax = tl.maximum(tl.max(tl.abs(yg), axis=1), 1e-30)                         # [G]; 0-groups stay 0
    q = tl.reshape((yg * (448.0 / amax)[:, None]).to(tl.float8e4nv), (BLOCK,))
    offs = tl.arange(0, BLOCK)
    tl.store(q_ptr + offs, q, mask=offs < N)
    rg = tl.arange(0, G)
    tl.store(s_ptr + rg, amax * (1.0 / 448.0), mask=rg * 128 < N)


# ---- RMSNorms ------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["rows"])
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, rout_ptr, y_ptr, s_ptr, N, sx, sr, eps, rows, s_part,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr, QUANT: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    lm = m
    if PARTS > 0:       # x = a GEMM's split-K partials [PARTS, W, N] fp32: its epilogue's sum and rounding
        lm = m & (row < rows)                                       # dead rows: the GEMM's 0
    x = _ld(x_ptr, row * sx + offs, lm, s_part, PARTS, r_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(r_ptr + row * sr + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(rout_ptr + row * N + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = xf * tl.rsqrt(var + eps) * (1.0 + w)
    if QUANT:
        _store_w8a8(y, y_ptr + row * N, s_ptr + row * tl.cdiv(N, 128), N, r_ptr.dtype.element_ty, BLOCK)
    else:
        tl.store(y_ptr + row * N + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def add_rmsnorm(x: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor, eps: float, *,
                rows: int | None = None, quant: bool = False):
    """x, res [W, N] (row-strided) -> (res' [W, N] contiguous, y [W, N]); res None: (x, y).
    x may be the split-K partials [S, W, N] fp32 of gemv.linear(partial=True) (res required): summed and
    rounded to res.dtype as that GEMM's own epilogue would, rows >= `rows` taken as its 0 rows.
    quant: y comes back as a gemv.QuantX (e4m3 + group scales) for an fp8 GEMM, instead of bf16."""
    parts = x.shape[0] if x.dim() == 3 else 0
    W, N = x.shape[-2:]
    dtype = res.dtype if parts else x.dtype
    assert not parts or (res is not None and x.dtype == torch.float32 and x.is_contiguous()), "partials need res"
    rout = torch.empty(W, N, dtype=dtype, device=x.device) if res is not None else x
    if quant:
        assert gemv.FP8_GROUP == 128                                     # the kernel's group size
        y = torch.empty(W, N, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(W, triton.cdiv(N, 128), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(W, N, dtype=dtype, device=x.device)
        s = y
    _add_rmsnorm_kernel[(W,)](x, res if res is not None else x, w, rout, y, s, N, x.stride(-2),
                              res.stride(0) if res is not None else 0, eps, W if rows is None else int(rows),
                              W * N, HAS_RES=res is not None, BLOCK=max(_p2(N), 128 if quant else 1), PARTS=parts, QUANT=quant,
                              num_warps=8 if N >= 2048 else 4, **launch_kw(x.device))
    return rout, (gemv.QuantX(y, s, dtype) if quant else y)


# ---- MLP -----------------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, I, sg, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(gu_ptr + t * sg + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * sg + I + offs, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + t * I + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [W, 2I] (gate | up) -> [W, I]."""
    W, I2 = gu.shape
    I = I2 // 2
    y = torch.empty(W, I, dtype=gu.dtype, device=gu.device)
    B = min(2048, _p2(I))
    _silu_mul_kernel[(W, triton.cdiv(I, B))](gu, y, I, gu.stride(0), BLOCK=B, num_warps=4, **launch_kw(gu.device))
    return y


# ---- attention over the KV window ------------------------------------------------------------------
# Row t (position pos[t]) attends keys 0..pos[t]. The keys are cut into fixed SPLIT-key pieces; stage 1
# computes an unnormalised partial (acc, max, sum) per (row, kv head, piece) with an online softmax,
# stage 2 merges the pieces 0, 1, ... in order and applies the sigmoid output gate. The pieces depend
# only on pos[t], never on n or on the other rows: row-invariant and deterministic.
ATTN_SPLIT = 256


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, ml_ptr, L, NS, scale,
                       NH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       SPLIT: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    p = tl.load(pos_ptr + t)
    start = s * SPLIT
    if start <= p:
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        gm = rg < G
        q = tl.load(q_ptr + (t * NH + hk * G + rg)[:, None] * D + rd[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for b in tl.static_range(SPLIT // BN):
            kk = start + b * BN + tl.arange(0, BN)
            km = kk <= p
            kt = tl.load(k_ptr + hk * L * D + kk[:, None] * D + rd[None, :], mask=km[:, None], other=0.0)
            vt = tl.load(v_ptr + hk * L * D + kk[:, None] * D + rd[None, :], mask=km[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(kt)) * scale                          # [GP, BN] fp32
            sc = tl.where(km[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt)
            m_i = m_new
        base = (t * NH + hk * G + rg) * NS + s                            # [GP] rows of (t, head, piece)
        tl.store(acc_ptr + base[:, None] * D + rd[None, :], acc, mask=gm[:, None])
        tl.store(ml_ptr + base * 2, m_i, mask=gm)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=gm)


@triton.jit(do_not_specialize=["n"])
def _attn_merge_kernel(acc_ptr, ml_ptr, pos_ptr, gate_ptr, sgt, sgh, o_ptr, n, NS,
                       NH: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    rd = tl.arange(0, D)
    if t < n:
        npieces = tl.load(pos_ptr + t) // SPLIT + 1
        base = (t * NH + h) * NS
        m = tl.load(ml_ptr + base * 2)
        for s in range(1, npieces):
            m = tl.maximum(m, tl.load(ml_ptr + (base + s) * 2))
        num = tl.zeros([D], tl.float32)
        den = tl.zeros([D], tl.float32)                                 # the sum, broadcast over d
        for s in range(0, npieces):
            w = tl.exp(tl.load(ml_ptr + (base + s) * 2) - m)
            num += w * tl.load(acc_ptr + (base + s) * D + rd)
            den += w * tl.load(ml_ptr + (base + s) * 2 + 1)
        gt = tl.load(gate_ptr + t * sgt + h * sgh + rd).to(tl.float32)
        y = num / den * tl.sigmoid(gt)
    else:
        y = tl.zeros([D], tl.float32)
    tl.store(o_ptr + (t * NH + h) * D + rd, y.to(o_ptr.dtype.element_ty))


def attention_rows(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, gate: torch.Tensor,
                   n: int) -> torch.Tensor:
    """q [W, nh, d] contiguous (normed, rotated); kc, vc [nkv, L, d] (this slot's window, already holding
    the rows being computed); pos [W] int64; gate [W, nh, d] (unit last stride). Returns
    softmax(q k^T / sqrt(d)) v * sigmoid(gate) as [W, nh*d]; rows >= n are zero."""
    W, nh, d = q.shape
    nkv, L, _ = kc.shape
    assert q.is_contiguous() and kc.is_contiguous() and vc.is_contiguous() and gate.stride(2) == 1
    assert d == _p2(d) and d >= 16, "head_dim must be a power of two >= 16"
    g = nh // nkv
    ns = triton.cdiv(L, ATTN_SPLIT)
    acc = torch.empty(n, nh, ns, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(n, nh, ns, 2, dtype=torch.float32, device=q.device)
    _attn_split_kernel[(n, nkv, ns)](q, kc, vc, pos, acc, ml, L, ns, d ** -0.5,
                                     NH=nh, G=g, GP=max(16, _p2(g)), D=d, SPLIT=ATTN_SPLIT, BN=64,
                                     num_warps=4, **launch_kw(q.device))
    o = torch.empty(W, nh * d, dtype=q.dtype, device=q.device)
    _attn_merge_kernel[(W, nh)](acc, ml, pos, gate, gate.stride(0), gate.stride(1), o, n, ns,
                                NH=nh, D=d, SPLIT=ATTN_SPLIT, num_warps=1, **launch_kw(acc.device))
    return o


# ---- attention input: q/k RMSNorm + partial RoPE + KV write ---------------------------------------
@triton.jit
def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, eps, D: tl.constexpr, RD: tl.constexpr):
    """Zero-centred RMSNorm over D features, then the half-split rotation of the first RD (fp32)."""
    rd = tl.arange(0, D)
    half = RD // 2
    partner = tl.where(rd < half, rd + half, rd - half)
    x = tl.load(x_ptr + rd).to(tl.float32)
    xp = tl.load(x_ptr + partner, mask=rd < RD, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    xn = x * r * (1.0 + tl.load(w_ptr + rd).to(tl.float32))
    xpn = xp * r * (1.0 + tl.load(w_ptr + partner, mask=rd < RD, other=0.0).to(tl.float32))
    rot = tl.where(rd < half, -xpn, xpn)
    c = tl.load(cos_ptr + rd, mask=rd < RD, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + rd, mask=rd < RD, other=0.0).to(tl.float32)
    return tl.where(rd < RD, xn * c + rot * s, xn)


@triton.jit(do_not_specialize=["n"])
def _qk_rope_kv_kernel(q_ptr, sqt, sqh, k_ptr, skt, skh, v_ptr, svt, svh, wq_ptr, wk_ptr, cos_ptr, sin_ptr,
                       pos_ptr, qo_ptr, kc_ptr, vc_ptr, L, n, eps, rope_off,
                       NH: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    j = tl.program_id(1)
    p = tl.load(pos_ptr + t)
    pr = p + rope_off                                                 # RoPE position (MTP layer: p + 1)
    rd = tl.arange(0, D)
    if j < NH:
        y = _norm_rope(q_ptr + t * sqt + j * sqh, wq_ptr, cos_ptr + pr * RD, sin_ptr + pr * RD, eps, D, RD)
        tl.store(qo_ptr + (t * NH + j) * D + rd, y.to(qo_ptr.dtype.element_ty))
    elif t < n:
        hk = j - NH
        y = _norm_rope(k_ptr + t * skt + hk * skh, wk_ptr, cos_ptr + pr * RD, sin_ptr + pr * RD, eps, D, RD)
        tl.store(kc_ptr + (hk * L + p) * D + rd, y.to(kc_ptr.dtype.element_ty))
        tl.store(vc_ptr + (hk * L + p) * D + rd, tl.load(v_ptr + t * svt + hk * svh + rd))


def qk_rope_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               n: int, eps: float, rope_offset: int = 0) -> torch.Tensor:
    """q [W, nh, d], k, v [W, nkv, d] (unit last stride); cos/sin [positions, rd] tables (RoPE position
    = pos[t] + rope_offset; KV index = pos[t]); kc, vc
    [nkv, L, d] this slot's window. Writes normed+rotated k and v of rows < n at pos[t]; returns the
    normed+rotated q [W, nh, d] contiguous."""
    W, nh, d = q.shape
    nkv, L = kc.shape[0], kc.shape[1]
    rd = cos.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.is_contiguous()
    assert kc.is_contiguous() and vc.is_contiguous() and d == _p2(d) and rd % 2 == 0
    qo = torch.empty(W, nh, d, dtype=q.dtype, device=q.device)
    _qk_rope_kv_kernel[(W, nh + nkv)](q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0),
                                      v.stride(1), wq, wk, cos, sin, pos, qo, kc, vc, L, n, eps, rope_offset,
                                      NH=nh, D=d, RD=rd, num_warps=2, **launch_kw(q.device))
    return qo
