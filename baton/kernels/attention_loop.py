"""The split-window attention's partials (baton/kernels/attention.py: attention_rows, stage 1) from a fixed
number of programs per (row, kv head), each looping over the row's own pieces, instead of one program per
piece of the whole window. Off unless BATON_ATTN_PIECE_PROGRAMS=N (N > 0) until its GPU test and A/B ran.

Why. attention_rows launches rows x kv heads x (the window's pieces) programs: at a 131,072-token window, 513
a (row, head), and for a 640-token row all but three exit at once. With 32 short streams on an H100 the decode
step took 11.4 ms at 12 rows, against 8.1 ms at 18 rows under a 4,296-token window (two hosts, 2026-12-07:
benchmarks/results/gpu-h100-2026-12-07-stop56.md). Here program j of a (row, head) computes pieces j, j + N,
j + 2N, ... up to the row's position: min(N, the window's pieces) programs, and none past the row's keys.

Bits. Each piece's partial (acc, max, sum) is the same computation as attention.py's kernel's program for
that piece, stored in the same place, and the merge is unchanged, so the output is meant to be bitwise the
same for any N. The interpreter checks it (tests/batch_kernels_interp.py: "looped"); on the GPU,
`BATON_ATTN_PIECE_PROGRAMS=32 pytest -m gpu tests/engine/test_gpu_batch.py` against the plain kernel's
outputs is owed, then `gpu_pending.sh window-ab` with it (WINDOW_ENV). Once it holds, this kernel with
N = the window's pieces replaces attention.py's (one program a piece is its N = ns case).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from baton.kernels.attention import _row_slot
from baton.kernels.pdl import pdl_enter

PIECE_PROGRAMS_ENV = "BATON_ATTN_PIECE_PROGRAMS"


def piece_programs(ns: int) -> int:
    """Programs per (row, kv head) for a window of ns pieces: min(N, ns) with BATON_ATTN_PIECE_PROGRAMS=N > 0,
    else 0 (attention.py's kernel: one program a piece). Read at each call, so a graph keeps what it captured."""
    raw = os.environ.get(PIECE_PROGRAMS_ENV, "").strip() or "0"
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{PIECE_PROGRAMS_ENV}: {raw!r} is not a whole number of programs") from None
    return min(n, ns) if n > 0 else 0


@triton.jit(do_not_specialize=["n", "gs", "lens_on"])
def attn_split_loop_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    slot_ptr,
    len_ptr,
    tab_ptr,
    acc_ptr,
    ml_ptr,
    NS,
    n,
    gs,
    lens_on,
    scale,
    NH: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    BN: tl.constexpr,
    PDL: tl.constexpr,
):
    """attention.py's _attn_split_kernel, its arguments and stores, over grid (rows, kv heads, programs)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    hk = tl.program_id(1)
    p = tl.load(pos_ptr + t)
    slot, live = _row_slot(slot_ptr, len_ptr, t, n, gs, lens_on)
    if live:
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        gm = rg < G
        q = tl.load(q_ptr + (t * NH + hk * G + rg)[:, None] * D + rd[None, :], mask=gm[:, None], other=0.0)
        # this row's pieces only; not software-pipelined: prefetching the next piece's K and V tiles took
        # 287 KB of shared memory on an H100 (232 KB there), and a piece's arithmetic is unchanged without it
        for s in tl.range(tl.program_id(2), p // SPLIT + 1, tl.num_programs(2), num_stages=1):
            start = s * SPLIT
            page = tl.load(tab_ptr + slot * NS + s).to(tl.int64)  # piece s = page table[slot, s]
            kb = k_ptr + page * (tl.num_programs(1) * SPLIT * D)  # [P, nkv, SPLIT, D]: this piece's page
            vb = v_ptr + page * (tl.num_programs(1) * SPLIT * D)
            m_i = tl.full([GP], float("-inf"), tl.float32)
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, D], tl.float32)
            for b in tl.static_range(SPLIT // BN):
                kr = b * BN + tl.arange(0, BN)  # rows of the page
                km = start + kr <= p
                kt = tl.load(kb + hk * SPLIT * D + kr[:, None] * D + rd[None, :], mask=km[:, None], other=0.0)
                vt = tl.load(vb + hk * SPLIT * D + kr[:, None] * D + rd[None, :], mask=km[:, None], other=0.0)
                sc = tl.dot(q, tl.trans(kt)) * scale  # [GP, BN] fp32
                sc = tl.where(km[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                alpha = tl.exp(m_i - m_new)
                pr = tl.exp(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(pr, axis=1)
                acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt)
                m_i = m_new
            base = (t * NH + hk * G + rg) * NS + s  # [GP] rows of (t, head, piece)
            tl.store(acc_ptr + base[:, None] * D + rd[None, :], acc, mask=gm[:, None])
            tl.store(ml_ptr + base * 2, m_i, mask=gm)
            tl.store(ml_ptr + base * 2 + 1, l_i, mask=gm)
