"""Small host -> device copies (index lists, token ids, page ids) without a host sync.

    upload(values, dtype, device)   -> a tensor of `values` on `device`

`torch.tensor(values, device=cuda)` copies through a blocking H2D copy: the host waits until the stream
has drained. A prefill pass made hundreds of them (per layer and per segment); each left the GPU idle
while the host, which is what bounds a prefill, caught up, and in a worker whose other threads want the
GIL and the driver, each wait also cost a wake-up. Here the values go into a pinned block of torch's
caching host allocator and are copied non-blocking: the allocator re-issues the block only once the
copy that read it has completed (its recorded event), so the caller may drop it at once.
On CPU the tensor is simply made there.
"""

from __future__ import annotations

import torch


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    dev = torch.device(device)
    if dev.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=dev)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(dev, non_blocking=True)
