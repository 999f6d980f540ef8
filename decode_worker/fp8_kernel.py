"""Split-K Triton W8A16 GEMM for small M: y[M, N] = x[M, K] @ (w_fp8[N, K] * scale[N])^T.

Decode GEMMs run at M = W = 16 rows, where cuBLAS (BF16 or `_scaled_mm`) is not bandwidth-bound.
This kernel streams e4m3 weights (half the bytes of BF16), converts them to x's dtype in registers
and feeds a tl.dot with BLOCK_M = 16 rows. K is split over SPLIT programs so that even N = 1024
puts >= ~2 programs on every SM.

    pass 1  grid (m_tiles, n_blocks, SPLIT): partial[s, m, n] = sum_{k in split s} x[m, k] w[n, k]
    pass 2  grid (n_blocks2, M):             y[m, n] = (sum_{s=0..SPLIT-1} partial[s, m, n]) * scale[n]
            (SPLIT == 1: pass 1 applies the scale and writes y; no pass 2, no partials buffer)

NOTE (determinism): no atomics; pass 2 adds the splits in the fixed order s = 0, 1, ...; the tile
config is a pure function of (M-bucket, N, K, SM count). So a given shape is bitwise repeatable.
NOTE (row invariance): output row m is computed from x row m only. Rows >= M are masked to zero,
MMA output element (m, n) depends on row m of x and row n of w only, and the config for every
M <= 16 is the same (one 16-row tile), so row m is bitwise independent of the other rows' values
and of M in 1..16. For M > 16 the rows are tiled by BLOCK_M; invariance then holds per fixed M.
NOTE (CUDA graphs): no host syncs; the partials buffer is allocated at the first call per
(device, SPLIT, M-bucket, N) and reused. Run a warm-up before capture. Buffers are shared between
modules of the same shape; that is safe for stream-ordered work (one stream / one graph at a time).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])        # one binary for every M (M = 1 is not special-cased)
def _w8a16_splitk(x_ptr, w_ptr, s_ptr, out_ptr,
                  M, N, K,
                  stride_xm, stride_wn, stride_os, stride_om,
                  K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, FINAL: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                      # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    rk = tl.arange(0, BLOCK_K)                                        # [BK]
    mask_m = rm < M
    mask_n = rn < N
    k0 = pid_s * K_PER_SPLIT
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :]   # [BM, BK]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :]   # [BN, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            mk = (k0 + k + rk) < K
            xt = tl.load(x_ptrs, mask=mask_m[:, None] & mk[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=mask_n[:, None] & mk[None, :], other=0.0)
        # fp8 -> x dtype in registers (exact for bf16/fp16/fp32), fp32 accumulation
        acc = tl.dot(xt, tl.trans(wt.to(xt.dtype)), acc, input_precision=DOT_PREC)   # [BM, BN]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_mask = mask_m[:, None] & mask_n[None, :]
    if FINAL:
        sc = tl.load(s_ptr + rn, mask=mask_n, other=0.0)              # [BN] fp32
        y = acc * sc[None, :]
        o_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        o_ptrs = out_ptr + pid_s * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(o_ptrs, acc, mask=out_mask)


@triton.jit
def _splitk_reduce(p_ptr, s_ptr, y_ptr, N, stride_ps, stride_pm, stride_ym,
                   SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    mask = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):                                  # fixed order: deterministic
        acc += tl.load(p_ptr + s * stride_ps + m * stride_pm + rn, mask=mask, other=0.0)
    sc = tl.load(s_ptr + rn, mask=mask, other=0.0)
    tl.store(y_ptr + m * stride_ym + rn, (acc * sc).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    split: int
    k_per_split: int      # multiple of block_k; split * k_per_split >= K, no empty split
    num_warps: int = 4
    num_stages: int = 4


_SMEM_BUDGET = 160 * 1024    # bytes of pipelined tiles per program (H100/H200: 227 KiB per block)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pick_config(M: int, N: int, K: int, sms: int, *, x_bytes: int = 2, block_n: int | None = None,
                block_k: int | None = None, split: int | None = None, num_warps: int = 4, num_stages: int = 4,
                programs_per_sm: int = 2) -> GemvConfig:
    """Heuristic tile config from (M-bucket, N, K, x element size, SM count); overrides are for sweeps."""
    block_m = 16 if M <= 16 else min(64, _pow2(M))    # every M <= 16 shares one config (row invariance)
    m_tiles = triton.cdiv(M, block_m)
    bk = block_k or min(256 if x_bytes <= 2 else 64, max(32, _pow2(K)))   # fp32 x: FMA dot, small K tile
    bn = block_n or (64 if N >= 65536 else 32)      # H200 sweep (benchmarks/sweep_gemv.py): 32 wins below the LM head
    k_iters = triton.cdiv(K, bk)
    if split is None:
        tiles = m_tiles * triton.cdiv(N, bn)
        split = 1
        while tiles * split < programs_per_sm * sms and split * 2 <= k_iters:
            split *= 2
    split = max(1, min(split, k_iters))
    k_per_split = triton.cdiv(k_iters, split) * bk
    split = triton.cdiv(K, k_per_split)               # drop empty splits
    stage_bytes = block_m * bk * x_bytes + bn * bk    # x tile + e4m3 w tile per pipeline stage
    while num_stages > 2 and num_stages * stage_bytes > _SMEM_BUDGET:
        num_stages -= 1
    return GemvConfig(block_m, bn, bk, split, k_per_split, num_warps, num_stages)


_SMS: dict[int, int] = {}
_WORKSPACE: dict[tuple, torch.Tensor] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132                                    # interpreter runs: pretend H200
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _partials(device: torch.device, split: int, M: int, N: int) -> torch.Tensor:
    """[split, M, N] fp32 view of a cached buffer. Buffers are never freed or regrown (a captured
    graph may hold one); rows are bucketed (16, then multiples of 64) so the cache stays small:
    split > 1 only while m_tiles * n_blocks < programs_per_sm * SMs, i.e. M <= ~512."""
    cap = 16 if M <= 16 else triton.cdiv(M, 64) * 64
    key = (str(device), split, cap, N)
    buf = _WORKSPACE.get(key)
    if buf is None:                                   # first call (warm-up), never during replay
        buf = _WORKSPACE[key] = torch.empty(split, cap, N, dtype=torch.float32, device=device)
    return buf[:, :M]


def w8a16_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                 cfg: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32), w [N, K] float8_e4m3fn, scale [N] fp32 -> y [..., N] in x.dtype."""
    K = x.shape[-1]
    N = w.shape[0]
    assert w.shape[1] == K and w.stride(1) == 1 and scale.numel() == N, (x.shape, w.shape, scale.shape)
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)           # [M, N]
    if M == 0:
        return y.view(*x.shape[:-1], N)
    cfg = cfg or pick_config(M, N, K, sm_count(x.device), x_bytes=x.element_size())
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), cfg.split)
    even_k = K % cfg.k_per_split == 0
    meta = dict(K_PER_SPLIT=cfg.k_per_split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=even_k,
                DOT_PREC=prec, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split == 1:
        _w8a16_splitk[grid](x2, w, scale, y, M, N, K,
                            x2.stride(0), w.stride(0), 0, y.stride(0), FINAL=True, **meta)
    else:
        part = _partials(x.device, cfg.split, M, N)                  # [SPLIT, M, N] fp32
        _w8a16_splitk[grid](x2, w, scale, part, M, N, K,
                            x2.stride(0), w.stride(0), part.stride(0), part.stride(1), FINAL=False, **meta)
        rb = min(1024, _pow2(N))
        _splitk_reduce[(triton.cdiv(N, rb), M)](part, scale, y, N, part.stride(0), part.stride(1), y.stride(0),
                                                SPLIT=cfg.split, BLOCK_N=rb, num_warps=4)
    return y.view(*x.shape[:-1], N)
