"""The sampled token pick on CUDA, sort-free: one Triton program per row (issue 22's speed bound).

    tok = pick(src, slots, positions, table)     # src [M, V] logits (any float dtype) or penalized x fp32

For each row r (slot s = slots[r], T = temperature[s] > 0) it returns
    argmax over K of  z + g,        z = src[r] / T (IEEE division, float32: torch's `x / T`, bitwise)
with g the Gumbel noise of (seed, position, vocab index) (baton/engine/noise.py's hash, the same bits
of u; the logs are the device's) and K the kept set, defined without any order of the vocabulary:
    top-k:  i is kept iff fewer than k tokens have z > z_i            (the whole tie group at the edge)
    top-p:  i is kept iff the top-k-renormalised mass of the tokens with z > z_i is below top_p
    min-p:  i is kept iff z_i - max(z) >= log(min_p)
(baton/engine/sampling.py's docstring; sampling_reference.py is the same in float64). Rows with T <= 0
get 0 here: the caller takes their greedy token (argmax) instead.

How, without sorting 248K entries: the Gumbel-max candidate c = argmax over the top-k set of z + g is the
token iff c is in K. If it is not, no token with z <= z_c is in K either (every test above is monotone in
z), so K lies in {z > z_c}: take the argmax of z + g over that set and test again. Each test is one pass
over the row (the mass above z_c and the next candidate together); a candidate is accepted with
probability at least top_p, so a row takes ~2 passes, and always ends (the row's maximum is in K). top-k
first finds the k-th largest z by a radix select on its order-preserving 32-bit key (8 passes of 4 bits).

Invariants
- Row invariance by construction: program r reads only row r and its slot's parameters, and reduces
  over the row in one fixed order (blocks of BLOCK in index order; the online softmax sum rescales in
  that order): a row's token is bitwise the same for any M, any batch, any padding.
- No host sync, no allocation but the output: CUDA-graph capturable. The number of passes depends on
  the data (a while loop in the program), not on the launch.
- Ties of z + g go to the lowest index (torch.argmax's rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _mix(x):
    """lowbias32 on uint32 (baton/engine/noise.py's hash32: there split in 16-bit halves on int64)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _noise(rowkey, idx):
    """Gumbel(0, 1) of the row's key (uint32 scalar) at vocab indices idx [B] (noise.uniform's bits)."""
    bits = _mix(rowkey ^ _mix((idx * 2 + 1).to(tl.uint32)))
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _key(z):
    """float32 -> uint32, order-preserving (z normalised: no -0.0)."""
    b = z.to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) == 1, b ^ 0xFFFFFFFF, b | 0x80000000)


@triton.jit
def _unkey(u):
    b = tl.where((u >> 31) == 1, u & 0x7FFFFFFF, u ^ 0xFFFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _z(row_ptr, idx, V, T):
    """The row's z at idx (masked: -inf); + 0.0 turns a -0.0 into +0.0 (one key per float value)."""
    x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, T) + 0.0


@triton.jit
def _kth_largest(row_ptr, V, T, k, BLOCK: tl.constexpr):
    """The k-th largest z of the row (1 <= k < V), by a radix select on _key: 8 passes of 4 bits."""
    ar = tl.arange(0, BLOCK)
    bins = tl.arange(0, 16)
    prefix = tl.full((), 0, tl.uint32)
    kk = k
    for d in tl.static_range(8):
        shift = 28 - 4 * d
        cnt = tl.zeros((16,), tl.int32)
        for off in range(0, V, BLOCK):
            idx = off + ar
            u = _key(_z(row_ptr, idx, V, T))
            match = idx < V
            if d > 0:
                match = match & ((u >> (shift + 4)) == (prefix >> (shift + 4)))
            dig = ((u >> shift) & 15).to(tl.int32)
            hit = (dig[:, None] == bins[None, :]) & match[:, None]
            cnt += tl.sum(hit.to(tl.int32), axis=0)
        above = tl.sum(tl.where(bins[None, :] > bins[:, None], cnt[None, :], 0), axis=1)  # [16]: in bins > b
        sel = (above < kk) & (above + cnt >= kk)  # exactly one bin holds the kk-th largest
        b = tl.sum(tl.where(sel, bins, 0), axis=0)
        kk = kk - tl.sum(tl.where(sel, above, 0), axis=0)
        prefix = prefix | (b.to(tl.uint32) << shift)
    return _unkey(prefix)


@triton.jit(do_not_specialize=["V"])
def _pick_kernel(
    src_ptr,
    stride,
    slot_ptr,
    pos_ptr,
    t_ptr,
    topp_ptr,
    topk_ptr,
    lminp_ptr,
    shi_ptr,
    slo_ptr,
    out_ptr,
    V,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    s = tl.load(slot_ptr + r)
    T = tl.load(t_ptr + s)
    tok = tl.full((), 0, tl.int64)
    if T > 0.0:
        row = src_ptr + r.to(tl.int64) * stride
        top_p = tl.load(topp_ptr + s)
        k = tl.load(topk_ptr + s)
        lminp = tl.load(lminp_ptr + s)
        p = tl.load(pos_ptr + r)
        seed_lo = tl.load(slo_ptr + s).to(tl.uint32)
        seed_hi = tl.load(shi_ptr + s).to(tl.uint32)
        rowkey = _mix(_mix(_mix(seed_lo ^ 0x5BD1E995) ^ seed_hi) ^ p.to(tl.uint32)) ^ 0x9E3779B9
        ar = tl.arange(0, BLOCK)
        zk = tl.full((), float("-inf"), tl.float32)  # top-k: keep z >= the k-th largest
        if k > 0:
            if k < V:
                zk = _kth_largest(row, V, T, k.to(tl.int32), BLOCK)
        # pass 1: the max, the top-k set's softmax sum (online, rescaled in block order), the first candidate
        m = tl.full((), float("-inf"), tl.float32)
        tot = tl.full((), 0.0, tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        bi = tl.full((), 0, tl.int32)
        for off in range(0, V, BLOCK):
            idx = off + ar
            z = _z(row, idx, V, T)
            ink = (idx < V) & (z >= zk)
            zm = tl.where(ink, z, float("-inf"))
            m2 = tl.maximum(m, tl.max(zm, axis=0))
            scale = tl.where(m2 == float("-inf"), 1.0, tl.exp(m - m2))  # a block wholly outside the top-k
            tot = tot * scale + tl.sum(tl.where(ink, tl.exp(z - m2), 0.0), axis=0)
            m = m2
            sc = tl.where(ink, z + _noise(rowkey, idx), float("-inf"))
            bb = tl.max(sc, axis=0)
            if bb > best:
                best = bb
                bi = tl.min(tl.where(sc == bb, idx, 2147483647), axis=0)
        target = top_p * tot
        zc = _z(row, bi, V, T)
        go = (zc - m < lminp) | (top_p < 1.0)
        while go:
            # one pass: the mass above the candidate, and the next candidate (the argmax above it)
            mass = tl.full((), 0.0, tl.float32)
            best = tl.full((), float("-inf"), tl.float32)
            nxt = bi
            for off in range(0, V, BLOCK):
                idx = off + ar
                z = _z(row, idx, V, T)
                up = (idx < V) & (z > zc)
                mass += tl.sum(tl.where(up, tl.exp(z - m), 0.0), axis=0)
                sc = tl.where(up, z + _noise(rowkey, idx), float("-inf"))
                bb = tl.max(sc, axis=0)
                if bb > best:
                    best = bb
                    nxt = tl.min(tl.where(sc == bb, idx, 2147483647), axis=0)
            if (zc - m >= lminp) & ((top_p >= 1.0) | (mass < target)):
                go = False
            else:
                bi = nxt
                zc = _z(row, bi, V, T)
                go = (zc - m < lminp) | (top_p < 1.0)
        tok = bi.to(tl.int64)
    tl.store(out_ptr + r, tok)


def pick(src: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, table) -> torch.Tensor:
    """src [M, V] (rows contiguous), slots [M] long (the table's rows: the scratch slot for padding, T = 0),
    positions [M] long -> [M] long: each sampling row's token (0 for T = 0 rows). table: a SamplingTable
    (its [S + 1] device parameters)."""
    M, V = src.shape
    if src.stride(1) != 1:
        src = src.contiguous()
    out = torch.empty(M, dtype=torch.int64, device=src.device)
    if M == 0:
        return out
    t = table
    _pick_kernel[(M,)](
        src, src.stride(0), slots, positions, t.temperature, t.top_p, t.top_k, t.log_min_p,
        t.seed_hi, t.seed_lo, out, V, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    return out
