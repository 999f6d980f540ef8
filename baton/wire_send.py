"""State wire format, sending side: tensors -> header, sealed data chunks, trailer (see baton/wire.py).

Stages of one stream, each on its own thread so that throughput approaches the slowest one:
    producer (a helper thread, wire.ordered_map; the consumer's own thread for CPU tensors given up
        front, which never block)  cuts the tensors into chunks: a CPU chunk is a list of
        memoryview pieces of tensor memory (no copy); a chunk with CUDA bytes is staged D2H into a reused
        pinned buffer on the copy stream, gated on each tensor's ready event (baton/wire_stage.py); it
        submits each chunk to the pool, up to `workers + 2` ahead of the consumer
    pool (wire.default_workers() threads)  waits for a staged chunk's copy, frames it (the one host copy,
        into the bytes gRPC sends) and hashes the framed payload, then frees the staging buffer
    consumer (gRPC's request thread)  takes the frames in order and sends them.
GIL: the sender shares its process with a prefill that launches kernels from Python and so wants the
GIL all the time; each time one of these threads takes the GIL back it waits up to the switch interval
(5 ms) and then takes it from the prefill. So no pass over the bytes runs under the GIL here (numpy
copies, hashlib, an uninitialized frame), and a chunk re-acquires it as few times as it can (pieces + 1
in the pool). The one pass under the GIL left is gRPC's copy of each message into its own buffer;
benchmarks/gil_probe.py measures the stalls.
"""
from __future__ import annotations

import ctypes
import hashlib
import io
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

import baton.wire as _wire  # NOTE: baton.wire imports this module last; its names all exist by then
from baton.v1 import state_pb2
from baton import wire_stage
from baton.wire import (DEFAULT_CHUNK_BYTES, DIGEST_BYTES, FORMAT_VERSION, MAX_CHUNK_BYTES, Manifest, TensorDesc, WireTensor, _DATA_TAG,
                        _INDEX_TAG, _SHA_TAG, _TO_PB, _varint, byte_view, default_workers, kind_value, ordered_map)

_COPY_OUTSIDE_GIL_BYTES = 256 << 10  # smaller frames are joined (under the GIL, but briefly)


def _sha256(pieces: list) -> bytes:
    h = hashlib.sha256()
    for p in pieces:
        h.update(p)  # NOTE: releases the GIL for pieces >= 2 KiB
    return h.digest()




# ---- sender -------------------------------------------------------------------------------------
def _sources(specs: list[TensorDesc], source: Iterable, ready_now) -> Iterator[tuple[torch.Tensor, object]]:
    """(tensor, ready event | None) per table row, checked against the table. A source item is a
    tensor, or (tensor, ready): a CUDA event after which the tensor is final (None: final now)."""
    for spec, item in zip(specs, source, strict=True):
        t, ready = item if isinstance(item, tuple) else (item, None)
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name}: got {t.dtype} {tuple(t.shape)}, the table says {spec.dtype} {spec.shape}")
        t = t.detach()
        if t.is_cuda:
            yield t, ready if ready is not None else ready_now(t.device)
        else:
            yield t.contiguous(), None   # no copy for a contiguous CPU tensor


def _chunk_parts(specs: list[TensorDesc], source: Iterable, chunk_bytes: int, ring_limit: int, ready_now):
    """(chunk index, part) per data chunk, in order; part = [memoryview pieces of CPU tensor memory]
    (no copy), or a StagedChunk when a CUDA tensor has bytes in it (D2H queued on the copy stream,
    gated on each tensor's ready event; this thread never waits for the device)."""
    ring = None
    segs, filled, index = [], 0, 0   # segs: (tensor, ready, byte start, byte end)

    def part():
        nonlocal ring
        if not any(t.is_cuda for t, _, _, _ in segs):
            return [byte_view(t)[a:b] for t, _, a, b in segs]
        if ring is None:
            ring = wire_stage.Ring(chunk_bytes, ring_limit)
        return ring.stage(segs)

    pending = None   # (index, StagedChunk): its D2H queued, the next chunk's queued before waiting for it

    def ready(item):
        """Chunks in order; a staged chunk is handed on only once its copy is done (waited for here, one
        chunk behind the copies queued, so pool threads never sit on a device wait)."""
        nonlocal pending
        out = []
        if pending is not None:
            pending[1].done.synchronize()
            out.append(pending)
            pending = None
        if isinstance(item[1], wire_stage.StagedChunk):
            pending = item
        else:
            out.append(item)
        return out

    for t, ready_ev in _sources(specs, source, ready_now):
        n, off = t.numel() * t.element_size(), 0
        while off < n:
            take = min(n - off, chunk_bytes - filled)
            segs.append((t, ready_ev, off, off + take))
            filled, off = filled + take, off + take
            if filled == chunk_bytes:
                yield from ready((index, part()))
                segs, filled, index = [], 0, index + 1
    if segs:
        yield from ready((index, part()))
    if pending is not None:
        pending[1].done.synchronize()
        yield pending


def _pieces(part) -> tuple[list, object]:
    """-> (memoryview pieces, release callable | None); waits for a staged chunk's D2H (no GIL)."""
    if isinstance(part, wire_stage.StagedChunk):
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


def _frame(index: int, pieces: list) -> tuple[bytes, bytes]:
    n = sum(map(len, pieces))
    head = _DATA_TAG + _varint(n)

    def tail(d: bytes) -> bytes:
        return (_INDEX_TAG + _varint(index) if index else b"") + _SHA_TAG + d
    if n < _COPY_OUTSIDE_GIL_BYTES:
        d = _sha256(pieces)
        return b"".join([head, *pieces, tail(d)]), d
    # NOTE: b"".join holds the GIL while copying memoryviews; instead the frame's bytes object is made
    # first and filled by numpy copies (no GIL) through a writable view that dies before it is handed on.
    # The digest is taken over the payload as copied into the frame, in one call: a chunk of k pieces
    # takes the GIL back k + 1 times (copies, hash), not 2k (each such re-acquisition waits up to the
    # switch interval while a prefill thread runs Python).
    size = len(head) + n + len(tail(b"\0" * DIGEST_BYTES))
    out, mv = _new_bytes(size) if _new_bytes is not None else _zeroed_bytesio(size)
    with mv:
        dst, off = np.frombuffer(mv, dtype=np.uint8), len(head)
        dst[:off] = np.frombuffer(head, dtype=np.uint8)
        for p in pieces:
            np.copyto(dst[off:off + len(p)], np.frombuffer(p, dtype=np.uint8))
            off += len(p)
        d = hashlib.sha256(mv[len(head):off]).digest()   # NOTE: releases the GIL (>= 2 KiB)
        dst[off:] = np.frombuffer(tail(d), dtype=np.uint8)
        del dst   # NOTE: before the view is released
    return (out.getvalue() if isinstance(out, io.BytesIO) else out), d


def _zeroed_bytesio(size: int) -> tuple[io.BytesIO, memoryview]:
    """(a BytesIO of `size` zero bytes, its buffer): one zero-filling pass under the GIL; once the buffer
    is released, getvalue() hands out the bytes object itself (CPython: no copy)."""
    buf = io.BytesIO()
    buf.seek(size - 1)
    buf.write(b"\0")
    return buf, buf.getbuffer()


def _new_bytes_capi(size: int) -> tuple[bytes, memoryview]:
    """(a new bytes object of `size` uninitialized bytes, a writable memoryview of them): the C API's
    PyBytes_FromStringAndSize(NULL, size), so no pass over the bytes under the GIL (the kernel's fresh
    pages are touched first by the fill). Filled before anyone else sees it (refcount 1, no hash yet)."""
    b = _PyBytes_FromStringAndSize(None, size)
    return b, memoryview((ctypes.c_char * size).from_address(_PyBytes_AsString(b))).cast("B")


try:   # CPython's C API through ctypes.pythonapi (those calls keep the GIL, as C API calls must)
    _PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
    _PyBytes_FromStringAndSize.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    _PyBytes_FromStringAndSize.restype = ctypes.py_object
    _PyBytes_AsString = ctypes.pythonapi.PyBytes_AsString
    _PyBytes_AsString.argtypes, _PyBytes_AsString.restype = [ctypes.py_object], ctypes.c_void_p
    _new_bytes = _new_bytes_capi
except (AttributeError, OSError):   # another Python: the zero-filled BytesIO
    _new_bytes = None


def _parts(*, session_id: str, fingerprint: str, position: int, next_token, tensors=None,
           specs=None, tensor_source=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, mode: int = 0,
           engine: int = 0, frames: bool = False, workers: int | None = None) -> Iterator:
    """Checks the arguments and notes what "final now" means on the device (an event on the caller's
    current stream) at call time; -> the header, each sealed data chunk, then the trailer (messages,
    or bytes with frames=True)."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    lazy = tensors is None   # a source that may block (a running prefill) gets its own producer thread
    if tensors is not None and specs is None and tensor_source is None:
        tensors = list(tensors)
        specs, tensor_source = [TensorDesc.of(t) for t in tensors], [t.tensor for t in tensors]
        lazy = any(t.is_cuda for t in tensor_source)   # D2H staging: never on gRPC's thread
    elif tensors is not None or specs is None or tensor_source is None:
        raise ValueError("pass either tensors=, or specs= together with tensor_source=")
    specs = [TensorDesc(s.name, kind_value(s.kind), s.dtype, tuple(s.shape)) for s in specs]
    names = [s.name for s in specs]
    if "" in names or len(set(names)) != len(names):
        raise ValueError(f"tensor names must be unique and non-empty: {names}")
    bad = [(s.name, s.dtype) for s in specs if s.dtype not in _TO_PB]
    if bad:
        raise ValueError(f"unsupported dtypes {bad}; the wire carries float32, bfloat16, float16")
    header = state_pb2.StateHeader(
        format_version=FORMAT_VERSION, session_id=session_id, model_fingerprint=fingerprint,
        position=position, tensors=[s.to_proto() for s in specs],
        total_bytes=sum(s.nbytes for s in specs), mode=mode, engine=engine, chunk_bytes=chunk_bytes)
    workers = default_workers() if workers is None else workers
    if chunk_bytes < _wire.PARALLEL_MIN_BYTES:
        workers = 0
    return _stream(header, specs, tensor_source, next_token, frames, workers, _ReadyNow(), lazy)


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


def _stream(header, specs, tensor_source, next_token, frames: bool, workers: int, ready_now,
            producer_thread: bool) -> Iterator:
    first = state_pb2.StateChunk(header=header)
    yield first.SerializeToString() if frames else first
    manifest, total = Manifest(header), header.total_bytes
    seal = _seal_frame if frames else _seal_message
    parts = _chunk_parts(specs, tensor_source, header.chunk_bytes, workers + 4, ready_now)
    for item, digest in ordered_map(seal, parts, workers, producer_thread=producer_thread):
        manifest.add(digest)
        yield item
    trailer = state_pb2.StateTrailer(total_bytes=total, data_chunks=manifest.chunks,
                                     next_token=next_token() if callable(next_token) else next_token)
    trailer.manifest_sha256 = manifest.digest(trailer)
    last = state_pb2.StateChunk(trailer=trailer)
    yield last.SerializeToString() if frames else last


def encode_state(*, session_id: str, fingerprint: str, position: int, next_token: int | Callable[[], int],
                 tensors: Iterable[WireTensor] | None = None,
                 specs: Iterable[TensorDesc] | None = None,
                 tensor_source: Iterable | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, mode: int = 0, engine: int = 0,
                 workers: int | None = None) -> Iterator[state_pb2.StateChunk]:
    """Header, data chunks of <= chunk_bytes, trailer. Give either `tensors` (all known now), or
    `specs` (the table) plus `tensor_source` yielding, in table order, each tensor or (tensor, ready):
    the header goes out first and each tensor is pulled only when its bytes are due (the source may
    block until it exists). `ready`: a CUDA event recorded once the tensor is final (the D2H copy
    waits for it on the device, never on the host); without one a CUDA tensor must be final on the
    caller's current stream when encode_state is called. `next_token` goes in the trailer: an int, or
    a callable asked once every tensor was pulled (prefill knows it only after the logits). `workers`: chunks hashed in parallel
    (None: default_workers(), 0: inline). A tensor must not change until the stream ends."""
    return _parts(session_id=session_id, fingerprint=fingerprint, position=position, next_token=next_token,
                  tensors=tensors, specs=specs, tensor_source=tensor_source, chunk_bytes=chunk_bytes,
                  mode=mode, engine=engine, workers=workers)


def encode_state_frames(**kw) -> Iterator[bytes]:
    """encode_state(**kw) with every StateChunk already serialized, for a channel method made with
    request_serializer=None. Data frames are framed by hand straight from tensor memory (one copy,
    no protobuf object) and are byte-identical to the serialized StateChunk."""
    return _parts(frames=True, **kw)
