"""The prefill's attention over one pass's segments (Qwen3_5Attention.forward, `ctx.width is None`).

Each segment (one slot's prompt piece, baton/models/context.py Segment) attends its own slot's keys
[0, start + n), causal, in one scaled_dot_product_attention call: `attend_segment`, the call of the segment
alone, so a prompt's state is the same alone or in any pass.

Pieces of one shape (the same start and n: the first pieces of a burst of same-length prompts, then their
later pieces when they are long) may go through one call with a batch dimension instead
(`attend_first_pieces`, `attend_pieces`; BATON_PREFILL_SDPA_BATCH=1), a pass of 8 x 512 tokens then making 8
calls a layer fewer (cuDNN's host side took ~1.3 ms a call on an H100: benchmarks/results/
gpu-h100-2026-12-06-mps.md). Whether a backend picks another kernel for another batch size is the backend's,
so on CUDA only what the GPU test showed bitwise is batched: pieces under cuDNN's SDPA (first and later
pieces passed on an H100). Flash's (BATON_PREFILL_CUDNN_SDPA=0) batched first pieces differed from each alone
there (2026-12-07, tests/engine/test_gpu_prefill.py: layers.4.conv), so without cuDNN every segment runs
its own call. On the CPU tests/engine/test_batched_prefill.py
checks every grouping bitwise. Off by default: in a burst of 8 or 32 x 512 on the H100 the passes took the
same time batched or not (benchmarks/results/gpu-h100-2026-12-07.md).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

SDPA_BATCH_ENV = "BATON_PREFILL_SDPA_BATCH"  # "1": equal first pieces in one SDPA call (module doc); default off
# BATON_PREFILL_CUDNN_SDPA=0: the prefill's attention never takes torch's cuDNN SDPA backend (flash instead, as
# its later pieces already do through causal_lower_right). cuDNN's host side took 1.5-2.8 ms a call in the
# H100 op profiles (benchmarks/results/gpu-h100-2026-12-06-tests-ops.md), one call a piece and attention
# layer (8 at the 9B shape). An A/B knob while it is measured: it changes the prefill's bits, so every
# process of a deployment (the workers, a reference run) must set it alike.
CUDNN_SDPA_ENV = "BATON_PREFILL_CUDNN_SDPA"
# BATON_PREFILL_ATTN=fixed: on CUDA every segment's attention is baton/kernels/causal_fixed.py, whose rows do not
# depend on where the piece starts, so a prompt cut at 64-multiples keeps the whole prompt's bits (the SDPA
# backends' do not on an H100: a prefill worker's --prefill-piece needs it there). Off until measured; it
# changes the prefill's bits, so every process of a deployment (the workers, a reference run) sets it alike.
ATTN_ENV = "BATON_PREFILL_ATTN"


def fixed_on(cuda: bool) -> bool:
    """BATON_PREFILL_ATTN=fixed on CUDA (module doc; the CPU's SDPA is cut-invariant already)."""
    return cuda and os.environ.get(ATTN_ENV, "sdpa") == "fixed"


def batching_on(cuda: bool = False) -> bool:
    """BATON_PREFILL_SDPA_BATCH=1, and on CUDA cuDNN's SDPA on (module doc: flash's batched calls differ) and
    the fixed kernel off (it runs each segment alone)."""
    if cuda and (os.environ.get(CUDNN_SDPA_ENV, "1") == "0" or fixed_on(cuda)):
        return False
    return os.environ.get(SDPA_BATCH_ENV, "0") == "1"


def groups(segs: list, batch: bool) -> list[list]:
    """The pass's segments in order, in runs attended by one call: consecutive pieces of one shape (the same
    start and length: first pieces of equal prompts' lengths, or the same piece of equal-length long
    prompts) when batch is True, else one segment each."""
    out: list[list] = []
    for sg in segs:
        last = out[-1] if out else None
        if batch and last and sg.start == last[-1].start and sg.n == last[-1].n:
            last.append(sg)
        else:
            out.append([sg])
    return out


def attend_segment(q, keys, vals, start: int, g: int) -> torch.Tensor:
    """One segment: q [T, nh, d] at positions [start, start + T), keys, vals [nkv, start + T, d] of its
    slot -> o [T, nh*d]. Each KV head serves g = nh / nkv query heads."""
    T = q.shape[0]
    if fixed_on(q.is_cuda):
        from baton.kernels.causal_fixed import causal_fixed  # (Triton: imported where used)

        return causal_fixed(q, keys, vals, start)
    kk = keys.repeat_interleave(g, dim=0)  # [nh, s0+T, d]
    vv = vals.repeat_interleave(g, dim=0)
    o = _causal(q.transpose(0, 1)[None], kk[None], vv[None], start)[0]  # [nh, T, d]
    return o.transpose(0, 1).reshape(T, -1)  # [T, nh*d]


def attend_first_pieces(q, k, v, b: int, g: int) -> torch.Tensor:
    """b first pieces of n rows each, consecutive in the pass: q [b*n, nh, d], k, v [b*n, nkv, d] (the
    pieces' own keys: start 0) -> o [b*n, nh*d], piece j's rows at [j*n, (j+1)*n), each as attend_segment."""
    n, d = q.shape[0] // b, q.shape[2]
    keys = k.view(b, n, -1, d).transpose(1, 2).contiguous()  # [b, nkv, n, d]
    vals = v.view(b, n, -1, d).transpose(1, 2).contiguous()
    return attend_pieces(q, keys, vals, 0, g)


def attend_pieces(q, keys, vals, start: int, g: int) -> torch.Tensor:
    """b pieces of n rows each at positions [start, start + n) of their own slots, consecutive in the pass:
    q [b*n, nh, d], keys, vals [b, nkv, start + n, d] (piece j's slot's keys) -> o [b*n, nh*d], piece j's
    rows at [j*n, (j+1)*n), each as attend_segment."""
    b, n, nh, d = keys.shape[0], q.shape[0] // keys.shape[0], q.shape[1], q.shape[2]
    qb = q.reshape(b, n, nh, d).transpose(1, 2)  # [b, nh, n, d]
    o = _causal(qb, keys.repeat_interleave(g, dim=1), vals.repeat_interleave(g, dim=1), start)  # [b, nh, n, d]
    return o.transpose(1, 2).reshape(b * n, nh * d)


def _causal(q, k, v, start: int) -> torch.Tensor:
    """SDPA of queries q [b, nh, n, d] at positions [start, start + n) against keys k, v [b, nh, start + n, d]:
    query i sees keys <= start + i (no [n, start + n] mask is built for a later piece)."""
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # imported here: torch.nn.attention.bias imports torch._dynamo (~1 s of every process start)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], start + q.shape[2]))
