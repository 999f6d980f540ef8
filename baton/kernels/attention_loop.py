"""Stage 1 of the split-window attention (baton/kernels/attention.py: attention_rows): each row's unnormalised
partials (acc, max, sum), one per ATTN_SPLIT-key piece of its keys, from a fixed number of programs per
(row, kv head), each looping over the row's own pieces. Program j of a (row, head) computes pieces j, j + N,
j + 2N, ... up to the row's position: none past the row's keys.

Why. One program a piece of the whole window launched 513 a (row, head) at a 131,072-token window, and for a
640-token row all but three exited at once: 32 short streams decoded at 0.94x the tokens of a 4,296-token
window, and at 0.98x with 32 programs looping (one H100, 2026-12-07:
benchmarks/results/gpu-h100-2026-12-07-stop57.md).

Bits. A piece's partial is the same computation whichever program runs it (the same loads, the same dot
order over its BN-key blocks, stored in the same place), and stage 2 merges the pieces in order, so the
output does not depend on N: N may follow the call's rows. Checked bitwise under the interpreter against the
contiguous window's kernels for N = 1, 2 and the window's pieces (tests/batch_kernels_interp.py), and on an
H100 at the 9B's shape for N = 1, 7, 32, the window's pieces and the default (test_gpu_attention_loop.py).

N (piece_programs): BATON_ATTN_PIECE_PROGRAMS=N > 0 fixes it, 0 = one program a piece; by default
DEFAULT_PROGRAMS, raised for calls of few rows so the grid keeps MIN_GRID programs (a 150K-token prompt's
one decoding row would otherwise run 4 x 32 programs of ~18 pieces each), and never more than the pieces.

Program partials (BATON_ATTN_PROGRAM_PARTIALS=N, off; baton/kernels/split_scratch.py: program_partials). Each
program merges its own pieces in order (CARRY) and stores one partial, so a (row, head) keeps N partials, not
one a piece of the window: the runner's scratch is sized by N (5.4 GB a runner at 320 rows over 262,144
tokens of the 9B, 170 MB with N = 32). The merge order then depends on N for rows of more than N pieces, so N
is fixed (neither the rows nor BATON_ATTN_PIECE_PROGRAMS move it) and must be the same on every worker of a
deployment; a row of at most N pieces keeps the bits of one program a piece. Batch invariance holds for any
fixed N (under the interpreter: tests/batch_kernels_interp.py "carried"; on the GPU:
test_gpu_attention_loop.py, owed). Off until that test and an A/B of a long row's decode ran: one row then
runs N x kv heads programs (128 at N = 32), each over ~pieces / N pieces in turn.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from baton.kernels.pdl import pdl_enter
from baton.kernels.split_scratch import program_partials

PIECE_PROGRAMS_ENV = "BATON_ATTN_PIECE_PROGRAMS"
DEFAULT_PROGRAMS = 32  # programs a (row, kv head): the 131K-window A/B's figure (module doc)
MIN_GRID = 1024  # programs a call keeps at least, window permitting (~8 an H100 / H200 SM)


def piece_programs(ns: int, rows: int, nkv: int) -> int:
    """Programs per (row, kv head) for a call of `rows` rows and nkv kv heads over a window of ns pieces, in
    [1, ns]. BATON_ATTN_PIECE_PROGRAMS=N > 0: min(N, ns); 0: ns (one program a piece); unset: DEFAULT_PROGRAMS,
    or more while rows x nkv x N < MIN_GRID. Read at each call, so a captured graph keeps what it captured."""
    if carry := program_partials():  # a fixed N: the row's bits depend on it (module doc, "Program partials")
        return min(carry, ns)
    raw = os.environ.get(PIECE_PROGRAMS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{PIECE_PROGRAMS_ENV}: {raw!r} is not a whole number of programs") from None
        return min(n, ns) if n > 0 else ns
    return min(ns, max(DEFAULT_PROGRAMS, -(-MIN_GRID // max(1, rows * nkv))))


@triton.jit
def row_slot(slot_ptr, len_ptr, t, n, gs, lens_on):
    """Row t of a batched call: (its slot, whether it is live). Group g = t // gs holds rows
    [g*gs, g*gs + n) of slot slots[g] (ragged groups, lens_on != 0: n = lens[g], a runtime branch so
    every call runs one binary); slot < 0 is a padding group."""
    g = t // gs
    slot = tl.load(slot_ptr + g)
    if lens_on != 0:
        n = tl.load(len_ptr + g).to(tl.int32)
    return tl.maximum(slot, 0).to(tl.int64), (slot >= 0) & (t - g * gs < n)


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
    TW,
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
    CARRY: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, kv heads, programs): the partials of row t, kv head hk (its G query heads, padded to GP)
    into acc [rows, NH, NS, D] and ml [rows, NH, NS, 2] (max, sum), over this program's pieces s <= pos[t] //
    SPLIT; piece s is page table[slot, s] (the table [S, TW]) of the pools [P, nkv, SPLIT, D]. CARRY = 0: one
    partial a piece, at s (NS = TW); CARRY = 1: the program's pieces merged in order into one partial, at the
    program's index (NS = the programs; a program with no piece stores nothing). Dead rows store nothing
    (the merge zeroes them)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    hk = tl.program_id(1)
    p = tl.load(pos_ptr + t)
    slot, live = row_slot(slot_ptr, len_ptr, t, n, gs, lens_on)
    if live:
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        gm = rg < G
        q = tl.load(q_ptr + (t * NH + hk * G + rg)[:, None] * D + rd[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)  # CARRY: the program's running partial
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        # this row's pieces only; not software-pipelined: prefetching the next piece's K and V tiles took
        # 287 KB of shared memory on an H100 (232 KB there), and a piece's arithmetic is unchanged without it
        for s in tl.range(tl.program_id(2), p // SPLIT + 1, tl.num_programs(2), num_stages=1):
            start = s * SPLIT
            page = tl.load(tab_ptr + slot * TW + s).to(tl.int64)  # piece s = page table[slot, s]
            kb = k_ptr + page * (tl.num_programs(1) * SPLIT * D)  # [P, nkv, SPLIT, D]: this piece's page
            vb = v_ptr + page * (tl.num_programs(1) * SPLIT * D)
            if not CARRY:  # a partial of its own
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
            if not CARRY:
                base = (t * NH + hk * G + rg) * NS + s  # [GP] rows of (t, head, piece)
                tl.store(acc_ptr + base[:, None] * D + rd[None, :], acc, mask=gm[:, None])
                tl.store(ml_ptr + base * 2, m_i, mask=gm)
                tl.store(ml_ptr + base * 2 + 1, l_i, mask=gm)
        if CARRY and tl.program_id(2) <= p // SPLIT:  # the program's pieces as one partial, at its index
            base = (t * NH + hk * G + rg) * NS + tl.program_id(2)
            tl.store(acc_ptr + base[:, None] * D + rd[None, :], acc, mask=gm[:, None])
            tl.store(ml_ptr + base * 2, m_i, mask=gm)
            tl.store(ml_ptr + base * 2 + 1, l_i, mask=gm)
