"""State wire format, sending side: tensors -> header, sealed data chunks, trailer (see baton/handoff/wire.py).

Stages of one stream, each on its own thread so that throughput approaches the slowest one:
    producer (a helper thread, wire.ordered_map; the consumer's own thread for CPU tensors given up
        front, which never block)  cuts the tensors into chunks: a CPU chunk is a list of
        memoryview pieces of tensor memory (no copy); a chunk with CUDA bytes is staged D2H into a reused
        pinned buffer on the copy stream, gated on each tensor's ready event (baton/handoff/staging.py); it
        submits each chunk to the pool, up to `workers + 2` ahead of the consumer
    pool (wire.default_workers() threads)  waits for a staged chunk's copy, frames it (frames.frame:
        the one host copy, into the bytes gRPC sends) and hashes the framed payload, then frees the
        staging buffer
    consumer (gRPC's request thread)  takes the frames in order and sends them.
GIL: the sender shares its process with a prefill that launches kernels from Python and so wants the
GIL all the time; each time one of these threads takes the GIL back it waits up to the switch interval
(5 ms) and then takes it from the prefill. So no pass over the bytes runs under the GIL here (numpy
copies, hashlib, an uninitialized frame), and a chunk re-acquires it as few times as it can (pieces + 1
in the pool). The one pass under the GIL left is gRPC's copy of each message into its own buffer;
benchmarks/gil_probe.py measures the stalls. baton/handoff/sender/process.py moves all of it but the staging
out of the prefill's process (plan() and chunk_segments() are shared with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from baton.handoff import staging
from baton.handoff import wire as _wire  # read at call time: tests patch PARALLEL_MIN_BYTES
from baton.handoff.frames import Manifest, _sha256, header_frame, trailer_frame
from baton.handoff.frames import frame as _frame
from baton.handoff.wire import (
    _TO_PB,
    DEFAULT_CHUNK_BYTES,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    ChunkPlan,
    TensorDesc,
    WireTensor,
    byte_view,
    default_workers,
    kind_value,
    ordered_map,
)
from baton.v1 import state_pb2


# ---- sender -------------------------------------------------------------------------------------
def _sources(specs: list[TensorDesc], source: Iterable, ready_now) -> Iterator[tuple[torch.Tensor, object]]:
    """(tensor, ready event | None) per table row, checked against the table. A source item is a
    tensor, or (tensor, ready): a CUDA event after which the tensor is final (None: final now)."""
    for spec, item in zip(specs, source, strict=True):
        t, ready = item if isinstance(item, tuple) else (item, None)
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name}: got {t.dtype} {tuple(t.shape)}, the table says {spec.dtype} {spec.shape}")
        if t.requires_grad:  # NOTE: only then: each torch call gives the GIL up beside the prefill's thread
            t = t.detach()
        if t.is_cuda:
            yield t, ready if ready is not None else ready_now(t.device)
        else:
            yield t.contiguous(), None  # no copy for a contiguous CPU tensor


def chunk_segments(specs: list[TensorDesc], source: Iterable, chunks: ChunkPlan, ready_now) -> Iterator:
    """(chunk index, segments) per data chunk, in order, pulling `source` only as its bytes are due;
    segments: [(tensor, ready event | None, byte start, byte end)] in chunk order, chunks.cap(index) in
    all (the last chunk of each segment may be short; a chunk may span tensors)."""
    segs, filled, index, cap = [], 0, 0, chunks.cap(0)
    for t, ready_ev in _sources(specs, source, ready_now):
        n, off = t.numel() * t.element_size(), 0
        while off < n:
            take = min(n - off, cap - filled)
            segs.append((t, ready_ev, off, off + take))
            filled, off = filled + take, off + take
            if filled == cap:  # NOTE: the head ends on a chunk boundary (tail_from: a multiple of chunk_bytes)
                yield index, segs
                segs, filled, index = [], 0, index + 1
                cap = chunks.cap(index)
    if segs:
        yield index, segs


def _chunk_parts(specs: list[TensorDesc], source: Iterable, chunks: ChunkPlan, ring_limit: int, ready_now):
    """(chunk index, part) per data chunk, in order; part = [memoryview pieces of CPU tensor memory]
    (no copy), or a StagedChunk when a CUDA tensor has bytes in it (D2H queued on the copy stream,
    gated on each tensor's ready event; this thread never waits for the device)."""
    ring = None

    def part(segs):
        nonlocal ring
        if not any(t.is_cuda for t, _, _, _ in segs):
            return [byte_view(t)[a:b] for t, _, a, b in segs]
        if ring is None:
            ring = staging.Ring(chunks.chunk_bytes, ring_limit)  # tail chunks fit: tail_chunk_bytes <= it
        return ring.stage(segs)

    pending = None  # (index, StagedChunk): its D2H queued, the next chunk's queued before waiting for it

    def ready(item):
        """Chunks in order; a staged chunk is handed on only once its copy is done (waited for here, one
        chunk behind the copies queued, so pool threads never sit on a device wait)."""
        nonlocal pending
        out = []
        if pending is not None:
            pending[1].done.synchronize()
            out.append(pending)
            pending = None
        if isinstance(item[1], staging.StagedChunk):
            pending = item
        else:
            out.append(item)
        return out

    for index, segs in chunk_segments(specs, source, chunks, ready_now):
        yield from ready((index, part(segs)))
    if pending is not None:
        pending[1].done.synchronize()
        yield pending


def _pieces(part) -> tuple[list, object]:
    """-> (memoryview pieces, release callable | None); waits for a staged chunk's D2H (no GIL)."""
    if isinstance(part, staging.StagedChunk):
        return [part.wait()], part.release
    return part, None


def _seal_message(index: int, part) -> tuple[state_pb2.StateChunk, bytes]:
    pieces, release = _pieces(part)
    try:
        d = _sha256(pieces)
        return state_pb2.StateChunk(data=b"".join(pieces), chunk_index=index, chunk_sha256=d), d
    finally:
        if release is not None:
            release()


def _seal_frame(index: int, part) -> tuple[bytes, bytes]:
    """The serialized data StateChunk, framed by hand: one copy out of tensor (or staging) memory,
    byte-identical to protobuf's serialization (fields in number order: data, chunk_index, chunk_sha256)."""
    pieces, release = _pieces(part)
    try:
        return _frame(index, pieces)
    finally:
        if release is not None:
            release()


@dataclass
class Plan:
    """One stream, checked and ready to go: its header (all known before the bytes), the table, where
    the tensors come from, and how the sender should run."""

    header: state_pb2.StateHeader
    chunks: ChunkPlan  # the header's chunk plan
    specs: list[TensorDesc]
    tensor_source: Iterable  # tensors, or (tensor, ready event), in table order
    next_token: object  # int, or a callable asked once every tensor was pulled
    workers: int  # chunks hashed in parallel (0: inline)
    lazy: bool  # the source may block (a running prefill) or needs D2H: its own thread
    ready_now: "_ReadyNow"

    def token(self) -> int:
        return int(self.next_token() if callable(self.next_token) else self.next_token)


def plan(
    *,
    session_id: str,
    fingerprint: str,
    position: int,
    next_token,
    tensors=None,
    specs=None,
    tensor_source=None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    mode: int = 0,
    engine: int = 0,
    workers: int | None = None,
    tail_from: int = 0,
    tail_chunk_bytes: int = 0,
    draft_only: bool = False,
) -> Plan:
    """Checks the arguments (encode_state's) and notes what "final now" means on the device (an event on
    the caller's current stream) at call time."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    if not 0 <= tail_chunk_bytes <= MAX_CHUNK_BYTES or tail_from < 0:
        raise ValueError(
            f"tail_chunk_bytes must be in 0..{MAX_CHUNK_BYTES} and tail_from >= 0, "
            f"got {tail_chunk_bytes} and {tail_from}"
        )
    lazy = tensors is None  # a source that may block (a running prefill) gets its own producer thread
    if tensors is not None and specs is None and tensor_source is None:
        tensors = list(tensors)
        specs, tensor_source = [TensorDesc.of(t) for t in tensors], [t.tensor for t in tensors]
        lazy = any(t.is_cuda for t in tensor_source)  # D2H staging: never on gRPC's thread
    elif tensors is not None or specs is None or tensor_source is None:
        raise ValueError("pass either tensors=, or specs= together with tensor_source=")
    specs = [TensorDesc(s.name, kind_value(s.kind), s.dtype, tuple(s.shape)) for s in specs]
    names = [s.name for s in specs]
    if "" in names or len(set(names)) != len(names):
        raise ValueError(f"tensor names must be unique and non-empty: {names}")
    bad = [(s.name, s.dtype) for s in specs if s.dtype not in _TO_PB]
    if bad:
        raise ValueError(f"unsupported dtypes {bad}; the wire carries float32, bfloat16, float16")
    total = sum(s.nbytes for s in specs)
    chunks = chunk_plan(total, chunk_bytes, tail_from, tail_chunk_bytes)
    header = state_pb2.StateHeader(
        format_version=FORMAT_VERSION,
        session_id=session_id,
        model_fingerprint=fingerprint,
        position=position,
        tensors=[s.to_proto() for s in specs],
        total_bytes=total,
        mode=mode,
        engine=engine,
        chunk_bytes=chunk_bytes,
        tail_from=chunks.tail_from,
        tail_chunk_bytes=chunks.tail_chunk_bytes,
        draft_only=draft_only,
    )
    workers = default_workers() if workers is None else workers
    if chunk_bytes < _wire.PARALLEL_MIN_BYTES:  # NOTE: small tail chunks still go through the pool (head's)
        workers = 0
    return Plan(header, chunks, specs, tensor_source, next_token, workers, lazy, _ReadyNow())


def chunk_plan(total: int, chunk_bytes: int, tail_from: int = 0, tail_chunk_bytes: int = 0) -> ChunkPlan:
    """The sender's plan: tail_from (any byte offset) rounded down to a multiple of chunk_bytes; no tail
    segment (0, 0) when tail_chunk_bytes is 0 or >= chunk_bytes (nothing smaller to gain) or the rounded
    tail_from leaves no bytes after it."""
    start = min(tail_from, total) // chunk_bytes * chunk_bytes
    if not 0 < tail_chunk_bytes < chunk_bytes or start >= total:
        return ChunkPlan(total, chunk_bytes)
    return ChunkPlan(total, chunk_bytes, start, tail_chunk_bytes)


def _parts(*, frames: bool = False, **kw) -> Iterator:
    """-> the header, each sealed data chunk, then the trailer (messages, or bytes with frames=True)."""
    return _stream(plan(**kw), frames)


class _ReadyNow:
    """device -> an event on the current stream, recorded when the encoder was called (the moment a
    tensor given without its own ready event must be final) for the current device, else on first use."""

    def __init__(self):
        self._events = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self(torch.device("cuda", torch.cuda.current_device()))

    def __call__(self, device: torch.device):
        ev = self._events.get(device.index)
        if ev is None:
            ev = self._events[device.index] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
        return ev


def _stream(p: Plan, frames: bool) -> Iterator:
    header = p.header
    yield header_frame(header) if frames else state_pb2.StateChunk(header=header)
    manifest = Manifest(header)
    seal = _seal_frame if frames else _seal_message
    parts = _chunk_parts(p.specs, p.tensor_source, p.chunks, p.workers + 4, p.ready_now)
    for item, digest in ordered_map(seal, parts, p.workers, producer_thread=p.lazy):
        manifest.add(digest)
        yield item
    last = trailer_frame(manifest, header.total_bytes, p.token())
    yield last if frames else state_pb2.StateChunk.FromString(last)


def encode_state(
    *,
    session_id: str,
    fingerprint: str,
    position: int,
    next_token: int | Callable[[], int],
    tensors: Iterable[WireTensor] | None = None,
    specs: Iterable[TensorDesc] | None = None,
    tensor_source: Iterable | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    mode: int = 0,
    engine: int = 0,
    workers: int | None = None,
    tail_from: int = 0,
    tail_chunk_bytes: int = 0,
    draft_only: bool = False,
) -> Iterator[state_pb2.StateChunk]:
    """Header, data chunks of <= chunk_bytes, trailer. tail_chunk_bytes > 0: bytes from tail_from (rounded
    down to a multiple of chunk_bytes) on go in chunks of tail_chunk_bytes (see chunk_plan). Give either `tensors` (all known now), or
    `specs` (the table) plus `tensor_source` yielding, in table order, each tensor or (tensor, ready):
    the header goes out first and each tensor is pulled only when its bytes are due (the source may
    block until it exists). `ready`: a CUDA event recorded once the tensor is final (the D2H copy
    waits for it on the device, never on the host); without one a CUDA tensor must be final on the
    caller's current stream when encode_state is called. `next_token` goes in the trailer: an int, or
    a callable asked once every tensor was pulled (prefill knows it only after the logits). `workers`: chunks hashed in parallel
    (None: default_workers(), 0: inline). draft_only: the header marks a draft-only state
    (StateHeader.draft_only; baton/handoff/policy.py: DRAFT_ONLY_NAMES). A tensor must not change until the
    stream ends."""
    return _parts(
        session_id=session_id,
        fingerprint=fingerprint,
        position=position,
        next_token=next_token,
        tensors=tensors,
        specs=specs,
        tensor_source=tensor_source,
        chunk_bytes=chunk_bytes,
        mode=mode,
        engine=engine,
        workers=workers,
        tail_from=tail_from,
        tail_chunk_bytes=tail_chunk_bytes,
        draft_only=draft_only,
    )


def encode_state_frames(**kw) -> Iterator[bytes]:
    """encode_state(**kw) with every StateChunk already serialized, for a channel method made with
    request_serializer=None. Data frames are framed by hand straight from tensor memory (one copy,
    no protobuf object) and are byte-identical to the serialized StateChunk."""
    return _parts(frames=True, **kw)
