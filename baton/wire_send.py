"""State wire format, sending side: tensors -> header, sealed data chunks, trailer (see baton/wire.py).

Each data chunk is a list of memoryview pieces of host tensor memory (no copy); the pool hashes it and
frames it (the one copy, into the bytes gRPC sends) up to `workers + 2` chunks ahead of the consumer,
which gets them in order. CUDA tensors are copied to pinned host memory one tensor ahead.
"""
from __future__ import annotations

import hashlib
import io
from typing import Iterable, Iterator

import numpy as np
import torch

import baton.wire as _wire  # NOTE: baton.wire imports this module last; its names all exist by then
from baton.v1 import state_pb2
from baton.wire import (DEFAULT_CHUNK_BYTES, FORMAT_VERSION, MAX_CHUNK_BYTES, Manifest, TensorDesc, WireTensor, _DATA_TAG,
                        _INDEX_TAG, _SHA_TAG, _TO_PB, _varint, byte_view, default_workers, kind_value, ordered_map)

_COPY_OUTSIDE_GIL_BYTES = 256 << 10  # smaller frames are joined (under the GIL, but briefly)


def _host_tensors(specs: list[TensorDesc], source: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Contiguous CPU copies of `source`, in table order, each moved once. CUDA tensors go to pinned
    memory by non_blocking copies issued one tensor ahead (the next D2H overlaps hashing/sending)."""
    pending = None  # (host tensor, cuda event | None)
    for spec, t in zip(specs, source, strict=True):
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name}: got {t.dtype} {tuple(t.shape)}, the table says {spec.dtype} {spec.shape}")
        t, ev = t.detach(), None
        if t.device.type == "cuda":
            with torch.cuda.device(t.device):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
        else:
            host = t.to("cpu").contiguous()  # no copy for a contiguous CPU tensor
        if pending is not None:
            yield _synced(*pending)
        pending = (host, ev)
    if pending is not None:
        yield _synced(*pending)


def _synced(host: torch.Tensor, ev) -> torch.Tensor:
    if ev is not None:
        ev.synchronize()
    return host


def _sha256(pieces: list) -> bytes:
    h = hashlib.sha256()
    for p in pieces:
        h.update(p)  # NOTE: releases the GIL for pieces >= 2 KiB
    return h.digest()




# ---- sender -------------------------------------------------------------------------------------
def _chunk_pieces(specs: list[TensorDesc], source: Iterable[torch.Tensor], chunk_bytes: int):
    """(chunk index, [memoryview pieces of host tensor memory]) per data chunk; no copies."""
    pieces, filled, index = [], 0, 0
    for host in _host_tensors(specs, source):
        mv, off = byte_view(host), 0
        while off < len(mv):
            piece = mv[off:off + chunk_bytes - filled]
            pieces.append(piece)
            filled, off = filled + len(piece), off + len(piece)
            if filled == chunk_bytes:
                yield index, pieces
                pieces, filled, index = [], 0, index + 1
    if pieces:
        yield index, pieces


def _seal_message(index: int, pieces: list) -> tuple[state_pb2.StateChunk, bytes]:
    d = _sha256(pieces)
    return state_pb2.StateChunk(data=b"".join(pieces), chunk_index=index, chunk_sha256=d), d


def _seal_frame(index: int, pieces: list) -> tuple[bytes, bytes]:
    """The serialized data StateChunk, framed by hand: one copy out of tensor memory, byte-identical
    to protobuf's serialization (fields in number order: data, chunk_index, chunk_sha256)."""
    d = _sha256(pieces)
    n = sum(map(len, pieces))
    head, tail = _DATA_TAG + _varint(n), (_INDEX_TAG + _varint(index) if index else b"") + _SHA_TAG + d
    if n < _COPY_OUTSIDE_GIL_BYTES:
        return b"".join([head, *pieces, tail]), d
    # NOTE: b"".join holds the GIL while copying memoryviews; instead the bytes object is made by a
    # BytesIO (one zero-filled allocation: the only pass under the GIL), filled by numpy copies (no GIL)
    # through getbuffer(), and handed out by getvalue(), which CPython does without copying.
    buf = io.BytesIO()
    buf.seek(len(head) + n)
    buf.write(tail)
    buf.seek(0)
    buf.write(head)
    with buf.getbuffer() as mv:
        dst, off = np.frombuffer(mv, dtype=np.uint8), len(head)
        for p in pieces:
            np.copyto(dst[off:off + len(p)], np.frombuffer(p, dtype=np.uint8))
            off += len(p)
        del dst   # NOTE: before the export ends
    return buf.getvalue(), d


def _parts(*, session_id: str, fingerprint: str, position: int, next_token: int, tensors=None,
           specs=None, tensor_source=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, mode: int = 0,
           engine: int = 0, frames: bool = False, workers: int | None = None):
    """Yields the header, each sealed data chunk, then the trailer (messages, or bytes with frames=True)."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    if tensors is not None and specs is None and tensor_source is None:
        tensors = list(tensors)
        specs, tensor_source = [TensorDesc.of(t) for t in tensors], (t.tensor for t in tensors)
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
    header = state_pb2.StateHeader(
        format_version=FORMAT_VERSION, session_id=session_id, model_fingerprint=fingerprint,
        position=position, next_token=next_token, tensors=[s.to_proto() for s in specs],
        total_bytes=total, mode=mode, engine=engine, chunk_bytes=chunk_bytes)
    first = state_pb2.StateChunk(header=header)
    yield first.SerializeToString() if frames else first
    manifest = Manifest(header)
    workers = default_workers() if workers is None else workers
    seal = _seal_frame if frames else _seal_message
    for item, digest in ordered_map(seal, _chunk_pieces(specs, tensor_source, chunk_bytes),
                                    workers if chunk_bytes >= _wire.PARALLEL_MIN_BYTES else 0):
        manifest.add(digest)
        yield item
    last = state_pb2.StateChunk(trailer=state_pb2.StateTrailer(
        total_bytes=total, data_chunks=manifest.chunks, manifest_sha256=manifest.digest(total)))
    yield last.SerializeToString() if frames else last


def encode_state(*, session_id: str, fingerprint: str, position: int, next_token: int,
                 tensors: Iterable[WireTensor] | None = None,
                 specs: Iterable[TensorDesc] | None = None,
                 tensor_source: Iterable[torch.Tensor] | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, mode: int = 0, engine: int = 0,
                 workers: int | None = None) -> Iterator[state_pb2.StateChunk]:
    """Header, data chunks of <= chunk_bytes, trailer. Give either `tensors` (all known now), or
    `specs` (the table) plus `tensor_source` yielding each tensor in table order once it is final:
    the header goes out first and each tensor is read only when its bytes are due. A CUDA tensor
    must be final on the current stream (D2H copies are queued there). `workers`: chunks hashed in
    parallel (None: default_workers(), 0: inline). A tensor must not change until the stream ends."""
    return _parts(session_id=session_id, fingerprint=fingerprint, position=position, next_token=next_token,
                  tensors=tensors, specs=specs, tensor_source=tensor_source, chunk_bytes=chunk_bytes,
                  mode=mode, engine=engine, workers=workers)


def encode_state_frames(**kw) -> Iterator[bytes]:
    """encode_state(**kw) with every StateChunk already serialized, for a channel method made with
    request_serializer=None. Data frames are framed by hand straight from tensor memory (one copy,
    no protobuf object) and are byte-identical to the serialized StateChunk."""
    return _parts(frames=True, **kw)
