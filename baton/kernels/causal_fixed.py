"""A prompt piece's causal attention whose rows do not depend on where the piece starts: the cut-invariant
prefill attention (BATON_PREFILL_ATTN=fixed; baton/models/prefill_attention.py attend_segment).

    o = causal_fixed(q [T, nh, d], keys [nkv, S, d], vals [nkv, S, d], start)   # S = start + T -> [T, nh*d]

Why. A prompt's state must be a function of its tokens alone, whatever it was cut into (the prefix cache
restores states at piece boundaries; a prefill worker's --prefill-piece N is taken only where cut_check
finds that cutting at N changes no bit). On an H100 at the 9B shape it did change: cuDNN's SDPA (a first
piece) and flash's (a later piece) reduce a row in orders that follow the call, and every state from the
first attention layer's output on differed (benchmarks/results/gpu-h100-2026-12-07-stop59.md).

Bits. Program (qb, h) holds the rows at positions [P, P + BQ), P = start + qb * BQ, of query head h. A row's
scores against key block j (keys [j * BK, (j + 1) * BK)) are its own [1, d] x [d, BK] products (a row of an
MMA tile does not see the tile's other rows), and its online softmax (max, sum, acc) takes the blocks
j = 0, 1, ... up to the block holding the program's last position, in that order; keys past the row's own
position are -inf (a block wholly past it leaves max, sum and acc as they were: alpha = 1, p = 0). With
start % BQ == 0 a row's program holds the same positions, so runs the same blocks in the same order, in any
call: a prompt cut at multiples of BQ gives every row the bits of the whole prompt's call. No split over
the keys (its count would follow the call), so a call of few query blocks runs few programs.
Checked under Triton's interpreter, whole against cut (tests/prefill_attn_interp.py); on the GPU by
`gpu_pending.sh cut-probe` with BATON_PREFILL_ATTN=fixed (owed), which also says what it costs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BQ = 64  # query rows a program (prompts cut at its multiples keep their bits)
BK = 64  # keys a block of the loop


@triton.jit
def _causal_fixed_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, T, S, start, scale,
    G: tl.constexpr, NH: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    qb = tl.program_id(0)
    h = tl.program_id(1)
    kv = h // G
    rows = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)  # within the piece
    pos = start + rows  # their positions in the prompt
    live = rows < T
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * (NH * D) + h * D + dd[None, :], mask=live[:, None], other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, D], tl.float32)
    last = tl.minimum(start + (qb + 1) * BLOCK_Q, S)  # the program's rows see keys [0, last)
    base = kv.to(tl.int64) * S * D
    for j in range(0, tl.cdiv(last, BLOCK_K)):
        ks = j * BLOCK_K + tl.arange(0, BLOCK_K)
        kin = ks < S
        k = tl.load(k_ptr + base + ks[:, None] * D + dd[None, :], mask=kin[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_Q, BLOCK_K] fp32
        s = tl.where((ks[None, :] <= pos[:, None]) & kin[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base + ks[:, None] * D + dd[None, :], mask=kin[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / den[:, None]
    tl.store(o_ptr + rows[:, None] * (NH * D) + h * D + dd[None, :], out.to(o_ptr.dtype.element_ty), mask=live[:, None])


def causal_fixed(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int) -> torch.Tensor:
    """q [T, nh, d] at positions [start, start + T), keys, vals [nkv, start + T, d] of its slot -> o [T, nh*d]
    in q's dtype (module doc). Query head h reads kv head h // (nh / nkv)."""
    T, nh, d = q.shape
    nkv, S = keys.shape[0], keys.shape[1]
    if S != start + T or vals.shape != keys.shape or nh % nkv:
        raise ValueError(f"causal_fixed: q {tuple(q.shape)}, keys {tuple(keys.shape)}, start {start}")
    q, keys, vals = q.contiguous(), keys.contiguous(), vals.contiguous()
    o = torch.empty((T, nh * d), dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(T, BQ), nh)
    _causal_fixed_kernel[grid](
        q, keys, vals, o, T, S, start, d**-0.5,
        G=nh // nkv, NH=nh, D=d, BLOCK_Q=BQ, BLOCK_K=BK, num_warps=8, num_stages=1,
    )  # fmt: skip
    return o
