"""Slot rows copied in place: dst[idx[i]] = src[idx[i]], one kernel a tensor, no temporary.

    copy_rows(src [S, ...], dst [S, ...], idx [n] long)   src, dst contiguous, same shape and dtype

torch's way, dst.index_copy_(0, idx, src.index_select(0, idx)), moves each row twice: into a temporary
and out of it (4 x the row's bytes through HBM). This reads it once and writes it once. Used for
HybridState's snapshot / restore of many slots (baton/engine/slot_copies.py, inside captured graphs): at
the 9B shape a slot's O(1) state is ~50 MB, and a Verify batch of 8 sessions spent 2.4 ms of device time
in the two copies on an H100 (bench_exact_passes rewind_ms). A copy does no arithmetic: the bits are the
source's. Duplicate indices copy the same row again (SlotCopies pads a bucket so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_MAX = 4096  # elements a program copies (16 KB of fp32)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, idx_ptr, D, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(idx_ptr + i).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(src_ptr + row * D + offs, mask=m)
    tl.store(dst_ptr + row * D + offs, x, mask=m)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, idx: torch.Tensor) -> None:
    """dst[idx[i]] = src[idx[i]] for every i (see the module docstring). Capturable: one launch, no host
    read, no allocation."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_rows: src and dst must be contiguous")
    n = idx.numel()
    if n == 0 or src.numel() == 0:
        return
    D = src.numel() // src.shape[0]
    block = min(BLOCK_MAX, triton.next_power_of_2(D))
    _copy_rows_kernel[(n, triton.cdiv(D, block))](src, dst, idx, D, BLOCK=block)
