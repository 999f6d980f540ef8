"""Fused Triton kernels for the attention layers of the fixed-width rows step, under the contract of
baton/kernels/rows.py (row-invariant by construction, n unspecialised, no host syncs, graph capturable).

    qk_rope_kv(...)                q/k RMSNorm + partial RoPE; k and v rows < n written into their pages
    attention_rows(...)            split-window attention up to each row's position, output gate applied:
                                   each row reduces over its own keys in fixed ATTN_SPLIT-key pieces, in a
                                   fixed order, so its bits do not depend on n or on the other rows

KV lives in pages (baton/engine/pages.py): kc, vc are pools [P, nkv, ATTN_SPLIT, d] and a slot's row
pos is in page table[slot, pos // ATTN_SPLIT] at pos % ATTN_SPLIT (table [S, MP] int32). A page is one
attention piece, so piece s of a row reads page table[slot, s]: the same keys, in the same order, as the
contiguous window (tests/batch_kernels_interp.py checks it bitwise against the contiguous kernels).
One-slot calls (slots None) take table [1, MP], or None: the identity table (the pool is the window's
pages in order)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.attention_loop import attn_split_loop_kernel, piece_programs, row_slot
from baton.kernels.gdn import _slot0
from baton.kernels.pdl import launch_kw, pdl_enter
from baton.kernels.rows import _p2
from baton.kernels.split_scratch import program_partials, split_buffers

# ---- attention over the KV window ------------------------------------------------------------------
# Row t (position pos[t]) attends keys 0..pos[t]. The keys are cut into fixed SPLIT-key pieces; stage 1
# (baton/kernels/attention_loop.py: a fixed number of programs a (row, kv head) looping the row's pieces)
# computes an unnormalised partial (acc, max, sum) per (row, kv head, piece) with an online softmax,
# stage 2 merges the pieces 0, 1, ... in order and applies the sigmoid output gate. The pieces depend
# only on pos[t], never on n or on the other rows: row-invariant and deterministic.
ATTN_SPLIT = 256


@triton.jit(do_not_specialize=["n", "gs", "lens_on"])
def _attn_merge_kernel(
    acc_ptr,
    ml_ptr,
    pos_ptr,
    slot_ptr,
    len_ptr,
    gate_ptr,
    sgt,
    sgh,
    o_ptr,
    n,
    gs,
    lens_on,
    NS,
    NH: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    rd = tl.arange(0, D)
    _, live = row_slot(slot_ptr, len_ptr, t, n, gs, lens_on)
    if live:
        npieces = tl.minimum(tl.load(pos_ptr + t) // SPLIT + 1, NS)  # NS: the programs' partials (CARRY)
        base = (t * NH + h) * NS
        m = tl.load(ml_ptr + base * 2)
        for s in range(1, npieces):
            m = tl.maximum(m, tl.load(ml_ptr + (base + s) * 2))
        num = tl.zeros([D], tl.float32)
        den = tl.zeros([D], tl.float32)  # the sum, broadcast over d
        for s in range(0, npieces):
            w = tl.exp(tl.load(ml_ptr + (base + s) * 2) - m)
            num += w * tl.load(acc_ptr + (base + s) * D + rd)
            den += w * tl.load(ml_ptr + (base + s) * 2 + 1)
        gt = tl.load(gate_ptr + t * sgt + h * sgh + rd).to(tl.float32)
        y = num / den * tl.sigmoid(gt)
    else:
        y = tl.zeros([D], tl.float32)
    tl.store(o_ptr + (t * NH + h) * D + rd, y.to(o_ptr.dtype.element_ty))


def identity_table(kc: torch.Tensor) -> torch.Tensor:
    """[1, P] int32: the one-slot table whose pages are the pool's, in order."""
    return torch.arange(kc.shape[0], dtype=torch.int32, device=kc.device)[None]


def _paged(kc, vc, table, slots, W, n):
    """-> (table, slots, gs, rows) of a call; slots None = one slot (table [1, MP], None: identity)."""
    assert kc.dim() == 4 and kc.shape[2] == ATTN_SPLIT, "kc, vc: page pools [P, nkv, ATTN_SPLIT, d]"
    assert kc.is_contiguous() and vc.is_contiguous() and kc.shape == vc.shape
    if slots is None:
        table = identity_table(kc) if table is None else table
        assert table.shape[0] == 1
        return table, _slot0(kc.device), W, n
    assert table is not None, "a batched call needs the page table [S, MP]"
    return table, slots, None, W


def attention_rows(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    pos: torch.Tensor,
    gate: torch.Tensor,
    n: int,
    *,
    table: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    gs: int = 0,
    lens: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [W, nh, d] contiguous (normed, rotated); kc, vc page pools [P, nkv, ATTN_SPLIT, d] (already holding
    the rows being computed) read through table [S, MP] int32 (piece s of a row of slot x: page
    table[x, s]; MP pieces at most); pos [W] int64; gate [W, nh, d] (unit last stride). Returns
    softmax(q k^T / sqrt(d)) v * sigmoid(gate) as [W, nh*d]; rows >= n are zero.
    One slot (slots None): table [1, MP] or None (identity). Batched (slots [G] int64 on the device): row
    t is row t - g*gs of group g = t // gs, live if that is < n, against slot slots[g] (< 0: padding, the
    row comes out 0); lens [G] int64: ragged groups, group g's rows live while < lens[g]. scratch: the runner's
    fp32 buffer for the partials (baton/kernels/split_scratch.py), else the call allocates them."""
    W, nh, d = q.shape
    table, slots, gs1, rows = _paged(kc, vc, table, slots, W, n)
    gs = gs1 or gs
    nkv = kc.shape[1]
    assert q.is_contiguous() and gate.stride(2) == 1 and table.dtype == torch.int32 and table.is_contiguous()
    assert d == _p2(d) and d >= 16, "head_dim must be a power of two >= 16"
    g = nh // nkv
    ns = table.shape[1]
    programs = piece_programs(ns, rows, nkv)  # each loops over its share of the row's pieces
    carry = bool(program_partials())  # one partial a program (N of them), not one a piece of the window
    parts = programs if carry else ns
    acc, ml = split_buffers(rows, nh, parts, d, q.device, scratch)
    attn_split_loop_kernel[(rows, nkv, programs)](
        q,
        kc,
        vc,
        pos,
        slots,
        slots if lens is None else lens,
        table,
        acc,
        ml,
        ns,
        parts,
        n,
        gs,
        int(lens is not None),
        d**-0.5,
        NH=nh,
        G=g,
        GP=max(16, _p2(g)),
        D=d,
        SPLIT=ATTN_SPLIT,
        BN=64,
        CARRY=carry,
        num_warps=4,
        **launch_kw(q.device),
    )
    o = torch.empty(W, nh * d, dtype=q.dtype, device=q.device)
    _attn_merge_kernel[(W, nh)](
        acc,
        ml,
        pos,
        slots,
        slots if lens is None else lens,
        gate,
        gate.stride(0),
        gate.stride(1),
        o,
        n,
        gs,
        int(lens is not None),
        parts,
        NH=nh,
        D=d,
        SPLIT=ATTN_SPLIT,
        num_warps=1,
        **launch_kw(acc.device),
    )
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


@triton.jit(do_not_specialize=["n", "gs", "lens_on"])
def _qk_rope_kv_kernel(
    q_ptr,
    sqt,
    sqh,
    k_ptr,
    skt,
    skh,
    v_ptr,
    svt,
    svh,
    wq_ptr,
    wk_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    len_ptr,
    tab_ptr,
    qo_ptr,
    kc_ptr,
    vc_ptr,
    MP,
    n,
    gs,
    lens_on,
    eps,
    rope_off,
    NH: tl.constexpr,
    D: tl.constexpr,
    RD: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    j = tl.program_id(1)
    p = tl.load(pos_ptr + t)
    pr = p + rope_off  # RoPE position (MTP layer: p + 1)
    rd = tl.arange(0, D)
    if j < NH:
        y = _norm_rope(q_ptr + t * sqt + j * sqh, wq_ptr, cos_ptr + pr * RD, sin_ptr + pr * RD, eps, D, RD)
        tl.store(qo_ptr + (t * NH + j) * D + rd, y.to(qo_ptr.dtype.element_ty))
    else:
        slot, live = row_slot(slot_ptr, len_ptr, t, n, gs, lens_on)
        if live:
            hk = j - NH
            page = tl.load(tab_ptr + slot * MP + p // SPLIT).to(tl.int64)  # [P, nkv, SPLIT, D] pools
            kv = (page * (tl.num_programs(1) - NH) + hk) * SPLIT + p % SPLIT  # row of (page, hk, p % SPLIT)
            y = _norm_rope(k_ptr + t * skt + hk * skh, wk_ptr, cos_ptr + pr * RD, sin_ptr + pr * RD, eps, D, RD)
            tl.store(kc_ptr + kv * D + rd, y.to(kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + kv * D + rd, tl.load(v_ptr + t * svt + hk * svh + rd))


def qk_rope_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    n: int,
    eps: float,
    rope_offset: int = 0,
    *,
    table: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    gs: int = 0,
    lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [W, nh, d], k, v [W, nkv, d] (unit last stride); cos/sin [positions, rd] tables (RoPE position
    = pos[t] + rope_offset; KV index = pos[t]); kc, vc page pools [P, nkv, ATTN_SPLIT, d] and table
    [S, MP] int32 as attention_rows. Writes normed+rotated k and v of rows < n at KV index pos[t] (page
    table[slot, pos // ATTN_SPLIT], row pos % ATTN_SPLIT); returns the normed+rotated q [W, nh, d] contiguous.
    Batched (slots [G] int64 on the device): the rows of group g = t // gs (live while t - g*gs < n) write
    into slot slots[g]'s pages (< 0: padding, nothing written), as attention_rows (lens too)."""
    W, nh, d = q.shape
    table, slots, gs1, _ = _paged(kc, vc, table, slots, W, n)
    gs = gs1 or gs
    nkv = kc.shape[1]
    rd = cos.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.is_contiguous()
    assert table.dtype == torch.int32 and table.is_contiguous() and d == _p2(d) and rd % 2 == 0
    qo = torch.empty(W, nh, d, dtype=q.dtype, device=q.device)
    _qk_rope_kv_kernel[(W, nh + nkv)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        k.stride(0),
        k.stride(1),
        v,
        v.stride(0),
        v.stride(1),
        wq,
        wk,
        cos,
        sin,
        pos,
        slots,
        slots if lens is None else lens,
        table,
        qo,
        kc,
        vc,
        table.shape[1],
        n,
        gs,
        int(lens is not None),
        eps,
        rope_offset,
        NH=nh,
        D=d,
        RD=rd,
        SPLIT=ATTN_SPLIT,
        num_warps=2,
        **launch_kw(q.device),
    )
    return qo
