"""Skinny GEMM for decode rows (Triton): y[M, N] = x[M, K] @ W[N, K]^T (* scale[N]), M <= 16 rows of one
session, or M <= 128 rows of a batch of sessions.

Two weight kinds, one kernel:
    bf16 W            acc += W_tile @ x_tile^T                     (the bf16 / exact engines' rows GEMMs)
    e4m3 W, scale[N]  W8A8: each x row is quantised to e4m3 per group of FP8_GROUP = 128 columns in
                      registers (sx = amax / 448; BLOCK_K is a whole number of groups), the MMA runs
                      fp8 x fp8 -> fp32, and acc += (W_group @ xq_group^T) * sx[m]; y = acc * scale[n].
                      No per-weight conversion: W goes from HBM to the tensor cores as bytes. The same
                      arithmetic in torch: decode_worker.fp8.w8a8_reference.

glu=True: W's rows interleave (gate_i, up_i) and the epilogue writes silu(gate) * up (the fp8 MLP).

Layout: swap-AB. A program owns BLOCK_N weight rows and all (<= BLOCK_M) x rows, so the weight tile is
the MMA's M side (>= 64 rows fill a wgmma) and the decode rows are its N side (16).

    grid (m_tiles, n_tiles, SPLIT), row tiles fastest so the row tiles of one weight tile share its read
    (L2). SPLIT > 1 splits K; every split stores its fp32 partial [BM, BN],
    bumps the tile's arrival counter, and the last to arrive adds the SPLIT partials in the fixed
    order s = 0, 1, ..., writes y and resets the counter. One kernel, no atomics on data.

NOTE (determinism): data is summed in fixed orders only; the config is a pure function of
(M-bucket, N, K, weight kind, SM count). Bitwise repeatable.
NOTE (row invariance): `rows` (<= M, a runtime int) rows are valid; x rows >= rows are not read and
y rows >= rows are written as 0. Output row m depends on x row m only (the MMA's output column m;
fp8: its own group scales), and every M shares the M <= 16 config's K order (BLOCK_K and the split); only
how a tile is laid out may change with M (BLOCK_M, BLOCK_N, warps, the orientation: gemv_config.py), so
row m is bitwise independent of the other rows and of M (batch invariance: tests/engine/test_gpu_batch.py).
NOTE (CUDA graphs): no host syncs. Partials and counters are cached per device, shared by every call
(stream-ordered work only: one stream / one graph at a time), allocated at the first call (warm-up)
and never freed (a captured graph may hold them). Counters are back at 0 after every call.
NOTE (PDL): with BATON_PDL=1 the kernel may start before the previous one ends (baton/kernels/pdl.py);
nothing is read or written before pdl_enter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton.kernels.gemv_config import (  # noqa: F401 (re-exported: gemv.pick_config, gemv.TUNED, ...)
    BATCH_BLOCK_M,
    BATCH_TABLE,
    FP8_GROUP,
    TUNED,
    TUNED_BATCH,
    TUNED_PARTIAL,
    Config,
    pick_config,
)
from baton.kernels.pdl import launch_kw, pdl_enter

FP8_MAX = 448.0


@triton.jit(do_not_specialize=["M", "rows"])
def _skinny(
    x_ptr,
    sx_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    p_ptr,
    lock_ptr,
    M,
    rows,
    N,
    K,
    stride_xm,
    stride_sxm,
    stride_wn,
    stride_ym,
    K_PER_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8: tl.constexpr,
    XQ: tl.constexpr,
    PARTIAL: tl.constexpr,
    GLU: tl.constexpr,
    PDL: tl.constexpr,
    XM: tl.constexpr = False,
):
    # BLOCK_K = NSUB * SUB columns per iteration; fp8: SUB = FP8_GROUP, one quantisation group each.
    # XQ: x arrives quantised (x_ptr e4m3 [M, K], sx_ptr fp32 [M, K / SUB] = amax / 448), bitwise what
    # the FP8 branch computes in registers. PARTIAL: every split stores its scaled fp32 partial into
    # y_ptr [SPLIT, M, N] (live rows only) and the consumer sums them (rows.add_rmsnorm).
    pid_m = tl.program_id(0)  # fastest: the row tiles of one weight tile run together (one HBM read)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, SUB)  # [SUB]
    live = rm < rows
    mask_n = rn < N
    k0 = pid_s * K_PER_SPLIT
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :]  # [BM, SUB]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :]  # [BN, SUB]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    accx = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # XM: the x rows on the MMA's M side
    pdl_enter(PDL)  # x is the previous kernel's output
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB):
            kk = k + j * SUB
            if EVEN_K:
                xt = tl.load(x_ptrs + kk, mask=live[:, None], other=0.0)
                wt = tl.load(w_ptrs + kk, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
            else:
                mk = (k0 + kk + rk) < K
                xt = tl.load(x_ptrs + kk, mask=live[:, None] & mk[None, :], other=0.0)
                wt = tl.load(w_ptrs + kk, mask=mask_n[:, None] & mk[None, :], other=0.0, eviction_policy="evict_first")
            if XQ:  # dead rows / groups: q = 0, sx = 0
                sx = tl.load(
                    sx_ptr + rm.to(tl.int64) * stride_sxm + (k0 + kk) // SUB, mask=live & (k0 + kk < K), other=0.0
                )
                if XM:
                    accx += tl.dot(xt, tl.trans(wt)) * sx[:, None]
                else:
                    acc += tl.dot(wt, tl.trans(xt)) * sx[None, :]
            elif FP8:
                xf = xt.to(tl.float32)
                amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30)  # [BM]; 0-rows stay 0
                xq = (xf * (448.0 / amax)[:, None]).to(tl.float8e4nv)  # [BM, SUB] e4m3 (satfinite)
                if XM:
                    accx += tl.dot(xq, tl.trans(wt)) * (amax * (1.0 / 448.0))[:, None]
                else:
                    acc += tl.dot(wt, tl.trans(xq)) * (amax * (1.0 / 448.0))[None, :]
            elif XM:
                accx = tl.dot(xt, tl.trans(wt), accx)  # [BM, BN]
            else:
                acc = tl.dot(wt, tl.trans(xt), acc)  # [BN, BM]
    if XM:
        acc = tl.trans(accx)
    if FP8:
        acc = acc * tl.load(s_ptr + rn, mask=mask_n, other=0.0)[:, None]
    # y^T tile: element (n, m) -> y[m, n]; dead rows (m >= rows) hold 0 (their x was 0)
    if PARTIAL:  # y [SPLIT, M, N] fp32, live rows
        pp = y_ptr + (pid_s * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
        tl.store(pp, acc, mask=mask_n[:, None] & live[None, :])
    elif SPLIT == 1:
        _store_tile(y_ptr, acc, rm, pid_n, M, N, stride_ym, BLOCK_M, BLOCK_N, GLU)
    else:
        tile = pid_m * tl.num_programs(1) + pid_n
        tile_sz = BLOCK_M * BLOCK_N
        p_tile = (
            p_ptr
            + tile.to(tl.int64) * (SPLIT * tile_sz)
            + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M
            + tl.arange(0, BLOCK_M)[None, :]
        )  # [BN, BM]
        tl.store(p_tile + pid_s * tile_sz, acc, mask=live[None, :])  # dead columns are 0: not stored
        tl.debug_barrier()  # every thread's partial is written
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # last split of this tile
            tot = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # fixed order: deterministic
                tot += tl.load(p_tile + s * tile_sz, mask=live[None, :], other=0.0, cache_modifier=".cg")
            _store_tile(y_ptr, tot, rm, pid_n, M, N, stride_ym, BLOCK_M, BLOCK_N, GLU)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _store_tile(
    y_ptr, acc, rm, pid_n, M, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GLU: tl.constexpr
):
    """acc [BN, BM] fp32, weight rows pid_n*BN.. -> y. GLU: weight rows interleave (gate_i, up_i), so the
    tile holds BN/2 pairs; y[m, i] = silu(g) * u with g, u first rounded to y's dtype (bitwise what
    rows.silu_mul computes from the unfused GEMM's output)."""
    if GLU:
        a = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        g, u = tl.split(tl.permute(tl.reshape(a, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1)))  # [BN/2, BM] each
        val = g * tl.sigmoid(g) * u
        rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_out = N // 2
    else:
        val = acc
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_out = N
    mask = (rn < n_out)[:, None] & (rm < M)[None, :]
    tl.store(y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None], val.to(y_ptr.dtype.element_ty), mask=mask)


_SMS: dict[int, int] = {}
_PARTIALS: dict[str, torch.Tensor] = {}
_LOCKS: dict[str, torch.Tensor] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: pretend H200
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _workspace(cache: dict, device: torch.device, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A cached zeroed buffer of >= n elements. Grows by replacement; the old one is kept alive (a
    captured graph may point at it)."""
    key = str(device)
    buf = cache.get(key)
    if buf is None or buf.numel() < n:  # first call (warm-up), never during replay
        new = torch.zeros(max(n, 1 << 16), dtype=dtype, device=device)
        if buf is not None:
            cache[key + f"/old{buf.numel()}"] = buf
        buf = cache[key] = new
    return buf


@dataclass(frozen=True)
class QuantX:
    """x [M, K] already quantised for the W8A8 kernel, made by rows.add_rmsnorm(quant=True): q [M, K]
    e4m3 and s [M, K / FP8_GROUP] fp32 (amax / 448 of each group), bitwise what `linear` computes from
    the bf16 x in registers; `dtype` is that x's dtype (the output's). Rows >= the live rows are junk
    and never read."""

    q: torch.Tensor
    s: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def linear(
    x: torch.Tensor | QuantX,
    w: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    rows: int | None = None,
    cfg: Config | None = None,
    glu: bool = False,
    partial: bool = False,
) -> torch.Tensor:
    """x [..., K] bf16/fp16, w [N, K] (x.dtype, or float8_e4m3fn with scale [N] fp32) -> y [..., N] in x.dtype.
    Only the first `rows` rows of x (flattened; default all) are computed; the rest of y is 0.
    glu: w's rows interleave (gate_i, up_i) (`interleave_glu`); y [..., N/2] = silu(gate) * up, in the
    GEMM's epilogue (one kernel instead of GEMM + silu_mul, bitwise the same values).
    x may be a QuantX [M, K] (fp8 w only): the same result without quantising x in the K loop.
    partial: returns the split-K partials P [SPLIT, M, N] fp32 (scaled; rows >= `rows` unwritten)
    instead of y, for a consumer that sums them in the order s = 0, 1, ... and rounds to x's dtype, which
    is bitwise y (rows.add_rmsnorm); the kernel then skips its own reduction."""
    xq = x if isinstance(x, QuantX) else None
    K = x.shape[-1]
    N = w.shape[0]
    fp8 = w.dtype == torch.float8_e4m3fn
    dtype = xq.dtype if xq is not None else x.dtype
    assert w.shape[1] == K and w.stride(1) == 1, (x.shape, w.shape)
    assert fp8 == (scale is not None) and (not fp8 or scale.numel() == N), "fp8 weights need a scale[N]"
    assert fp8 or w.dtype == x.dtype, (w.dtype, x.dtype)
    assert not glu or N % 2 == 0, "glu: gate and up rows come in pairs"
    assert not (glu and partial), "glu: the epilogue needs the whole sum"
    if fp8 and not scale.is_contiguous():
        scale = scale.contiguous()  # a strided row-slice view (interleaved gate/up)
    if xq is not None:
        assert fp8 and xq.q.dim() == 2 and xq.q.is_contiguous() and xq.s.is_contiguous(), "QuantX: fp8 w, [M, K]"
        assert xq.s.shape == (xq.q.shape[0], triton.cdiv(K, FP8_GROUP)), (xq.q.shape, xq.s.shape)
        x2, sx = xq.q, xq.s
        lead = xq.q.shape[:-1]
    else:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        sx, lead = x2, x.shape[:-1]
    M = x2.shape[0]
    rows = M if rows is None else min(int(rows), M)
    n_out = N // 2 if glu else N
    cfg = cfg or pick_config(M, N, K, sm_count(x2.device), fp8=fp8, partial=partial)
    if partial:
        y = torch.empty(cfg.split, M, N, dtype=torch.float32, device=x2.device)  # [SPLIT, M, N]
    else:
        y = torch.empty(M, n_out, dtype=dtype, device=x2.device)  # [M, n_out]
    if M == 0:
        return y if partial else y.view(*lead, n_out)
    assert not glu or cfg.block_n % 2 == 0
    n_tiles, m_tiles = triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m)
    if cfg.split > 1 and not partial:
        tiles = n_tiles * m_tiles
        part = _workspace(_PARTIALS, x2.device, tiles * cfg.split * cfg.block_m * cfg.block_n, torch.float32)
        locks = _workspace(_LOCKS, x2.device, tiles, torch.int32)
    else:
        part = locks = y
    _skinny[(m_tiles, n_tiles, cfg.split)](
        x2,
        sx,
        w,
        scale if fp8 else y,
        y,
        part,
        locks,
        M,
        rows,
        N,
        K,
        x2.stride(0),
        sx.stride(0),
        w.stride(0),
        y.stride(-2),
        K_PER_SPLIT=cfg.k_per_split,
        SPLIT=cfg.split,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SUB=FP8_GROUP if fp8 else cfg.block_k,
        EVEN_K=K % cfg.k_per_split == 0,
        FP8=fp8,
        XQ=xq is not None,
        PARTIAL=partial,
        GLU=glu,
        XM=cfg.xm,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_kw(x2.device),
    )
    return y if partial else y.view(*lead, n_out)


def interleave_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [I, ...] -> [2I, ...] with rows (gate_0, up_0, gate_1, up_1, ...): the `glu` layout.
    gate = out[0::2], up = out[1::2] are row-strided views of it."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])
