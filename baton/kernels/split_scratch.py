"""The split-window attention's fp32 partials (baton/kernels/attention.py: attention_rows): their shapes, their
bytes for the KV sizing, and on CUDA the one buffer a device that every call shares.

Lifecycle: the worker's KV sizing counts it as still to be allocated (pages.attention_scratch_bytes_of, like
the O(1) state); each CUDA ModelRunner reserves it at construction (reserve_split_scratch: the most rows a
call takes over its window's pieces), before any graph is captured; captured graphs and eager calls then
take views of it (split_buffers). It never shrinks; a larger reservation replaces it and keeps the old one
alive for graphs captured on it.
No torch op here touches Triton, so the workers' memory plans import it on any machine."""

from __future__ import annotations

import torch


def split_scratch(rows: int, nh: int, ns: int, d: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The fp32 partials attention_rows allocates a call: acc [rows, nh, ns, d] and (max, sum) [rows, nh, ns, 2],
    ns = the page table's width (the window's pieces, not the rows' positions): a captured graph's pool holds
    them, so a long window's scratch (~3 GB at 320 rows of the 9B over 150K tokens) is one buffer a device
    (reserve_split_scratch), counted in the KV sizing (baton/engine/pages.py: attention_scratch_bytes_of)."""
    return (rows, nh, ns, d), (rows, nh, ns, 2)


def split_scratch_bytes(rows: int, nh: int, ns: int, d: int) -> int:
    """Bytes of split_scratch's two fp32 buffers."""
    return sum(4 * a * b * c * e for a, b, c, e in split_scratch(rows, nh, ns, d))


# CUDA: one fp32 scratch a device, reserved by the runners (reserve_split_scratch) and shared by every call,
# eager and captured. Without it each captured graph kept partials sized by its own rows in the shared pool
# (a prefill worker over a 131,072-token window on an H100 ran out of memory with 11.4 GB in graph pools,
# 2026-12-07), where one buffer takes 2.7 GB. Sharing is safe because a worker launches every attention call
# under its engine's one compute lock, on the device's one compute stream, in order (the hand-off's streams
# copy state and pages only); the CPU allocates a call's own (there kernels run in the calling thread).
_SCRATCH: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # smaller buffers a grown one replaced: graphs captured on them still read them


def reserve_split_scratch(device, rows: int, nh: int, ns: int, d: int) -> None:
    """Lifecycle: a CUDA runner calls this at construction, before any capture, for the most rows a call of
    its takes (fused_blocks.MAX_ROWS) over its window's ns pieces; the buffer only grows (a larger window or
    more heads in the same process). CPU: nothing."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    need = split_scratch_bytes(rows, nh, ns, d) // 4
    held = _SCRATCH.get(dev)
    if held is None or held.numel() < need:
        if held is not None:
            _RETIRED.append(held)
        _SCRATCH[dev] = torch.empty(need, dtype=torch.float32, device=dev)


def split_buffers(rows: int, nh: int, ns: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """acc, ml of a call: views of the device's reserved scratch when it holds them, else their own."""
    (acc_shape, ml_shape) = split_scratch(rows, nh, ns, d)
    buf = _SCRATCH.get(device) if device.type == "cuda" else None
    n_acc, n_ml = rows * nh * ns * d, rows * nh * ns * 2
    if buf is None or buf.numel() < n_acc + n_ml:
        return tuple(torch.empty(shape, dtype=torch.float32, device=device) for shape in (acc_shape, ml_shape))
    return buf[:n_acc].view(acc_shape), buf[n_acc : n_acc + n_ml].view(ml_shape)
