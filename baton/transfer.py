"""Small host <-> device copies (index lists, token ids, page ids, per-slot scalars) with the fewest syncs.

    upload(values, dtype, device)   -> a tensor of `values` on `device`, without a host sync
    to_device(t, device)            -> a host tensor's copy on `device`, without a host sync
    read_slots(t, slots)            -> [t[s] for s in slots] in one host read
    write_slots(t, slots, values)   t[s] = v for each pair, in one copy, without a host sync

`torch.tensor(values, device=cuda)` copies through a blocking H2D copy: the host waits until the stream
has drained. A prefill pass made hundreds of them (per layer and per segment); each left the GPU idle
while the host, which is what bounds a prefill, caught up, and in a worker whose other threads want the
GIL and the driver, each wait also cost a wake-up. Here the values go into a pinned block of torch's
caching host allocator and are copied non-blocking: the allocator re-issues the block only once the
copy that read it has completed (its recorded event), so the caller may drop it at once.
On CPU the tensor is simply made there. The same holds for per-slot scalars (a session's position or next
token): `int(t[slot])` is a blocking D2H copy and `t[slot] = v` a blocking H2D one, each; a batched round
of 30 sessions made ~100 of them.
"""

from __future__ import annotations

import torch


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    dev = torch.device(device)
    if dev.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=dev)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(dev, non_blocking=True)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    dev = torch.device(device)
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def read_slots(t: torch.Tensor, slots: list[int]) -> list:
    """[t[s] for s in slots] as Python numbers, in one host read (t: a per-slot tensor, [S])."""
    if not slots:
        return []
    return t[upload(slots, torch.long, t.device)].tolist()


def write_slots(t: torch.Tensor, slots: list[int], values: list) -> None:
    """t[s] = v for each (s, v) (slots distinct), in one non-blocking copy and one kernel."""
    if len(slots) != len(values):
        raise ValueError(f"write_slots: {len(slots)} slots, {len(values)} values")
    if slots:
        t.index_copy_(0, upload(slots, torch.long, t.device), upload(values, t.dtype, t.device))
