"""What one forward pass computes: `StepContext` (rows or prefill), its row groups and prefill segments,
and the switch for the row-invariant wide kernels.

Rows mode (`width == W`): see baton/models/qwen3_5.py. Prefill (`width is None`) runs the prompt rows
of one or more sessions in one pass (issue 20, batched prefill): `segments` lists them, each a slot's
prompt piece [start, start + n) at rows [off, off + n) of the pass. Per-row ops (GEMMs, norms, MLP,
RoPE, gates) run through `map`; each segment's mixer (GDN conv + chunked delta rule against its own
state, attention against its own KV) runs on its own rows, the call a pass of that segment alone makes.

Batch invariance of the prefill (a session's state does not depend on which other prompts shared its
pass): on CUDA, `wide_prefill` switches the per-row ops onto baton/kernels/wide.py (one configuration
for every M: cuBLAS and torch's reductions pick theirs by the row count), so `map` runs them once on
all rows. Elsewhere (CPU), `map` calls them once per segment, which is the call of the segment alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from baton.transfer import upload

_WIDE: contextvars.ContextVar = contextvars.ContextVar("baton_wide_kernels", default=None)


def wide_kernels():
    """baton.kernels.wide inside `wide_prefill` on CUDA, else None."""
    return _WIDE.get()


@contextlib.contextmanager
def wide_prefill(device: torch.device):
    """The block's per-row ops use the row-invariant wide kernels when `device` is CUDA (the prefill)."""
    mod = None
    if torch.device(device).type == "cuda":
        from baton.kernels import wide as mod
    tok = _WIDE.set(mod)
    try:
        yield
    finally:
        _WIDE.reset(tok)


def lin(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """mod(x), through the row-invariant GEMM for a plain bf16 nn.Linear inside `wide_prefill`."""
    k = _WIDE.get()
    if k is not None and type(mod) is nn.Linear and mod.bias is None and x.dtype == mod.weight.dtype:
        return k.linear(x, mod.weight)
    return mod(x)


@dataclass(frozen=True)
class RowGroup:
    """One slot's rows inside a batched rows step: rows [off, off + n) of the flattened rows."""

    slot: int
    n: int
    off: int


@dataclass(frozen=True)
class Segment:
    """One slot's prompt piece inside a prefill pass: positions [start, start + n) at rows [off, off + n)."""

    slot: int
    start: int
    n: int
    off: int


class PassIndex:
    """The int64 index tensors of one prefill pass's segments, on its device: built on the host once per
    pass and copied without a host sync (baton/transfer.py), then shared by every layer. A prefill pass is
    launch-bound; a blocking H2D copy per layer (and per segment) drained the stream each time, and in a
    worker whose other threads (hand-off stagers, gRPC) also want the GIL and the driver each drain
    cost a wake-up. Lifecycle: made by StepContext.pass_index() on first use; dropped with the context.

        slots    [N]      each segment's slot
        cu       [N + 1]  cumulative row offsets (cu_cpu: the same on the host)
        pos      [T]      each row's position (start .. start + n - 1 per segment)
        row_slot [T]      each row's slot
        ints(key, make)   any other pass constant: make() -> list of ints, copied once and kept by key
    """

    def __init__(self, segments, device):
        self.segments, self.device = tuple(segments), torch.device(device)
        self.cu_cpu = torch.tensor([0, *itertools.accumulate(s.n for s in self.segments)], dtype=torch.long)
        self._kept: dict = {}

    def ints(self, key, make: Callable[[], list[int]]) -> torch.Tensor:
        t = self._kept.get(key)
        if t is None:
            t = self._kept[key] = upload(make(), torch.long, self.device)
        return t

    @property
    def slots(self) -> torch.Tensor:
        return self.ints("slots", lambda: [s.slot for s in self.segments])

    @property
    def cu(self) -> torch.Tensor:
        return self.ints("cu", self.cu_cpu.tolist)

    @property
    def pos(self) -> torch.Tensor:
        return self.ints("pos", lambda: [p for s in self.segments for p in range(s.start, s.start + s.n)])

    @property
    def row_slot(self) -> torch.Tensor:
        return self.ints("row_slot", lambda: [s.slot for s in self.segments for _ in range(s.n)])


@dataclass(frozen=True)
class StepContext:
    slot: int = 0
    width: int | None = None  # None = prefill (wide kernels); W = fixed-width rows mode
    n: int = 1  # valid rows in rows mode (n <= width); prefill: len(ids)
    start: int = 0  # prefill only: position of ids[0] (host int)
    rope_offset: int = 0  # RoPE position = KV index + rope_offset (the MTP layer uses 1)
    on_layer: Callable[[int], None] | None = None  # prefill streaming: called with i once layer i's
    # state writes are enqueued (its KV rows / GDN conv
    # and recurrent state; before its MLP); never a
    # host sync (see baton/handoff/progress.py)
    phase: int | None = None  # rows only: ping-pong AR step (HybridState.gdn_io); None = GDN state in place
    groups: tuple[RowGroup, ...] | None = None  # batched rows (eager only); None = one group (slot, n, 0)
    segments: tuple[Segment, ...] | None = None  # batched prefill; None = one segment (slot, start, n, 0)
    index: PassIndex | None = field(default=None, compare=False)  # prefill: pass_index(), made on first use

    def row_groups(self) -> tuple[RowGroup, ...]:
        """Rows mode: the slots' row groups (the one-slot step is one group at offset 0)."""
        return self.groups if self.groups is not None else (RowGroup(self.slot, self.n, 0),)

    def prefill_segments(self) -> tuple[Segment, ...]:
        """Prefill: the pass's segments (one pass of one prompt is one segment at offset 0)."""
        return self.segments if self.segments is not None else (Segment(self.slot, self.start, self.n, 0),)

    def pass_index(self, device) -> PassIndex:
        """Prefill: the pass's device index tensors (PassIndex), made once per context."""
        if self.index is None:
            object.__setattr__(self, "index", PassIndex(self.prefill_segments(), device))  # frozen: lazily, once
        return self.index

    def map(self, fn, *ts: torch.Tensor):
        """fn applied to the per-row op inputs ts (dim 0 = rows) -> fn's tensor or tuple of tensors.
        Rows mode: fn runs on every chunk of W rows (the one-slot step's [W, ...] shape). Prefill: one
        call on all rows with the wide kernels on (or one segment); else one call per segment."""
        T = ts[0].shape[0]
        if self.width is None:
            segs = self.prefill_segments()
            if len(segs) == 1 or _WIDE.get() is not None:
                return fn(*ts)
            outs = [fn(*(t[s.off : s.off + s.n] for t in ts)) for s in segs]
        elif T == self.width:
            return fn(*ts)
        else:
            W = self.width
            outs = [fn(*(t[c : c + W] for t in ts)) for c in range(0, T, W)]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs))
        return torch.cat(outs)

    def group_rows(self, t: torch.Tensor, grp: RowGroup) -> torch.Tensor:
        """Rows [off, off+n) of t as a [W, ...] tensor at rows [0, n) (the one-slot step's own tensor
        when t is one chunk and grp is at offset 0; rows >= n are never read by a valid row)."""
        W = self.width
        if grp.off == 0 and t.shape[0] == W:
            return t
        out = torch.zeros((W,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        out[: grp.n] = t[grp.off : grp.off + grp.n]
        return out

    def state_written(self, layer: int) -> None:
        """Prefill streaming: layer `layer`'s state is final once the work enqueued so far has run (the
        rest of the layer, o_proj and the MLP, reads it but writes none), so its hand-off can start."""
        if self.on_layer is not None:
            self.on_layer(layer)
