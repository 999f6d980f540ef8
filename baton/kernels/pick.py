"""The sampled token pick on CUDA, sort-free, each row split over many programs (issue 22's speed bound).

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
token iff c is in K. If it is not, no token with z <= z_c is in K either (every cut is monotone in z), so
K lies in {z > z_c}: take the argmax of z + g over that set and test again. A test is one pass over the
row (the mass above z_c and the next candidate together); a candidate passes with probability at least
top_p, and the row's maximum always passes, so it ends. top-k first finds the k-th largest z by a radix
select on its order-preserving 32-bit key (8 passes of 4 bits, integer counts).

The launches (fixed, so a CUDA graph captures them; rows that need less return at once):
    8 x _radix   (M, P)   4-bit digit counts of each chunk (rows with top-k only)
    _stats       (M, P)   each chunk's max, softmax sum (top-k set) and best z + g
    2 x _check   (M, P)   each chunk's mass above the candidate and best z + g above it
    _final       (M,)     replays the decisions; a row still undecided goes on alone, chunk by chunk
A row is cut into P = cdiv(V, CHUNK) chunks of CHUNK entries, one program each: a one-row step spreads
over ~60 SMs instead of one (one program per row took ~0.6 ms for a 248K row on the H200).

Invariants
- Row invariance by construction: CHUNK is fixed (never a function of M), a program reads only its row's
  chunk and its slot's parameters, and every program of a row reduces the row's chunk partials in one
  order (j = 0, 1, ...), whatever M: a row's token is bitwise the same alone or in any batch. The
  fallback of _final sums the same chunk partials, by the same helpers, in the same order.
- No host sync; the only allocations are the outputs and the partials: CUDA-graph capturable.
- Ties of z + g go to the lowest index (torch.argmax's rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # entries of a row per program (248,320 -> 61 chunks)
BLOCK = 2048
CHECKS = 2  # _check launches; a row undecided after them finishes in _final
RBLOCK = 256  # the radix counts' block: [RBLOCK, 16] one-hots (at 2048, top-k cost 1.7 ms: a register-pressure guess)


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
def _row(src_ptr, stride, slot_ptr, pos_ptr, t_ptr, shi_ptr, slo_ptr, r):
    """Row r's pointer, slot, temperature and noise key."""
    s = tl.load(slot_ptr + r)
    T = tl.load(t_ptr + s)
    p = tl.load(pos_ptr + r)
    seed_lo = tl.load(slo_ptr + s).to(tl.uint32)
    seed_hi = tl.load(shi_ptr + s).to(tl.uint32)
    rowkey = _mix(_mix(_mix(seed_lo ^ 0x5BD1E995) ^ seed_hi) ^ p.to(tl.uint32)) ^ 0x9E3779B9
    return src_ptr + r.to(tl.int64) * stride, s, T, rowkey


@triton.jit
def _radix_prefix(hist_ptr, r, P, k, NDIG: tl.constexpr, PB: tl.constexpr):
    """The first NDIG 4-bit digits (from the top) of the k-th largest key of row r, from the chunks' digit
    counts hist [M, 8, P, 16] (integer sums: any order is exact) -> (prefix uint32, rank left within it)."""
    bins = tl.arange(0, 16)
    jj = tl.arange(0, PB)
    prefix = tl.full((), 0, tl.uint32)
    kk = k
    for d in tl.static_range(NDIG):
        base = hist_ptr + (r.to(tl.int64) * 8 + d) * P * 16
        cnt = tl.sum(tl.load(base + jj[:, None] * 16 + bins[None, :], mask=jj[:, None] < P, other=0), axis=0)
        above = tl.sum(tl.where(bins[None, :] > bins[:, None], cnt[None, :], 0), axis=1)  # [16]: in bins > b
        sel = (above < kk) & (above + cnt >= kk)  # exactly one bin holds the kk-th largest
        b = tl.sum(tl.where(sel, bins, 0), axis=0)
        kk = kk - tl.sum(tl.where(sel, above, 0), axis=0)
        prefix = prefix | (b.to(tl.uint32) << (28 - 4 * d))
    return prefix, kk


@triton.jit(do_not_specialize=["V", "P"])
def _radix_kernel(
    src_ptr, stride, slot_ptr, pos_ptr, t_ptr, topk_ptr, shi_ptr, slo_ptr, hist_ptr, V, P,
    D: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr, RBLOCK: tl.constexpr,
):  # fmt: skip
    """Digit D's counts of chunk j of row r (top-k rows only), among the keys that match the first D digits."""
    r, j = tl.program_id(0), tl.program_id(1)
    row, s, T, rowkey = _row(src_ptr, stride, slot_ptr, pos_ptr, t_ptr, shi_ptr, slo_ptr, r)
    k = tl.load(topk_ptr + s)
    if (T > 0.0) & (k > 0) & (k < V):
        prefix, kk = _radix_prefix(hist_ptr, r, P, k.to(tl.int32), D, PB)
        bins = tl.arange(0, 16)
        ar = tl.arange(0, RBLOCK)
        cnt = tl.zeros((16,), tl.int32)
        for off in range(j * CHUNK, j * CHUNK + CHUNK, RBLOCK):  # [RBLOCK, 16] one-hots, kept small
            idx = off + ar
            u = _key(_z(row, idx, V, T))
            match = idx < V
            if D > 0:
                match = match & ((u >> (32 - 4 * D)) == (prefix >> (32 - 4 * D)))
            dig = ((u >> (28 - 4 * D)) & 15).to(tl.int32)
            cnt += tl.sum(((dig[:, None] == bins[None, :]) & match[:, None]).to(tl.int32), axis=0)
        tl.store(hist_ptr + ((r.to(tl.int64) * 8 + D) * P + j) * 16 + bins, cnt)


@triton.jit
def _better(sc, idx, best, bi):
    """A block's best score sc [B] at vocab indices idx [B] against the best so far (best, bi): the block's
    wins only if strictly greater (blocks come in index order: ties keep the lowest index)."""
    bb = tl.max(sc, axis=0)
    if bb > best:
        best = bb
        bi = tl.min(tl.where(sc == bb, idx, 2147483647), axis=0)
    return best, bi


@triton.jit
def _chunk_stats(row, j, V, T, zk, rowkey, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk j over the top-k set (z >= zk): (max z, sum of exp(z - that max), best z + g, its index)."""
    ar = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    tot = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    bi = tl.full((), 2147483647, tl.int32)
    for off in range(j * CHUNK, j * CHUNK + CHUNK, BLOCK):
        idx = off + ar
        z = _z(row, idx, V, T)
        ink = (idx < V) & (z >= zk)
        m2 = tl.maximum(m, tl.max(tl.where(ink, z, float("-inf")), axis=0))
        scale = tl.where(m2 == float("-inf"), 1.0, tl.exp(m - m2))  # a block wholly outside the set: tot stays 0
        tot = tot * scale + tl.sum(tl.where(ink, tl.exp(z - m2), 0.0), axis=0)
        m = m2
        best, bi = _better(tl.where(ink, z + _noise(rowkey, idx), float("-inf")), idx, best, bi)
    return m, tot, best, bi


@triton.jit
def _chunk_above(row, j, V, T, zc, m, rowkey, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk j over {z > zc}: (sum of exp(z - m), best z + g, its index)."""
    ar = tl.arange(0, BLOCK)
    mass = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    bi = tl.full((), 2147483647, tl.int32)
    for off in range(j * CHUNK, j * CHUNK + CHUNK, BLOCK):
        idx = off + ar
        z = _z(row, idx, V, T)
        up = (idx < V) & (z > zc)
        mass += tl.sum(tl.where(up, tl.exp(z - m), 0.0), axis=0)
        best, bi = _better(tl.where(up, z + _noise(rowkey, idx), float("-inf")), idx, best, bi)
    return mass, best, bi


@triton.jit
def _state(stat_ptr, stati_ptr, r, P, PB: tl.constexpr):
    """Row r's max m, top-k softmax sum S (each chunk's sum rescaled to m, then reduced in one fixed tree
    order over the P chunks) and first candidate (the best chunk's; ties: the lowest chunk, so index)."""
    jj = tl.arange(0, PB)
    base = r.to(tl.int64) * P
    ok = jj < P
    mj = tl.load(stat_ptr + (base + jj) * 3, mask=ok, other=float("-inf"))
    sj = tl.load(stat_ptr + (base + jj) * 3 + 1, mask=ok, other=0.0)
    bj = tl.load(stat_ptr + (base + jj) * 3 + 2, mask=ok, other=float("-inf"))
    m = tl.max(mj, axis=0)
    tot = tl.sum(tl.where(mj == float("-inf"), 0.0, sj * tl.exp(mj - m)), axis=0)
    best = tl.max(bj, axis=0)
    jb = tl.min(tl.where(bj == best, jj, PB), axis=0)
    c = tl.load(stati_ptr + base + jb)
    return m, tot, c


@triton.jit
def _fold(chk_ptr, chki_ptr, base, P, PB: tl.constexpr):
    """The row's mass above its candidate (the chunks' partials at base, one fixed tree order) and the next
    candidate (the best chunk's)."""
    jj = tl.arange(0, PB)
    ok = jj < P
    mass = tl.sum(tl.load(chk_ptr + (base + jj) * 2, mask=ok, other=0.0), axis=0)
    bj = tl.load(chk_ptr + (base + jj) * 2 + 1, mask=ok, other=float("-inf"))
    best = tl.max(bj, axis=0)
    jb = tl.min(tl.where(bj == best, jj, PB), axis=0)
    return mass, tl.load(chki_ptr + base + jb)


@triton.jit
def _decide(row, V, T, m, tot, c, zc, top_p, lminp, mass, nxt):
    """One check's verdict: (done 0 / 1, candidate, its z)."""
    done = tl.full((), 0, tl.int32)
    if (zc - m >= lminp) & (mass < top_p * tot):
        done = tl.full((), 1, tl.int32)
    else:
        c = nxt
        zc = _z(row, c, V, T)
        done = ((zc - m >= lminp) & (top_p >= 1.0)).to(tl.int32)
    return done, c, zc


@triton.jit
def _replay(row, V, T, m, tot, c, top_p, lminp, chk_ptr, chki_ptr, r, M, P, NCHK: tl.constexpr, PB: tl.constexpr):
    """The decisions of the first NCHK checks of row r -> (done 0 / 1, candidate, its z)."""
    zc = _z(row, c, V, T)
    done = ((zc - m >= lminp) & (top_p >= 1.0)).to(tl.int32)  # no mass to test: the candidate stands
    for i in tl.static_range(NCHK):
        if done == 0:
            mass, nxt = _fold(chk_ptr, chki_ptr, (i * M + r.to(tl.int64)) * P, P, PB)
            done, c, zc = _decide(row, V, T, m, tot, c, zc, top_p, lminp, mass, nxt)
    return done, c, zc


@triton.jit(do_not_specialize=["V", "P"])
def _stats_kernel(
    src_ptr, stride, slot_ptr, pos_ptr, t_ptr, topk_ptr, shi_ptr, slo_ptr, hist_ptr, stat_ptr, stati_ptr, V, P,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr,
):  # fmt: skip
    r, j = tl.program_id(0), tl.program_id(1)
    row, s, T, rowkey = _row(src_ptr, stride, slot_ptr, pos_ptr, t_ptr, shi_ptr, slo_ptr, r)
    if T > 0.0:
        k = tl.load(topk_ptr + s)
        zk = tl.full((), float("-inf"), tl.float32)
        if (k > 0) & (k < V):
            prefix, kk = _radix_prefix(hist_ptr, r, P, k.to(tl.int32), 8, PB)
            zk = _unkey(prefix)
        m, tot, best, bi = _chunk_stats(row, j, V, T, zk, rowkey, CHUNK, BLOCK)
        o = r.to(tl.int64) * P + j
        tl.store(stat_ptr + o * 3, m)
        tl.store(stat_ptr + o * 3 + 1, tot)
        tl.store(stat_ptr + o * 3 + 2, best)
        tl.store(stati_ptr + o, bi)


@triton.jit(do_not_specialize=["V", "P", "M"])
def _check_kernel(
    src_ptr, stride, slot_ptr, pos_ptr, t_ptr, topp_ptr, lminp_ptr, shi_ptr, slo_ptr, stat_ptr, stati_ptr,
    chk_ptr, chki_ptr, V, M, P, L: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr,
):  # fmt: skip
    """Check L of row r's candidate (after the L checks before it): chunk j's partials above it."""
    r, j = tl.program_id(0), tl.program_id(1)
    row, s, T, rowkey = _row(src_ptr, stride, slot_ptr, pos_ptr, t_ptr, shi_ptr, slo_ptr, r)
    if T > 0.0:
        top_p = tl.load(topp_ptr + s)
        lminp = tl.load(lminp_ptr + s)
        m, tot, c = _state(stat_ptr, stati_ptr, r, P, PB)
        done, c, zc = _replay(row, V, T, m, tot, c, top_p, lminp, chk_ptr, chki_ptr, r, M, P, L, PB)
        if done == 0:
            mass, best, bi = _chunk_above(row, j, V, T, zc, m, rowkey, CHUNK, BLOCK)
            o = (L * M + r.to(tl.int64)) * P + j
            tl.store(chk_ptr + o * 2, mass)
            tl.store(chk_ptr + o * 2 + 1, best)
            tl.store(chki_ptr + o, bi)


@triton.jit(do_not_specialize=["V", "P", "M"])
def _final_kernel(
    src_ptr, stride, slot_ptr, pos_ptr, t_ptr, topp_ptr, lminp_ptr, shi_ptr, slo_ptr, stat_ptr, stati_ptr,
    chk_ptr, chki_ptr, out_ptr, V, M, P, L: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    PB: tl.constexpr,
):  # fmt: skip
    """Row r's token: the decisions of the L checks, then (rarely) more checks run here, chunk by chunk."""
    r = tl.program_id(0)
    row, s, T, rowkey = _row(src_ptr, stride, slot_ptr, pos_ptr, t_ptr, shi_ptr, slo_ptr, r)
    tok = tl.full((), 0, tl.int64)
    if T > 0.0:
        top_p = tl.load(topp_ptr + s)
        lminp = tl.load(lminp_ptr + s)
        m, tot, c = _state(stat_ptr, stati_ptr, r, P, PB)
        done, c, zc = _replay(row, V, T, m, tot, c, top_p, lminp, chk_ptr, chki_ptr, r, M, P, L, PB)
        base = (L * M + r.to(tl.int64)) * P  # the spare level: this program's own partials
        while done == 0:  # a check as _check_kernel's: the same partials, folded by the same helper
            for j in range(P):
                mj, bj, ij = _chunk_above(row, j, V, T, zc, m, rowkey, CHUNK, BLOCK)
                tl.store(chk_ptr + (base + j) * 2, mj)
                tl.store(chk_ptr + (base + j) * 2 + 1, bj)
                tl.store(chki_ptr + base + j, ij)
            tl.debug_barrier()  # the block's stores are visible to its own loads
            mass, nxt = _fold(chk_ptr, chki_ptr, base, P, PB)
            done, c, zc = _decide(row, V, T, m, tot, c, zc, top_p, lminp, mass, nxt)
            tl.debug_barrier()  # every thread has read the partials before the next round overwrites them
        tok = c.to(tl.int64)
    tl.store(out_ptr + r, tok)


def pick(src: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, table, *, top_k: bool = True) -> torch.Tensor:
    """src [M, V] (rows contiguous), slots [M] long (the table's rows: the scratch slot for padding, T = 0),
    positions [M] long -> [M] long: each sampling row's token (0 for T = 0 rows). table: a SamplingTable
    (its [S + 1] device parameters). top_k=False: no row uses top-k (a host fact; a captured graph serves
    any table, so it passes True): the radix launches are skipped, the tokens are the same."""
    M, V = src.shape
    if src.stride(1) != 1:
        src = src.contiguous()
    slots, positions = slots.contiguous(), positions.contiguous()  # the kernels read element r (an expand: stride 0)
    dev = src.device
    out = torch.empty(M, dtype=torch.int64, device=dev)
    if M == 0:
        return out
    t, P = table, triton.cdiv(V, CHUNK)
    hist = torch.empty(M, 8, P, 16, dtype=torch.int32, device=dev)
    stat = torch.empty(M, P, 3, dtype=torch.float32, device=dev)
    stati = torch.empty(M, P, dtype=torch.int32, device=dev)
    chk = torch.empty(CHECKS + 1, M, P, 2, dtype=torch.float32, device=dev)  # + 1: _final's own rounds
    chki = torch.empty(CHECKS + 1, M, P, dtype=torch.int32, device=dev)
    row = (src, src.stride(0), slots, positions, t.temperature)
    seeds = (t.seed_hi, t.seed_lo)
    kw = dict(CHUNK=CHUNK, BLOCK=BLOCK, PB=triton.next_power_of_2(P), num_warps=8)
    for d in range(8 if top_k else 0):
        _radix_kernel[(M, P)](*row, t.top_k, *seeds, hist, V, P, D=d, RBLOCK=RBLOCK, **kw)
    _stats_kernel[(M, P)](*row, t.top_k, *seeds, hist, stat, stati, V, P, **kw)
    params = (t.top_p, t.log_min_p, *seeds, stat, stati, chk, chki)
    for i in range(CHECKS):
        _check_kernel[(M, P)](*row, *params, V, M, P, L=i, **kw)
    _final_kernel[(M,)](*row, *params, out, V, M, P, L=CHECKS, **kw)
    return out
