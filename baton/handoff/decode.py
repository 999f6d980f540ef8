"""State wire format, receiving side: validate the header, verify and place each chunk, verify the manifest.

StateReceiver(expected, fingerprint=, max_total_bytes=); feed(chunk) per message; finish(). The header
is validated before anything is allocated, its chunk plan (wire.ChunkPlan) strictly. Each data chunk's
index and size are checked on arrival (in order, exact sizes from the plan); the pool then verifies its
SHA-256 and copies it into the per-tensor CPU buffers (numpy copies: no GIL) while later chunks arrive,
at most 2 * workers + 2 chunks in flight. The trailer is checked after every chunk verified: counts, then
the manifest over the header and the chunk digests in order. finish() returns a ReceivedState only when
all of that passed (see baton/handoff/wire.py for the stream layout); any failure waits for the pool's copies,
then drops every buffer. ReceivedState.marks: time.monotonic_ns() when the last data chunk was fed
("last_chunk_fed") and when the trailer verified ("verified"), for the hand-off's timeline (baton/handoff/timeline.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import hmac
import time
from typing import Callable, Iterable

import numpy as np
import torch

from baton.handoff import wire as _wire  # read at call time: tests patch PARALLEL_MIN_BYTES
from baton.handoff.frames import DIGEST_BYTES, Manifest
from baton.handoff.layout import ExpectedLayout, ReceivedState
from baton.handoff.wire import (
    _FROM_PB,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    MAX_DATA_CHUNKS,
    READ_VERSIONS,
    BridgeStats,
    ChunkPlan,
    StateCorrupt,
    StateError,
    StateInvalid,
    StateMismatch,
    TensorDesc,
    _data_frame,
    _pool,
    byte_view,
    default_workers,
    pipelined,
)
from baton.v1 import state_pb2


class StateReceiver:
    """One stream: header -> data ... -> trailer (verified) -> finish(). Any StateError waits for the
    pool's work on this stream, drops the buffers and leaves the receiver failed. `alloc(shape, dtype)`
    may supply the CPU buffers (pinned or reused memory); it is called only after the header passed
    validation. `workers`: chunks verified in parallel (None: wire.default_workers(), 0: inline).
    `on_tensor(name, buffer)`: called on the feeding thread, in table order, as soon as every chunk
    holding that tensor's bytes verified, so the caller can move it on (H2D into a reserved slot)
    while later chunks arrive; it must activate nothing before finish() returns."""

    def __init__(
        self,
        expected: ExpectedLayout,
        *,
        fingerprint: str,
        max_total_bytes: int,
        alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        workers: int | None = None,
        on_tensor: Callable[[str, torch.Tensor], None] | None = None,
    ):
        self.expected, self.fingerprint, self.max_total_bytes = expected, fingerprint, max_total_bytes
        self._alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self._on_tensor = on_tensor
        self._ready_at: list[int] = []  # per table row: verified chunks needed before on_tensor
        self._announced = 0  # table rows handed to on_tensor so far
        self._workers = default_workers() if workers is None else workers
        self._header, self._specs, self._trailer = None, [], None
        self._tensors: dict[str, torch.Tensor] = {}
        self._arrays: list[np.ndarray] = []  # flat uint8 views of the buffers, table order
        self._cursor = (0, 0)  # (tensor index, byte offset within it)
        self._inflight: collections.deque = collections.deque()  # pool futures, chunk order
        self._manifest: Manifest | None = None
        self._total = self._expected_chunks = self.received = self.chunks = 0
        self._plan: ChunkPlan | None = None
        self._t0: float | None = None
        self._done = self._closed = False  # trailer verified / failed or finished
        self.marks: dict[str, int] = {}  # monotonic ns: the last data chunk fed, the trailer verified

    def feed(self, chunk: state_pb2.StateChunk | bytes) -> None:
        """The next message of the stream: a StateChunk or its serialized bytes."""
        self._t0 = self._t0 or time.perf_counter()
        try:
            if self._closed:
                raise StateCorrupt("chunk fed to a receiver that already failed or finished")
            frame = None if isinstance(chunk, state_pb2.StateChunk) else _data_frame(chunk)
            if frame is not None:
                return self._on_data(*frame)
            if not isinstance(chunk, state_pb2.StateChunk):
                try:
                    chunk = state_pb2.StateChunk.FromString(bytes(chunk))
                except Exception as e:  # protobuf DecodeError
                    raise StateCorrupt(f"message after {self.chunks} data chunks: unparsable ({e})") from None
            part = chunk.WhichOneof("part")
            if part == "data":
                return self._on_data(memoryview(chunk.data), chunk.chunk_index, chunk.chunk_sha256)
            if chunk.chunk_index or chunk.chunk_sha256:
                raise StateCorrupt(f"chunk_index/chunk_sha256 set on a {part or 'empty'} message")
            if part == "header":
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
        if h.format_version not in READ_VERSIONS:
            raise StateMismatch(
                f"format_version {h.format_version}; this worker speaks {FORMAT_VERSION} "
                f"(and reads {', '.join(map(str, READ_VERSIONS))})"
            )
        if h.model_fingerprint != self.fingerprint:
            raise StateMismatch(f"model_fingerprint {h.model_fingerprint!r} != this worker's {self.fingerprint!r}")
        if h.position > lay.max_position:
            raise StateInvalid(f"position {h.position} exceeds the window max_position={lay.max_position}")
        if h.total_bytes > self.max_total_bytes:
            raise StateInvalid(f"total_bytes {h.total_bytes} exceeds the limit {self.max_total_bytes}")
        if not 0 < h.chunk_bytes <= MAX_CHUNK_BYTES:  # NOTE: the rest of the plan: _check_plan
            raise StateInvalid(f"chunk_bytes {h.chunk_bytes} not in 1..{MAX_CHUNK_BYTES}")
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
        plan = _check_plan(h)
        # NOTE: allocation only after every size above is validated and bounded by max_total_bytes.
        for d in specs.values():
            t = self._alloc(d.shape, d.dtype)
            if t.dtype != d.dtype or tuple(t.shape) != d.shape or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"alloc returned {t.dtype} {tuple(t.shape)} on {t.device} for {d.name}")
            self._tensors[d.name] = t
            self._arrays.append(np.asarray(byte_view(t)))
        self._header, self._specs, self._total = h, list(specs.values()), total
        self._plan, self._expected_chunks = plan, plan.count
        self._manifest = Manifest(h)
        end = 0
        for d in self._specs:  # the chunks covering bytes [0, end of this tensor)
            end += d.nbytes
            self._ready_at.append(plan.chunks_to(end))
        self._announce()

    def _on_data(self, mv: memoryview, index: int, digest: bytes) -> None:
        n, i = len(mv), self.chunks
        if self._header is None or self._done:
            raise StateCorrupt(f"data chunk {'before the header' if self._header is None else 'after the trailer'}")
        if i >= self._expected_chunks:
            raise StateCorrupt(
                f"data chunk {i}: more than the declared total_bytes {self._total} "
                f"({self._expected_chunks} chunks: {self._plan.describe()})"
            )
        if index != i:
            raise StateCorrupt(f"data chunk {i}: chunk_index {index} (chunks lost or out of order)")
        want = self._plan.span(i)[1]
        if n != want:
            raise StateCorrupt(
                f"data chunk {i}: {n} bytes, expected {want} "
                f"({'tail' if i >= self._plan.head_chunks else 'head'} segment; "
                f"{self._plan.describe()})"
            )
        if len(digest) != DIGEST_BYTES:
            raise StateCorrupt(f"data chunk {i}: chunk_sha256 has {len(digest)} bytes, expected {DIGEST_BYTES}")
        (ti, off), pos, spans = self._cursor, 0, []
        while pos < n:  # where this chunk's bytes go: [(dst array, dst offset, src offset, length)]
            dst = self._arrays[ti]
            take = min(len(dst) - off, n - pos)
            spans.append((dst, off, pos, take))
            pos, off = pos + take, off + take
            if off == len(dst):
                ti, off = ti + 1, 0
        self._cursor = (ti, off)
        self.received += n
        self.chunks += 1
        if self.chunks == self._expected_chunks:
            self.marks["last_chunk_fed"] = time.monotonic_ns()
        if self._workers > 0 and n >= _wire.PARALLEL_MIN_BYTES:
            self._inflight.append(_pool().submit(_verify_and_place, i, mv, digest, spans))
            self._settle(keep=2 * self._workers + 2)
        else:
            self._settle(keep=0)
            self._manifest.add(_verify_and_place(i, mv, digest, spans))
            self._announce()

    def _settle(self, keep: int) -> None:
        """Collects finished chunk verifications in order (waiting while more than `keep` are in flight);
        the first failed chunk raises its StateCorrupt."""
        q = self._inflight
        while q and (len(q) > keep or q[0].done()):
            self._manifest.add(q.popleft().result())
        self._announce()

    def _announce(self) -> None:
        """on_tensor(name, buffer) for each tensor, in table order, once all its chunks verified and were
        placed (the buffer is final; the stream as a whole is not verified yet: see finish())."""
        if self._on_tensor is None:
            return
        while self._announced < len(self._specs) and self._ready_at[self._announced] <= self._manifest.chunks:
            d = self._specs[self._announced]
            self._announced += 1
            self._on_tensor(d.name, self._tensors[d.name])

    def _on_trailer(self, tr) -> None:
        if self._header is None or self._done:
            raise StateCorrupt(f"trailer {'before the header' if self._header is None else 'repeated'}")
        if self.received != self._total:
            raise StateCorrupt(f"truncated: trailer after {self.received} of {self._total} bytes")
        self._settle(keep=0)
        if tr.total_bytes != self._total:
            raise StateCorrupt(f"trailer total_bytes {tr.total_bytes} != header total_bytes {self._total}")
        if tr.data_chunks != self.chunks:
            raise StateCorrupt(f"trailer data_chunks {tr.data_chunks} != {self.chunks} received")
        if not hmac.compare_digest(tr.manifest_sha256, self._manifest.digest(tr)):
            raise StateCorrupt(
                "manifest_sha256 mismatch: the header, the chunk list or the trailer was altered in transit"
            )
        self._trailer, self._done = tr, True
        self.marks["verified"] = time.monotonic_ns()

    def finish(self) -> ReceivedState:
        """The verified state; StateCorrupt if the stream ended early."""
        try:
            if self._closed:
                raise StateCorrupt("finish() on a receiver that already failed or finished")
            if self._header is None:
                raise StateCorrupt("stream ended without a header")
            if not self._done:
                raise StateCorrupt(
                    f"stream ended before the trailer: {self.received} of "
                    f"{self._total} bytes in {self.chunks} data chunks"
                )
        except StateError:
            self._fail()
            raise
        h, tensors, self._closed = self._header, self._tensors, True
        self._tensors, self._arrays = {}, []
        stats = BridgeStats.from_specs(
            self._specs, tokens=h.position, chunks=self.chunks, seconds=time.perf_counter() - self._t0
        )
        return ReceivedState(
            h.session_id,
            h.model_fingerprint,
            h.position,
            self._trailer.next_token,
            h.mode,
            h.engine,
            tuple(self._specs),
            tensors,
            stats,
            dict(self.marks),
        )

    def abort(self) -> None:
        """Ends the stream unverified (the caller stopped feeding it: cancelled, error): as a failure."""
        if not self._closed:
            self._fail()

    def _fail(self) -> None:
        self._closed = True
        for f in self._inflight:
            f.cancel()
        # NOTE: wait for copies already running: the buffers may be the caller's (alloc) and reused
        concurrent.futures.wait(self._inflight)
        self._inflight.clear()
        self._tensors, self._arrays = {}, []  # NOTE: drop every partial buffer


def _check_plan(h) -> ChunkPlan:
    """The header's chunk plan (chunk_bytes, tail_from, tail_chunk_bytes), strictly valid, else StateInvalid;
    chunk_bytes' range and total_bytes (against the table) are already checked."""
    cb, tail, tcb, total = h.chunk_bytes, h.tail_from, h.tail_chunk_bytes, h.total_bytes
    if h.format_version < 4 and (tail or tcb):
        raise StateInvalid(
            f"tail_from {tail} / tail_chunk_bytes {tcb} in a format_version {h.format_version} "
            f"header (a tail segment is format 4)"
        )
    if tcb == 0 and tail != 0:
        raise StateInvalid(f"tail_from {tail} without a tail segment (tail_chunk_bytes 0): must be 0")
    if tcb > cb:
        raise StateInvalid(f"tail_chunk_bytes {tcb} not in 1..chunk_bytes {cb}")
    if tail % cb:
        raise StateInvalid(f"tail_from {tail} is not a multiple of chunk_bytes {cb}")
    if tail > total:
        raise StateInvalid(f"tail_from {tail} exceeds total_bytes {total}")
    plan = ChunkPlan(total, cb, tail, tcb)
    if plan.count > MAX_DATA_CHUNKS:
        raise StateInvalid(f"{plan.count} data chunks ({plan.describe()}): more than chunk_index can number")
    return plan


def _verify_and_place(index: int, mv: memoryview, digest: bytes, spans: list) -> bytes:
    """Pool task for one data chunk: SHA-256 (no GIL), compare, then copy into its spans (numpy: no GIL)."""
    got = hashlib.sha256(mv).digest()
    if not hmac.compare_digest(got, digest):
        raise StateCorrupt(f"data chunk {index}: chunk_sha256 mismatch: tensor bytes corrupted in transit")
    src = np.frombuffer(mv, dtype=np.uint8)
    for dst, off, pos, take in spans:
        np.copyto(dst[off : off + take], src[pos : pos + take])
    return got


def decode_stream(
    chunks: Iterable[state_pb2.StateChunk | bytes],
    expected: ExpectedLayout,
    fingerprint: str,
    max_total_bytes: int,
    *,
    alloc=None,
    ahead: int = 2,
    workers: int | None = None,
    on_tensor=None,
) -> ReceivedState:
    """Feeds a whole stream through a StateReceiver; returns the verified state. With ahead > 0 the
    messages are pulled on a helper thread (pipelined), so receiving overlaps the receiver's own
    checks; the input is closed on return or failure, which also ends that thread."""
    rx = StateReceiver(
        expected,
        fingerprint=fingerprint,
        max_total_bytes=max_total_bytes,
        alloc=alloc,
        workers=workers,
        on_tensor=on_tensor,
    )
    it = pipelined(chunks, ahead) if ahead > 0 else iter(chunks)
    try:
        for c in it:
            rx.feed(c)
        return rx.finish()
    except BaseException:
        rx.abort()  # NOTE: e.g. the client cancelled mid-stream: no pool copy outlives this call
        raise
    finally:
        if hasattr(it, "close"):
            it.close()
