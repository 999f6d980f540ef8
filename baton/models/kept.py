"""Tensors of the config or the weights alone, computed once and kept (the rotary inverse frequencies,
a GDN layer's -exp(A_log)): the same ops on the same inputs give the same bits, and a prefill pass launches
3 kernels fewer a GDN layer and 4 a rotary table: 108 of the 9B shape's ~1,540 (counted from the ops it
skips, not timed; each launch is a GIL hand-over when the worker is busy).

    kept(store, key, make)           make()'s tensor, kept in `store` under key
    weights_key(t)                   the key of a weight's values, None where it has none

Lifecycle: an entry lives as long as its store (a module's, or the process's for the config's): never
dropped, because a CUDA graph captured after it was kept reads its memory. A weight written in place bumps
its version, so its key changes and a new entry is made (a few bytes each). Nothing is kept while a CUDA
graph is captured (the kernels of make() would run only at replay), with autograd on, or for key None:
make() then runs inline, as before.
"""

from __future__ import annotations

import torch


def kept(store: dict, key, make) -> torch.Tensor:
    """make() (of the config or of weights named by `key`), kept in `store` once computed: the same ops, the
    same bits (module doc: the launches it saves). Not kept for key None, with autograd on
    (training: the result must keep its graph to the weights), nor while a CUDA graph is captured (its
    kernels run only at replay)."""
    got = store.get(key) if key is not None else None
    if got is None:
        got = make()
        capturing = got.is_cuda and torch.cuda.is_current_stream_capturing()
        if key is not None and not capturing and not torch.is_grad_enabled():
            store[key] = got  # NOTE: never dropped (module doc: a captured graph may read it)
    return got


def weights_key(t: torch.Tensor):
    """A weight's values' name: storage, version (every in-place write bumps it), device, dtype; None for
    an inference tensor (no version counter)."""
    try:
        return (t.data_ptr(), t._version, t.device, t.dtype)
    except RuntimeError:
        return None
