"""Fused Triton kernels for the GDN layers of the fixed-width rows step (baton/engine/fast_rows.py),
under the same contract as baton/kernels/rows.py: row-invariant by construction, the live-row count n
unspecialised, no host syncs, CUDA-graph capturable. Whether per-row checkpoints are written is a
runtime flag, not a constexpr, so a checkpointing verify block and a plain AR step run one binary: the
state a block leaves in ckpt[t] is bitwise the state of t+1 plain steps (two compiles of the same
arithmetic need not agree bitwise on the GPU).

    gdn_rows(...)                  L2-normed q/k, gates, gated delta rule over the first n rows (one
                                   program per head and dv slice), then the gated RMSNorm per row
    (the causal conv before it, conv_rows: baton/kernels/gdn_conv.py)

b, a, z of gdn_rows may be the projection GEMM's split-K partials (rows._ld). Batched calls take groups
of gs rows, one slot each (slots [G] on the device), and ragged groups their own row counts (lens [G]),
as a runtime branch, so every call runs one binary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels import gemv
from baton.kernels.pdl import launch_kw, pdl_enter
from baton.kernels.rows import _ld, _p2, _slot0, _store_w8a8


# ---- GDN: gated delta rule, then the gated RMSNorm ---------------------------------------------------
# The delta rule runs one program per (value head, BVS-column slice of dv): every column of S evolves
# on its own (kv, u, the rank-1 update and o are per column), so a head's 64 KB state is spread over
# dv / BVS SMs instead of one. Its raw output o (fp32) goes to a second, per-row kernel for the gated
# RMSNorm over each head's dv columns, which can also quantise for an fp8 out_proj (gemv.QuantX).
@triton.jit(do_not_specialize=["n", "ckpt", "gs", "lens_on"])
def _gdn_rows_kernel(
    cv_ptr,
    scv,
    b_ptr,
    sb,
    a_ptr,
    sa,
    pp,
    alog_ptr,
    dtb_ptr,
    S_ptr,
    So_ptr,
    slot_ptr,
    len_ptr,
    o_ptr,
    ck_ptr,
    n,
    gs,
    ckpt,
    lens_on,
    scale,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    KEY_DIM: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BVS: tl.constexpr,
    PARTS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    h = tl.program_id(0)
    hk = h // GROUP
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BVS + tl.arange(0, BVS)  # this program's dv columns
    mk = rk < DK
    mv = rv < DV
    # group g: rows [g*gs, g*gs + n) against slot slots[g]; a padding group (slot < 0) writes o = 0
    g = tl.program_id(2)
    slot = tl.load(slot_ptr + g)
    r0 = (g * gs).to(tl.int64)
    cv_ptr += r0 * scv
    b_ptr += r0 * sb
    a_ptr += r0 * sa
    o_ptr += r0 * (HV * DV)
    if slot < 0:
        for t in range(0, n):
            tl.store(o_ptr + t * (HV * DV) + h * DV + rv, tl.zeros([BVS], tl.float32), mask=mv)
        return
    if lens_on != 0:  # ragged groups (as conv_rows): rows [lens[g], n) of the group come out 0
        ng = tl.load(len_ptr + g).to(tl.int32)
        for t in range(ng, n):
            tl.store(o_ptr + t * (HV * DV) + h * DV + rv, tl.zeros([BVS], tl.float32), mask=mv)
        n = ng
    S_ptr += slot.to(tl.int64) * (HV * DK * DV)
    So_ptr += slot.to(tl.int64) * (HV * DK * DV)
    s_off = h * DK * DV + rk[:, None] * DV + rv[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(S_ptr + s_off, mask=smask, other=0.0)  # [BK, BVS] fp32
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
        sp = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus (torch threshold)
        beta = tl.sigmoid(b)
        S = S * tl.exp(A * sp)
        kv = tl.sum(S * k[:, None], axis=0)  # [BVS]
        u = (v - kv) * beta
        S = S + k[:, None] * u[None, :]
        if ckpt != 0:
            tl.store(ck_ptr + t * (HV * DK * DV) + s_off, S, mask=smask)
        o = tl.sum(S * q[:, None], axis=0)  # [BVS]
        tl.store(o_ptr + t * (HV * DV) + h * DV + rv, o, mask=mv)
    tl.store(So_ptr + s_off, S, mask=smask)


@triton.jit(do_not_specialize=["n"])
def _gated_norm_kernel(
    o_ptr,
    z_ptr,
    sz,
    zp,
    nw_ptr,
    y_ptr,
    s_ptr,
    n,
    eps,
    HV: tl.constexpr,
    DV: tl.constexpr,
    BH: tl.constexpr,
    BV: tl.constexpr,
    QUANT: tl.constexpr,
    PARTS: tl.constexpr,
    DT: tl.constexpr,
    PDL: tl.constexpr,
):
    # row t: y[h, :] = o[h, :] / rms(o[h, :]) * w * silu(z[h, :]) for every head; rows >= n: 0
    pdl_enter(PDL)
    t = tl.program_id(0)
    rh = tl.arange(0, BH)
    rv = tl.arange(0, BV)
    m = (rh < HV)[:, None] & (rv < DV)[None, :]
    col = rh[:, None] * DV + rv[None, :]  # [BH, BV] column in [HV * DV]
    live = t < n
    o = tl.load(o_ptr + t * (HV * DV) + col, mask=m & live, other=0.0)
    zz = _ld(z_ptr, t * sz + col, m & live, zp, PARTS, DT).to(tl.float32)
    nw = tl.load(nw_ptr + rv, mask=rv < DV, other=0.0).to(tl.float32)
    var = tl.sum(o * o, axis=1) / DV  # [BH]
    y = o * tl.rsqrt(var + eps)[:, None] * nw[None, :] * (zz * tl.sigmoid(zz))
    y = tl.where(live, y, 0.0)
    if QUANT:  # BH == HV and BV == DV here (gdn_rows): the flattened tile is the row's columns
        _store_w8a8(
            tl.reshape(y, (BH * BV,)), y_ptr + t * (HV * DV), s_ptr + t * tl.cdiv(HV * DV, 128), HV * DV, DT, BH * BV
        )
    else:
        tl.store(y_ptr + t * (HV * DV) + col, y.to(y_ptr.dtype.element_ty), mask=m)


def gdn_rows(
    cv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_w: torch.Tensor,
    S: torch.Tensor,
    n: int,
    *,
    nk: int,
    eps: float,
    ckpt: torch.Tensor | None = None,
    S_out: torch.Tensor | None = None,
    quant: bool = False,
    slots: torch.Tensor | None = None,
    gs: int = 0,
    lens: torch.Tensor | None = None,
):
    """cv [W, 2*nk*dk + Hv*dv] conv output (q | k | v); b, a [W, Hv] projections (row-strided);
    z [W, Hv*dv]; S [Hv, dk, dv] fp32, advanced in place by the first n rows (or written advanced into
    S_out, same layout, S only read); ckpt [W, Hv, dk, dv] fp32 (optional): ckpt[t] := S after row t.
    Returns the gated-normed output [W, Hv*dv] in cv.dtype (rows >= n are zero), or with quant=True (and
    Hv, dv powers of two) a gemv.QuantX of it (columns in groups of 128) for an fp8 out_proj.
    b, a, z may be column slices [S, W, .] of the projection GEMM's split-K partials (as conv_rows' x).
    Batched (slots [G] int64 on the device, as conv_rows): S / S_out are [S, Hv, dk, dv], group g is rows
    [g*gs, g*gs + n) against slot slots[g] (n == gs: the groups tile the rows); a padding group's rows come
    out 0. With G > 1 every row is a group's row, so the gated norm runs on all G*gs of them. lens (as
    conv_rows): ragged groups, a group's rows past lens[g] come out 0."""
    parts = z.shape[0] if z.dim() == 3 else 0
    assert (b.dim() == 3) == (a.dim() == 3) == (parts > 0) and (not parts or b.stride(0) == a.stride(0) == z.stride(0))
    W = cv.shape[0]
    norm_rows = n
    if slots is None:
        S = S[None]
        S_out = None if S_out is None else S_out[None]
        slots, gs = _slot0(cv.device), W
    elif slots.numel() > 1:
        assert n == gs and slots.numel() * gs <= W, (n, gs, slots.numel(), W)
        norm_rows = slots.numel() * gs  # every row of every group (padding groups' rows are 0)
    assert ckpt is None or slots.numel() == 1
    Hv, dk, dv = S.shape[1:]
    assert S.is_contiguous() and S.dtype == torch.float32
    assert cv.stride(1) == 1 and b.stride(-1) == 1 and a.stride(-1) == 1 and z.stride(-1) == 1
    assert ckpt is None or (ckpt.is_contiguous() and ckpt.dtype == torch.float32)
    S_out = S if S_out is None else S_out
    assert S_out.is_contiguous() and S_out.shape == S.shape and S_out.dtype == S.dtype
    o = torch.empty(W, Hv * dv, dtype=torch.float32, device=cv.device)  # raw delta-rule output, rows < n
    BV = _p2(dv)
    BVS = min(BV, GDN_SLICE)
    _gdn_rows_kernel[(Hv, triton.cdiv(dv, BVS), slots.numel())](
        cv,
        cv.stride(0),
        b,
        b.stride(-2),
        a,
        a.stride(-2),
        b.stride(0) if parts else 0,
        A_log,
        dt_bias,
        S,
        S_out,
        slots,
        slots if lens is None else lens,
        o,
        ckpt if ckpt is not None else S,
        n,
        gs,
        int(ckpt is not None),
        int(lens is not None),
        dk**-0.5,
        HV=Hv,
        GROUP=Hv // nk,
        KEY_DIM=nk * dk,
        DK=dk,
        DV=dv,
        BK=_p2(dk),
        BVS=BVS,
        PARTS=parts,
        num_warps=4,
        **launch_kw(cv.device),
    )
    BH = _p2(Hv)
    quant = quant and BH == Hv and BV == dv and Hv * dv % 128 == 0  # else bf16 y (the GEMM quantises it)
    if quant:
        assert gemv.FP8_GROUP == 128
        y = torch.empty(W, Hv * dv, dtype=torch.float8_e4m3fn, device=cv.device)
        sc = torch.empty(W, triton.cdiv(Hv * dv, 128), dtype=torch.float32, device=cv.device)
    else:
        y = torch.empty(W, Hv * dv, dtype=cv.dtype, device=cv.device)
        sc = y
    _gated_norm_kernel[(W,)](
        o,
        z,
        z.stride(-2),
        z.stride(0) if parts else 0,
        norm_w,
        y,
        sc,
        norm_rows,
        eps,
        HV=Hv,
        DV=dv,
        BH=BH,
        BV=BV,
        QUANT=quant,
        PARTS=parts,
        DT=_TL[cv.dtype],
        num_warps=8 if Hv * dv >= 2048 else 4,
        **launch_kw(cv.device),
    )
    return gemv.QuantX(y, sc, cv.dtype) if quant else y


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
GDN_SLICE = 32  # dv columns per delta-rule program (dv = 128: 4 programs per value head)
