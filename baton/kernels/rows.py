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
    (qk_rope_kv / attention_rows: baton/kernels/attention.py)

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


_SLOT0: dict[str, torch.Tensor] = {}


def _slot0(device: torch.device) -> torch.Tensor:
    """[1] int64 zero on `device`: the one-slot calls are the batched kernels' group 0 on slot 0 (one
    binary for both). Cached; allocated at the first (warm-up) call, never during a capture."""
    key = str(device)
    if key not in _SLOT0:
        _SLOT0[key] = torch.zeros(1, dtype=torch.int64, device=device)
    return _SLOT0[key]


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
    yg = tl.reshape(y.to(DT).to(tl.float32), (G, 128))  # [G, 128]
    amax = tl.maximum(tl.max(tl.abs(yg), axis=1), 1e-30)  # [G]; 0-groups stay 0
    q = tl.reshape((yg * (448.0 / amax)[:, None]).to(tl.float8e4nv), (BLOCK,))
    offs = tl.arange(0, BLOCK)
    tl.store(q_ptr + offs, q, mask=offs < N)
    rg = tl.arange(0, G)
    tl.store(s_ptr + rg, amax * (1.0 / 448.0), mask=rg * 128 < N)


# ---- RMSNorms ------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["rows"])
def _add_rmsnorm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    rout_ptr,
    y_ptr,
    s_ptr,
    N,
    sx,
    sr,
    eps,
    rows,
    s_part,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PARTS: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    lm = m
    if PARTS > 0:  # x = a GEMM's split-K partials [PARTS, W, N] fp32: its epilogue's sum and rounding
        lm = m & (row < rows)  # dead rows: the GEMM's 0
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


def add_rmsnorm(
    x: torch.Tensor,
    res: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    *,
    rows: int | None = None,
    quant: bool = False,
):
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
        assert gemv.FP8_GROUP == 128  # the kernel's group size
        y = torch.empty(W, N, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(W, triton.cdiv(N, 128), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(W, N, dtype=dtype, device=x.device)
        s = y
    _add_rmsnorm_kernel[(W,)](
        x,
        res if res is not None else x,
        w,
        rout,
        y,
        s,
        N,
        x.stride(-2),
        res.stride(0) if res is not None else 0,
        eps,
        W if rows is None else int(rows),
        W * N,
        HAS_RES=res is not None,
        BLOCK=max(_p2(N), 128 if quant else 1),
        PARTS=parts,
        QUANT=quant,
        num_warps=8 if N >= 2048 else 4,
        **launch_kw(x.device),
    )
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


# ---- batched steps: commit each live group's rows into its slot -------------------------------------
@triton.jit(do_not_specialize=["gs"])
def _commit_kernel(
    slot_ptr,
    len_ptr,
    tok_ptr,
    h_ptr,
    nt_ptr,
    pos_ptr,
    hid_ptr,
    gs,
    H,
    TOKEN: tl.constexpr,
    LENS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0)
    slot = tl.load(slot_ptr + g)
    if slot >= 0:
        s = slot.to(tl.int64)
        n = tl.load(len_ptr + g) if LENS else gs  # copies and an add: a second binary changes no bits
        last = g.to(tl.int64) * gs + n - 1  # the group's last row
        if TOKEN:
            tl.store(nt_ptr + s, tl.load(tok_ptr + last))
        tl.store(pos_ptr + s, tl.load(pos_ptr + s) + n)
        for c in range(0, H, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            m = offs < H
            tl.store(hid_ptr + s * H + offs, tl.load(h_ptr + last * H + offs, mask=m), mask=m)


def ar_commit(
    slots: torch.Tensor,
    tok: torch.Tensor,
    h: torch.Tensor,
    next_token: torch.Tensor,
    position: torch.Tensor,
    hidden: torch.Tensor,
) -> None:
    """After a batched AR step of P rows: for every row t with slots[t] >= 0 (padding rows: < 0, skipped),
    next_token[slot] = tok[t], position[slot] += 1, hidden[slot] = h[t]. slots, tok [P] int64; h [P, H]
    contiguous; next_token, position [S] int64; hidden [S, H] (distinct live slots)."""
    P, H = h.shape
    assert h.is_contiguous() and hidden.is_contiguous() and h.dtype == hidden.dtype
    _commit_kernel[(P,)](
        slots, slots, tok, h, next_token, position, hidden, 1, H, TOKEN=True, LENS=False, BLOCK=1024, num_warps=4
    )


def blocks_commit(
    slots: torch.Tensor, gs: int, h: torch.Tensor, position: torch.Tensor, hidden: torch.Tensor, lens: torch.Tensor
) -> None:
    """After a batched pass of G groups of gs rows (group g = rows [g*gs, (g+1)*gs) of slot slots[g], its
    first lens[g] live; slot < 0: padding, skipped): position[slot] += lens[g], hidden[slot] = its last
    live row's h (next_token untouched, as ModelRunner.rows). slots, lens [G] int64; h [G*gs, H]
    contiguous; position [S] int64; hidden [S, H]."""
    G = slots.shape[0]
    H = h.shape[1]
    assert h.shape[0] == G * gs and h.is_contiguous() and hidden.is_contiguous() and h.dtype == hidden.dtype
    _commit_kernel[(G,)](
        slots, lens, position, h, position, position, hidden, gs, H, TOKEN=False, LENS=True, BLOCK=1024, num_warps=4
    )
