"""What a receiver expects of a state stream (ExpectedLayout of LayoutEntry) and what it gets back once
every byte verified (ReceivedState). Shared by the verifying decode (decode.py) and receive.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from baton.handoff.wire import _KV_KINDS, BridgeStats, TensorDesc, kind_value


@dataclass(frozen=True)
class LayoutEntry:
    kind: int
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None  # fixed shape; None for KV rows
    kv_dims: tuple[int, int] | None = None  # (kv_heads, head_dim) -> shape [kv_heads, position, head_dim]

    def shape_at(self, position: int) -> tuple[int, ...]:
        return self.shape if self.shape is not None else (self.kv_dims[0], position, self.kv_dims[1])


@dataclass(frozen=True)
class ExpectedLayout:
    """What the receiving engine accepts: each entry exactly once and nothing else.
    entries: name -> LayoutEntry or tuple (kind, dtype, fixed_shape | None, kv_dims | None);
    max_position: the window; a state with a larger position is refused."""

    entries: Mapping[str, LayoutEntry]
    max_position: int

    def __post_init__(self):
        norm = {}
        for name, e in self.entries.items():
            kind, dtype, shape, kv = e if isinstance(e, tuple) else (e.kind, e.dtype, e.shape, e.kv_dims)
            if (shape is None) == (kv is None):
                raise ValueError(f"{name}: give exactly one of a fixed shape or kv_dims")
            norm[name] = LayoutEntry(kind_value(kind), dtype, shape and tuple(shape), kv and tuple(kv))
        object.__setattr__(self, "entries", norm)

    @classmethod
    def from_tensors(cls, tensors: Iterable, max_position: int) -> ExpectedLayout:
        """From example tensors (.name, .kind, .tensor), e.g. HybridState.export(0, position=0):
        KV kinds take kv_dims from their [kv_heads, L, head_dim] shape, others their fixed shape."""
        entries = {}
        for t in tensors:
            k, s = kind_value(t.kind), tuple(t.tensor.shape)
            entries[t.name] = (
                (k, t.tensor.dtype, None, (s[0], s[2])) if k in _KV_KINDS else (k, t.tensor.dtype, s, None)
            )
        return cls(entries, max_position)


@dataclass(frozen=True)
class ReceivedState:
    session_id: str
    fingerprint: str
    position: int
    next_token: int  # from the trailer
    mode: int
    engine: int
    specs: tuple[TensorDesc, ...]  # table order
    tensors: dict[str, torch.Tensor]  # name -> verified CPU tensor
    stats: BridgeStats  # seconds: first chunk fed -> finish()
    marks: dict[str, int] = field(default_factory=dict)  # "last_chunk_fed", "verified": monotonic ns
    draft_only: bool = False  # the header's (StateHeader.draft_only): `tensors` holds policy.DRAFT_ONLY_NAMES alone
