"""Fused Triton kernels for the fixed-width rows step (baton/models/fast_rows.py).

Every kernel here is row-invariant by construction: output row t is computed by the same
instructions from row t's inputs (and, for the recurrences, from the rows before it), whatever
the number n of valid rows is. The row count is do_not_specialize everywhere: Triton otherwise
compiles an int argument equal to 1 as a constant, so an AR step (n = 1) would run a different
binary (its loop unrolled, other layouts and reduction orders) than a verify block (n = K+1).
That is what keeps AR steps, verify blocks and re-advances bitwise equal when they run through
these kernels (docs/CONTRACTS.md, "exactness contract").

    add_rmsnorm(x, res, w)         res' = x + res (rounded to x.dtype); y = res' / rms * (1 + w)
    silu_mul(gu [W, 2I])           silu(gu[:, :I]) * gu[:, I:]
    conv_rows(x, conv_state, w, n) depthwise causal conv + SiLU over W rows; state advanced by n
    gdn_rows(...)                  L2-normed q/k, gates, gated delta rule over the first n rows (one
                                   program per head and dv slice), then the gated RMSNorm per row
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


# ---- GDN: causal conv ----------------------------------------------------------------------------
@triton.jit(do_not_specialize=["n"])
def _conv_rows_kernel(x_ptr, sx, xp, st_ptr, so_ptr, w_ptr, y_ptr, ck_ptr, C, n,
                      K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr, CKPT: tl.constexpr,
                      PARTS: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    j = tl.arange(0, KP)
    jm = j < K
    w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=m[:, None] & jm[None, :], other=0.0).to(tl.float32)
    # seq = [state (K-1 columns), x rows]; out[t] = silu(sum_j seq[t + j] * w[:, j]), rows t < n only
    for t in range(0, n):
        idx = t + j                                                       # [KP] seq indexes
        st = idx < K - 1
        vs = tl.load(st_ptr + c[:, None] * (K - 1) + idx[None, :], mask=m[:, None] & (jm & st)[None, :], other=0.0)
        vx = _ld(x_ptr, (idx - (K - 1))[None, :] * sx + c[:, None], m[:, None] & (jm & (idx >= K - 1))[None, :],
                 xp, PARTS, y_ptr.dtype.element_ty)
        win = tl.where(st[None, :], vs, vx)                              # [BLOCK_C, KP] = seq[t .. t+K-1]
        acc = tl.sum(win.to(tl.float32) * w, axis=1)
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + t * C + c, y.to(y_ptr.dtype.element_ty), mask=m)
        if CKPT:                                                          # state after row t = seq[t+1 .. t+K-1]
            tl.store(ck_ptr + t * C * (K - 1) + c[:, None] * (K - 1) + (j - 1)[None, :], win,
                     mask=m[:, None] & ((j >= 1) & jm)[None, :])
    # new state[:, j] = seq[n + j], j < K-1 (all reads above happen before the barrier)
    idx = n + j
    jm1 = j < K - 1
    from_st = idx < K - 1
    vs = tl.load(st_ptr + c[:, None] * (K - 1) + idx[None, :],
                 mask=m[:, None] & (jm1 & from_st)[None, :], other=0.0)
    vx = _ld(x_ptr, (idx - (K - 1))[None, :] * sx + c[:, None], m[:, None] & (jm1 & (idx >= K - 1))[None, :],
             xp, PARTS, y_ptr.dtype.element_ty)
    new = tl.where(from_st[None, :], vs, vx)
    tl.debug_barrier()
    tl.store(so_ptr + c[:, None] * (K - 1) + j[None, :], new, mask=m[:, None] & jm1[None, :])


def conv_rows(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor, n: int,
              ckpt: torch.Tensor | None = None, out_state: torch.Tensor | None = None) -> torch.Tensor:
    """x [W, C] (row-strided, unit column stride); conv_state [C, K-1] contiguous, advanced by the
    first n rows in place, or written advanced into out_state (same layout; conv_state is then only
    read); w [C, K] contiguous; ckpt [W, C, K-1] (optional): ckpt[t] := the state after row t, t < n.
    Returns silu(conv) [W, C]; rows >= n are left unwritten (nothing reads them: gdn_rows consumes the
    first n rows only). x may be the split-K partials [S, W, C] fp32 (a column slice of them) of the
    projection GEMM (gemv.linear(partial=True)), taken as their sum rounded to conv_state.dtype."""
    parts = x.shape[0] if x.dim() == 3 else 0
    W, C = x.shape[-2:]
    K = w.shape[1]
    assert x.stride(-1) == 1 and conv_state.is_contiguous() and w.is_contiguous()
    y = torch.empty(W, C, dtype=conv_state.dtype if parts else x.dtype, device=x.device)
    B = 128
    assert ckpt is None or ckpt.is_contiguous()
    out_state = conv_state if out_state is None else out_state
    assert out_state.is_contiguous() and out_state.shape == conv_state.shape
    _conv_rows_kernel[(triton.cdiv(C, B),)](x, x.stride(-2), x.stride(0) if parts else 0, conv_state, out_state,
                                            w, y, ckpt if ckpt is not None else y,
                                            C, n, K=K, KP=_p2(K), BLOCK_C=B, CKPT=ckpt is not None, PARTS=parts,
                                            num_warps=4, **launch_kw(x.device))
    return y


# ---- GDN: gated delta rule, then the gated RMSNorm ---------------------------------------------------
# The delta rule runs one program per (value head, BVS-column slice of dv): every column of S evolves
# on its own (kv, u, the rank-1 update and o are per column), so a head's 64 KB state is spread over
# dv / BVS SMs instead of one. Its raw output o (fp32) goes to a second, per-row kernel for the gated
# RMSNorm over each head's dv columns, which can also quantise for an fp8 out_proj (gemv.QuantX).
@triton.jit(do_not_specialize=["n"])
def _gdn_rows_kernel(cv_ptr, scv, b_ptr, sb, a_ptr, sa, pp, alog_ptr, dtb_ptr, S_ptr, So_ptr, o_ptr,
                     ck_ptr, n, scale,
                     HV: tl.constexpr, GROUP: tl.constexpr, KEY_DIM: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BVS: tl.constexpr, CKPT: tl.constexpr,
                     PARTS: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    h = tl.program_id(0)
    hk = h // GROUP
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BVS + tl.arange(0, BVS)                      # this program's dv columns
    mk = rk < DK
    mv = rv < DV
    s_off = h * DK * DV + rk[:, None] * DV + rv[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(S_ptr + s_off, mask=smask, other=0.0)                 # [BK, BVS] fp32
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(0, n):
        row = cv_ptr + t * scv
        q = tl.load(row + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(row + KEY_DIM + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * KEY_DIM + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        b = _ld(b_ptr, t * sb + h, t < n, pp, PARTS, cv_ptr.dtype.element_ty).to(tl.float32)
        a = _ld(a_ptr, t * sa + h, t < n, pp, PARTS, cv_ptr.dtype.element_ty).to(tl.float32) + dtb
        sp = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))           # softplus (torch threshold)
        beta = tl.sigmoid(b)
        S = S * tl.exp(A * sp)
        kv = tl.sum(S * k[:, None], axis=0)                            # [BVS]
        u = (v - kv) * beta
        S = S + k[:, None] * u[None, :]
        if CKPT:
            tl.store(ck_ptr + t * (HV * DK * DV) + s_off, S, mask=smask)
        o = tl.sum(S * q[:, None], axis=0)                             # [BVS]
        tl.store(o_ptr + t * (HV * DV) + h * DV + rv, o, mask=mv)
    tl.store(So_ptr + s_off, S, mask=smask)


@triton.jit(do_not_specialize=["n"])
def _gated_norm_kernel(o_ptr, z_ptr, sz, zp, nw_ptr, y_ptr, s_ptr, n, eps,
                       HV: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr, BV: tl.constexpr,
                       QUANT: tl.constexpr, PARTS: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr):
    # row t: y[h, :] = o[h, :] / rms(o[h, :]) * w * silu(z[h, :]) for every head; rows >= n: 0
    pdl_enter(PDL)
    t = tl.program_id(0)
    rh = tl.arange(0, BH)
    rv = tl.arange(0, BV)
    m = (rh < HV)[:, None] & (rv < DV)[None, :]
    col = rh[:, None] * DV + rv[None, :]                                # [BH, BV] column in [HV * DV]
    live = t < n
    o = tl.load(o_ptr + t * (HV * DV) + col, mask=m & live, other=0.0)
    zz = _ld(z_ptr, t * sz + col, m & live, zp, PARTS, DT).to(tl.float32)
    nw = tl.load(nw_ptr + rv, mask=rv < DV, other=0.0).to(tl.float32)
    var = tl.sum(o * o, axis=1) / DV                                     # [BH]
    y = o * tl.rsqrt(var + eps)[:, None] * nw[None, :] * (zz * tl.sigmoid(zz))
    y = tl.where(live, y, 0.0)
    if QUANT:           # BH == HV and BV == DV here (gdn_rows): the flattened tile is the row's columns
        _store_w8a8(tl.reshape(y, (BH * BV,)), y_ptr + t * (HV * DV), s_ptr + t * tl.cdiv(HV * DV, 128), HV * DV,
                    DT, BH * BV)
    else:
        tl.store(y_ptr + t * (HV * DV) + col, y.to(y_ptr.dtype.element_ty), mask=m)


def gdn_rows(cv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             norm_w: torch.Tensor, S: torch.Tensor, n: int, *, nk: int, eps: float,
             ckpt: torch.Tensor | None = None, S_out: torch.Tensor | None = None, quant: bool = False):
    """cv [W, 2*nk*dk + Hv*dv] conv output (q | k | v); b, a [W, Hv] projections (row-strided);
    z [W, Hv*dv]; S [Hv, dk, dv] fp32, advanced in place by the first n rows (or written advanced into
    S_out, same layout, S only read); ckpt [W, Hv, dk, dv] fp32 (optional): ckpt[t] := S after row t.
    Returns the gated-normed output [W, Hv*dv] in cv.dtype (rows >= n are zero), or with quant=True (and
    Hv, dv powers of two) a gemv.QuantX of it (columns in groups of 128) for an fp8 out_proj.
    b, a, z may be column slices [S, W, .] of the projection GEMM's split-K partials (as conv_rows' x)."""
    parts = z.shape[0] if z.dim() == 3 else 0
    assert (b.dim() == 3) == (a.dim() == 3) == (parts > 0) and (not parts or b.stride(0) == a.stride(0) == z.stride(0))
    W = cv.shape[0]
    Hv, dk, dv = S.shape
    assert S.is_contiguous() and S.dtype == torch.float32
    assert cv.stride(1) == 1 and b.stride(-1) == 1 and a.stride(-1) == 1 and z.stride(-1) == 1
    assert ckpt is None or (ckpt.is_contiguous() and ckpt.dtype == torch.float32)
    S_out = S if S_out is None else S_out
    assert S_out.is_contiguous() and S_out.shape == S.shape and S_out.dtype == S.dtype
    o = torch.empty(W, Hv * dv, dtype=torch.float32, device=cv.device)  # raw delta-rule output, rows < n
    BV = _p2(dv)
    BVS = min(BV, GDN_SLICE)
    _gdn_rows_kernel[(Hv, triton.cdiv(dv, BVS))](
        cv, cv.stride(0), b, b.stride(-2), a, a.stride(-2), b.stride(0) if parts else 0, A_log, dt_bias, S, S_out, o,
        ckpt if ckpt is not None else S, n, dk ** -0.5,
        HV=Hv, GROUP=Hv // nk, KEY_DIM=nk * dk, DK=dk, DV=dv, BK=_p2(dk), BVS=BVS,
        CKPT=ckpt is not None, PARTS=parts, num_warps=4, **launch_kw(cv.device))
    BH = _p2(Hv)
    quant = quant and BH == Hv and BV == dv and Hv * dv % 128 == 0   # else bf16 y (the GEMM quantises it)
    if quant:
        assert gemv.FP8_GROUP == 128
        y = torch.empty(W, Hv * dv, dtype=torch.float8_e4m3fn, device=cv.device)
        sc = torch.empty(W, triton.cdiv(Hv * dv, 128), dtype=torch.float32, device=cv.device)
    else:
        y = torch.empty(W, Hv * dv, dtype=cv.dtype, device=cv.device)
        sc = y
    _gated_norm_kernel[(W,)](o, z, z.stride(-2), z.stride(0) if parts else 0, norm_w, y, sc, n, eps, HV=Hv, DV=dv,
                             BH=BH, BV=BV, QUANT=quant, PARTS=parts, DT=_TL[cv.dtype],
                             num_warps=8 if Hv * dv >= 2048 else 4, **launch_kw(cv.device))
    return gemv.QuantX(y, sc, cv.dtype) if quant else y


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
GDN_SLICE = 32          # dv columns per delta-rule program (dv = 128: 4 programs per value head)


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
