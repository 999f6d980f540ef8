"""The split-window attention's fp32 partials (baton/kernels/attention.py: attention_rows): their shapes, their
bytes for the KV sizing, and on CUDA the one buffer a runner that all its calls share.

Why one buffer: each captured graph used to keep partials sized by its own rows in the runners' shared pool
(a prefill worker over a 131,072-token window on an H100 ran out of memory with 11.4 GB in graph pools,
2026-12-07), where one buffer takes 2.7 GB.
Lifecycle: the worker's KV sizing counts it as still to be allocated (pages.attention_scratch_bytes_of, like
the O(1) state); each CUDA ModelRunner (unless BATON_ATTN_SCRATCH=0) reserves its own at construction (runner_scratch, kept as HybridState.attn_scratch:
the most rows a call takes over its window's pieces), before any graph is captured; its captured graphs and
eager calls then take views of it (split_buffers) and it lives as long as the runner.
Why it is safe: a runner's calls are launched in order, under its engine's one compute lock, on the
device's one compute stream (the hand-off's streams copy state and pages only). It is per runner, not per
device, because two engines in one process (tests, in-process serving) hold two locks.
No torch op here touches Triton, so the workers' memory plans import it on any machine."""

from __future__ import annotations

import math
import os

import torch


def split_scratch(rows: int, nh: int, ns: int, d: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The fp32 partials attention_rows allocates a call: acc [rows, nh, ns, d] and (max, sum) [rows, nh, ns, 2],
    ns = the page table's width (the window's pieces, not the rows' positions): a captured graph's pool holds
    them, so a long window's scratch (~3 GB at 320 rows of the 9B over 150K tokens) is one buffer a runner
    (reserve_split_scratch), counted in the KV sizing (baton/engine/pages.py: attention_scratch_bytes_of)."""
    return (rows, nh, ns, d), (rows, nh, ns, 2)


def split_scratch_bytes(rows: int, nh: int, ns: int, d: int) -> int:
    """Bytes of split_scratch's two fp32 buffers."""
    return sum(4 * math.prod(shape) for shape in split_scratch(rows, nh, ns, d))


PARTIALS_ENV = "BATON_ATTN_PROGRAM_PARTIALS"  # N > 0: one partial a program, N programs (attention_loop.py)


def program_partials() -> int:
    """BATON_ATTN_PROGRAM_PARTIALS=N: the attention's programs merge their own pieces, so a (row, head) keeps N
    partials, not one a piece of the window (baton/kernels/attention_loop.py, "Program partials"); 0 (unset):
    one a piece. Every worker of a deployment must run the same N (a row's bits depend on it past N pieces)."""
    raw = os.environ.get(PARTIALS_ENV, "").strip() or "0"
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{PARTIALS_ENV}: {raw!r} is not a whole number of programs") from None
    return max(0, n)


def partial_slots(ns: int) -> int:
    """The partials a (row, head) keeps over a window of ns pieces: min(N, ns) with program partials on, else ns."""
    n = program_partials()
    return min(n, ns) if n else ns


SCRATCH_ENV = "BATON_ATTN_SCRATCH"  # "0": each call allocates its own partials (a graph's pool keeps them)
# on by default at every window since test_gpu_verify / batch / mtp_batch passed with it (H100, 2026-12-07)


def runner_scratch(device, cfg, max_len: int) -> torch.Tensor | None:
    """A CUDA runner's scratch (HybridState.attn_scratch) for its window, or None: the CPU (whose calls
    allocate their own), or BATON_ATTN_SCRATCH=0."""
    if torch.device(device).type != "cuda" or os.environ.get(SCRATCH_ENV, "").strip() == "0":
        return None
    from baton.engine.fused_blocks import MAX_ROWS
    from baton.engine.pages import pages_for

    ns = partial_slots(pages_for(max_len))
    return reserve_split_scratch(device, MAX_ROWS, cfg.num_attention_heads, ns, cfg.head_dim)


def reserve_split_scratch(device, rows: int, nh: int, ns: int, d: int) -> torch.Tensor:
    """The scratch of one runner (HybridState.attn_scratch): an fp32 buffer for calls of up to `rows` rows
    over ns pieces (runner_scratch decides whether a runner has one)."""
    return torch.empty(split_scratch_bytes(rows, nh, ns, d) // 4, dtype=torch.float32, device=device)


def split_buffers(
    rows: int, nh: int, ns: int, d: int, device, scratch: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """acc, ml of a call: views of the runner's scratch when it holds them, else their own."""
    acc_shape, ml_shape = split_scratch(rows, nh, ns, d)
    n_acc, n_ml = math.prod(acc_shape), math.prod(ml_shape)
    if scratch is None or scratch.numel() < n_acc + n_ml:
        return tuple(torch.empty(shape, dtype=torch.float32, device=device) for shape in (acc_shape, ml_shape))
    return scratch[:n_acc].view(acc_shape), scratch[n_acc : n_acc + n_ml].view(ml_shape)
