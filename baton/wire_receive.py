"""State wire format, receiving side: validate the header, fill preallocated buffers, verify the trailer.

StateReceiver(expected, fingerprint=, max_total_bytes=); feed(chunk) per message; finish() validates the
header before allocating anything, writes bytes straight into per-tensor CPU buffers, hashes as it goes,
and returns a ReceivedState only when everything verified (see baton/wire.py for the stream layout).
"""
from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from baton.v1 import state_pb2
from baton.wire import (BridgeStats, FORMAT_VERSION, MAX_CHUNK_BYTES, StateCorrupt, StateError, StateInvalid, StateMismatch, TensorDesc, _FROM_PB, _KV_KINDS, _data_frame, byte_view, kind_value, pipelined)


@dataclass(frozen=True)
class LayoutEntry:
    kind: int
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None    # fixed shape; None for KV rows
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
            entries[t.name] = (k, t.tensor.dtype, None, (s[0], s[2])) if k in _KV_KINDS else (k, t.tensor.dtype, s, None)
        return cls(entries, max_position)


@dataclass(frozen=True)
class ReceivedState:
    session_id: str
    fingerprint: str
    position: int
    next_token: int
    mode: int
    engine: int
    specs: tuple[TensorDesc, ...]     # table order
    tensors: dict[str, torch.Tensor]  # name -> verified CPU tensor
    stats: BridgeStats                # seconds: first chunk fed -> finish()


class StateReceiver:
    """One stream: header -> data ... -> trailer (verified) -> finish(). Any StateError drops the
    buffers and leaves the receiver failed. `alloc(shape, dtype)` may supply the CPU buffers
    (pinned or reused memory); it is called only after the header passed validation."""

    def __init__(self, expected: ExpectedLayout, *, fingerprint: str, max_total_bytes: int,
                 alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None):
        self.expected, self.fingerprint, self.max_total_bytes = expected, fingerprint, max_total_bytes
        self._alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self._header, self._specs = None, []
        self._tensors: dict[str, torch.Tensor] = {}
        self._views: list[memoryview] = []  # uint8 views of the buffers, table order
        self._cursor = (0, 0)               # (tensor index, byte offset within it)
        self._digest = hashlib.sha256()
        self._total = self.received = self.chunks = 0
        self._t0: float | None = None
        self._done = self._closed = False   # trailer verified / failed or finished

    def feed(self, chunk: state_pb2.StateChunk | bytes) -> None:
        """The next message of the stream: a StateChunk or its serialized bytes."""
        self._t0 = self._t0 or time.perf_counter()
        try:
            if self._closed:
                raise StateCorrupt("chunk fed to a receiver that already failed or finished")
            data = None if isinstance(chunk, state_pb2.StateChunk) else _data_frame(chunk)
            if data is not None:
                return self._on_data(data)
            if not isinstance(chunk, state_pb2.StateChunk):
                try:
                    chunk = state_pb2.StateChunk.FromString(bytes(chunk))
                except Exception as e:  # protobuf DecodeError
                    raise StateCorrupt(f"message after {self.chunks} data chunks: unparsable ({e})") from None
            part = chunk.WhichOneof("part")
            if part == "data":
                self._on_data(memoryview(chunk.data))
            elif part == "header":
                self._on_header(chunk.header)
            elif part == "trailer":
                self._on_trailer(chunk.trailer)
            else:
                raise StateCorrupt("a StateChunk with no part set")
        except StateError:
            self._fail()
            raise

    def _on_header(self, h) -> None:
        lay = self.expected
        if self._header is not None:
            raise StateCorrupt("a second header")
        if h.format_version != FORMAT_VERSION:
            raise StateMismatch(f"format_version {h.format_version}; this worker speaks {FORMAT_VERSION}")
        if h.model_fingerprint != self.fingerprint:
            raise StateMismatch(f"model_fingerprint {h.model_fingerprint!r} != this worker's {self.fingerprint!r}")
        if h.position > lay.max_position:
            raise StateInvalid(f"position {h.position} exceeds the window max_position={lay.max_position}")
        if h.total_bytes > self.max_total_bytes:
            raise StateInvalid(f"total_bytes {h.total_bytes} exceeds the limit {self.max_total_bytes}")
        specs: dict[str, TensorDesc] = {}
        for i, s in enumerate(h.tensors):
            where, e = f"tensors[{i}] {s.name!r}", lay.entries.get(s.name)
            if e is None or s.name in specs:
                raise StateInvalid(f"{where}: {'unknown' if e is None else 'duplicate'} tensor name")
            if s.kind != e.kind:
                raise StateInvalid(f"{where}: kind {s.kind}, expected {e.kind}")
            if _FROM_PB.get(s.dtype) != e.dtype:
                raise StateInvalid(f"{where}: dtype {s.dtype}, expected {e.dtype}")
            if tuple(s.shape) != e.shape_at(h.position):
                raise StateInvalid(f"{where}: shape {list(s.shape)}, expected {list(e.shape_at(h.position))}")
            specs[s.name] = d = TensorDesc(s.name, s.kind, e.dtype, tuple(s.shape))
            if s.nbytes != d.nbytes:
                raise StateInvalid(f"{where}: nbytes {s.nbytes} != prod(shape)*itemsize {d.nbytes}")
        missing = sorted(set(lay.entries) - set(specs))
        if missing:
            raise StateInvalid(f"tensors: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        total = sum(d.nbytes for d in specs.values())
        if h.total_bytes != total:
            raise StateInvalid(f"total_bytes {h.total_bytes} != sum of tensors[].nbytes {total}")
        # NOTE: allocation only after every size above is validated and bounded by max_total_bytes.
        for d in specs.values():
            t = self._alloc(d.shape, d.dtype)
            if t.dtype != d.dtype or tuple(t.shape) != d.shape or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"alloc returned {t.dtype} {tuple(t.shape)} on {t.device} for {d.name}")
            self._tensors[d.name] = t
            self._views.append(byte_view(t))
        self._header, self._specs, self._total = h, list(specs.values()), total

    def _on_data(self, mv: memoryview) -> None:
        n = len(mv)
        if self._header is None or self._done:
            raise StateCorrupt(f"data chunk {'before the header' if self._header is None else 'after the trailer'}")
        if not 0 < n <= MAX_CHUNK_BYTES:
            raise StateCorrupt(f"data chunk {self.chunks}: {n} bytes (allowed 1..{MAX_CHUNK_BYTES})")
        if self.received + n > self._total:
            raise StateCorrupt(f"data chunk {self.chunks}: {self.received + n} bytes, more than the "
                               f"declared total_bytes {self._total}")
        self._digest.update(mv)  # NOTE: releases the GIL; the copy below then reads cache-hot bytes
        (ti, off), pos = self._cursor, 0
        while pos < n:
            dst = self._views[ti]
            take = min(len(dst) - off, n - pos)
            dst[off:off + take] = mv[pos:pos + take]
            pos, off = pos + take, off + take
            if off == len(dst):
                ti, off = ti + 1, 0
        self._cursor = (ti, off)
        self.received += n
        self.chunks += 1

    def _on_trailer(self, tr) -> None:
        if self._header is None or self._done:
            raise StateCorrupt(f"trailer {'before the header' if self._header is None else 'repeated'}")
        if self.received != self._total:
            raise StateCorrupt(f"truncated: trailer after {self.received} of {self._total} bytes")
        if tr.total_bytes != self._total:
            raise StateCorrupt(f"trailer total_bytes {tr.total_bytes} != header total_bytes {self._total}")
        if tr.data_chunks != self.chunks:
            raise StateCorrupt(f"trailer data_chunks {tr.data_chunks} != {self.chunks} received")
        if not hmac.compare_digest(tr.sha256, self._digest.digest()):
            raise StateCorrupt("sha256 mismatch: tensor bytes corrupted in transit")
        self._done = True

    def finish(self) -> ReceivedState:
        """The verified state; StateCorrupt if the stream ended early."""
        try:
            if self._closed:
                raise StateCorrupt("finish() on a receiver that already failed or finished")
            if self._header is None:
                raise StateCorrupt("stream ended without a header")
            if not self._done:
                raise StateCorrupt(f"stream ended before the trailer: {self.received} of "
                                   f"{self._total} bytes in {self.chunks} data chunks")
        except StateError:
            self._fail()
            raise
        h, tensors, self._closed = self._header, self._tensors, True
        self._tensors, self._views = {}, []
        stats = BridgeStats.from_specs(self._specs, tokens=h.position, chunks=self.chunks,
                                       seconds=time.perf_counter() - self._t0)
        return ReceivedState(h.session_id, h.model_fingerprint, h.position, h.next_token, h.mode,
                             h.engine, tuple(self._specs), tensors, stats)

    def _fail(self) -> None:
        self._closed = True
        self._tensors, self._views = {}, []  # NOTE: drop every partial buffer


def decode_stream(chunks: Iterable[state_pb2.StateChunk | bytes], expected: ExpectedLayout,
                  fingerprint: str, max_total_bytes: int, *, alloc=None, ahead: int = 2) -> ReceivedState:
    """Feeds a whole stream through a StateReceiver; returns the verified state. With ahead > 0 the
    messages are pulled on a helper thread (pipelined) so receiving overlaps hashing and copying;
    the input is closed on return or failure, which also ends that thread."""
    rx = StateReceiver(expected, fingerprint=fingerprint, max_total_bytes=max_total_bytes, alloc=alloc)
    it = pipelined(chunks, ahead) if ahead > 0 else iter(chunks)
    try:
        for c in it:
            rx.feed(c)
        return rx.finish()
    finally:
        if hasattr(it, "close"):
            it.close()
