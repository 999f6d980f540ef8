"""The GDN layers' depthwise causal conv + SiLU for the fixed-width rows step (baton/engine/fast_rows.py),
under the contract of baton/kernels/rows.py and baton/kernels/gdn.py: row-invariant by construction,
n unspecialised, the checkpoint and ragged-group switches runtime flags (one binary for every call), no
host syncs, CUDA-graph capturable.

    conv_rows(x, conv_state, w, n) depthwise causal conv + SiLU over W rows; state advanced by n

x may be the projection GEMM's split-K partials (rows._ld).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.pdl import launch_kw, pdl_enter
from baton.kernels.rows import _ld, _p2, _slot0


# ---- GDN: causal conv ----------------------------------------------------------------------------
@triton.jit(do_not_specialize=["n", "ckpt", "gs", "lens_on"])
def _conv_rows_kernel(
    x_ptr,
    sx,
    xp,
    st_ptr,
    so_ptr,
    slot_ptr,
    len_ptr,
    w_ptr,
    y_ptr,
    ck_ptr,
    C,
    n,
    gs,
    ckpt,
    lens_on,
    KW: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PARTS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # group g: rows [g*gs, g*gs + n) against the state of slot slots[g]; a slot < 0 is a padding group
    g = tl.program_id(1)
    slot = tl.load(slot_ptr + g)
    if slot < 0:
        return
    if lens_on != 0:  # ragged groups: group g's own row count (a runtime branch: one binary for all calls)
        n = tl.load(len_ptr + g).to(tl.int32)
    st_ptr += slot.to(tl.int64) * (C * (KW - 1))
    so_ptr += slot.to(tl.int64) * (C * (KW - 1))
    x_ptr += (g * gs).to(tl.int64) * sx
    y_ptr += (g * gs).to(tl.int64) * C
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    j = tl.arange(0, KP)
    jm = j < KW
    w = tl.load(w_ptr + c[:, None] * KW + j[None, :], mask=m[:, None] & jm[None, :], other=0.0).to(tl.float32)
    # seq = [state (KW-1 columns), x rows]; out[t] = silu(sum_j seq[t + j] * w[:, j]), rows t < n only
    for t in range(0, n):
        idx = t + j  # [KP] seq indexes
        st = idx < KW - 1
        vs = tl.load(st_ptr + c[:, None] * (KW - 1) + idx[None, :], mask=m[:, None] & (jm & st)[None, :], other=0.0)
        vx = _ld(
            x_ptr,
            (idx - (KW - 1))[None, :] * sx + c[:, None],
            m[:, None] & (jm & (idx >= KW - 1))[None, :],
            xp,
            PARTS,
            y_ptr.dtype.element_ty,
        )
        win = tl.where(st[None, :], vs, vx)  # [BLOCK_C, KP] = seq[t .. t+KW-1]
        acc = tl.sum(win.to(tl.float32) * w, axis=1)
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + t * C + c, y.to(y_ptr.dtype.element_ty), mask=m)
        if ckpt != 0:  # state after row t = seq[t+1 .. t+KW-1]
            tl.store(
                ck_ptr + t * C * (KW - 1) + c[:, None] * (KW - 1) + (j - 1)[None, :],
                win,
                mask=m[:, None] & ((j >= 1) & jm)[None, :],
            )
    # new state[:, j] = seq[n + j], j < KW-1 (all reads above happen before the barrier)
    idx = n + j
    jm1 = j < KW - 1
    from_st = idx < KW - 1
    vs = tl.load(st_ptr + c[:, None] * (KW - 1) + idx[None, :], mask=m[:, None] & (jm1 & from_st)[None, :], other=0.0)
    vx = _ld(
        x_ptr,
        (idx - (KW - 1))[None, :] * sx + c[:, None],
        m[:, None] & (jm1 & (idx >= KW - 1))[None, :],
        xp,
        PARTS,
        y_ptr.dtype.element_ty,
    )
    new = tl.where(from_st[None, :], vs, vx)
    tl.debug_barrier()
    tl.store(so_ptr + c[:, None] * (KW - 1) + j[None, :], new, mask=m[:, None] & jm1[None, :])


def conv_rows(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    w: torch.Tensor,
    n: int,
    ckpt: torch.Tensor | None = None,
    out_state: torch.Tensor | None = None,
    *,
    slots: torch.Tensor | None = None,
    gs: int = 0,
    lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [W, C] (row-strided, unit column stride); conv_state [C, KW-1] contiguous, advanced by the
    first n rows in place, or written advanced into out_state (same layout; conv_state is then only
    read); w [C, KW] contiguous; ckpt [W, C, KW-1] (optional): ckpt[t] := the state after row t, t < n.
    Returns silu(conv) [W, C]; rows >= n are left unwritten (nothing reads them: gdn_rows consumes the
    first n rows only). x may be the split-K partials [S, W, C] fp32 (a column slice of them) of the
    projection GEMM (gemv.linear(partial=True)), taken as their sum rounded to conv_state.dtype.
    Batched (slots [G] int64 on the device): conv_state / out_state are [S, C, KW-1], and group g is
    rows [g*gs, g*gs + n) against slot slots[g] (each group exactly the one-slot call; slots[g] < 0: a
    padding group, nothing read or written); lens [G] int64 (ragged groups): group g's n is lens[g]
    (<= gs; its rows past it unwritten). ckpt is for one group only."""
    parts = x.shape[0] if x.dim() == 3 else 0
    W, C = x.shape[-2:]
    KW = w.shape[1]
    assert x.stride(-1) == 1 and conv_state.is_contiguous() and w.is_contiguous()
    if slots is None:
        conv_state = conv_state[None]
        out_state = None if out_state is None else out_state[None]
        slots, gs = _slot0(x.device), W
    assert ckpt is None or slots.numel() == 1
    y = torch.empty(W, C, dtype=conv_state.dtype if parts else x.dtype, device=x.device)
    B = 128
    assert ckpt is None or ckpt.is_contiguous()
    out_state = conv_state if out_state is None else out_state
    assert out_state.is_contiguous() and out_state.shape == conv_state.shape
    _conv_rows_kernel[(triton.cdiv(C, B), slots.numel())](
        x,
        x.stride(-2),
        x.stride(0) if parts else 0,
        conv_state,
        out_state,
        slots,
        slots if lens is None else lens,
        w,
        y,
        ckpt if ckpt is not None else y,
        C,
        n,
        gs,
        int(ckpt is not None),
        int(lens is not None),
        KW=KW,
        KP=_p2(KW),
        BLOCK_C=B,
        PARTS=parts,
        num_warps=4,
        **launch_kw(x.device),
    )
    return y
