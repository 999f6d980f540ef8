"""State wire format: one request's state as a stream of `StateChunk` messages, and its verified decode.

Stream (never pickled; tensor bytes little-endian, C-contiguous, concatenated in table order):
    StateChunk(header)    format_version, fingerprint, position, next_token, the full tensor table
    StateChunk(data) * n  n = ceil(total_bytes / chunk_bytes); a chunk may span tensor boundaries
    StateChunk(trailer)   sha256 over all data bytes, total_bytes, data_chunks

Sender:   pipelined(encode_state(...)) -> StateChunks (encode_state_frames: the same, serialized)
Receiver (baton/wire_receive.py, re-exported here): StateReceiver(...): feed(chunk) per message, then
          finish(). The header is validated before anything is allocated; bytes go straight into
          per-tensor CPU buffers and are hashed on the way; a ReceivedState exists only once
          everything verified, so nothing half-loaded becomes visible.
Errors carry `.code` ("DATA_LOSS" | "FAILED_PRECONDITION" | "INVALID_ARGUMENT"); services answer
`getattr(grpc.StatusCode, err.code)` with the message, which names the first thing that failed.
"""
from __future__ import annotations

import hashlib
import math
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from baton.v1 import common_pb2, state_pb2

FORMAT_VERSION = 1
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 16 << 20  # hard cap on one data chunk, both ways (gRPC messages: 64 MiB)

_TO_PB = {torch.float32: state_pb2.FLOAT32, torch.bfloat16: state_pb2.BFLOAT16, torch.float16: state_pb2.FLOAT16}
_FROM_PB = {v: k for k, v in _TO_PB.items()}
_KIND_BY_NAME = {"gdn_conv": state_pb2.GDN_CONV, "gdn_recurrent": state_pb2.GDN_RECURRENT,  # baton.state names
                 "attn_key": state_pb2.ATTN_KEY, "attn_value": state_pb2.ATTN_VALUE, "hidden": state_pb2.HIDDEN}
_KV_KINDS = (state_pb2.ATTN_KEY, state_pb2.ATTN_VALUE)
REPORT_KEY = {state_pb2.GDN_CONV: "gdn_conv", state_pb2.GDN_RECURRENT: "gdn_recurrent",  # BridgeReport keys
              state_pb2.ATTN_KEY: "attn_kv", state_pb2.ATTN_VALUE: "attn_kv", state_pb2.HIDDEN: "hidden"}
_DATA_TAG = b"\x12"  # StateChunk field 2 (data), wire type 2 (length-delimited)
if sys.byteorder != "little":  # NOTE: tensor bytes are sent as host memory; the format is little-endian
    raise ImportError("baton.wire needs a little-endian host")


class StateError(Exception):
    code = "INTERNAL"


class StateCorrupt(StateError):
    """Digest mismatch, truncated stream, missing header/trailer, misordered or surplus chunks."""
    code = "DATA_LOSS"


class StateMismatch(StateError):
    """The state comes from another model (fingerprint) or another format_version."""
    code = "FAILED_PRECONDITION"


class StateInvalid(StateError):
    """The tensor table does not fit the receiving engine (names, kinds, dtypes, shapes, sizes)."""
    code = "INVALID_ARGUMENT"


def kind_value(kind: int | str) -> int:
    """state_pb2.TensorKind value of `kind` (the enum value, or a baton.state name like "attn_key")."""
    k = _KIND_BY_NAME.get(kind) if isinstance(kind, str) else int(kind)
    if k not in REPORT_KEY:
        raise ValueError(f"unknown tensor kind {kind!r}")
    return k


@dataclass(frozen=True)
class WireTensor:
    name: str
    kind: int             # state_pb2.TensorKind (a baton.state kind name is accepted too)
    tensor: torch.Tensor  # any device, any strides; float32 | bfloat16 | float16


@dataclass(frozen=True)
class TensorDesc:
    """One row of the header's tensor table, known before the tensor's bytes exist."""
    name: str
    kind: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, t) -> TensorDesc:
        """From anything with .name, .kind and .tensor (WireTensor, baton.state.StateTensor)."""
        return cls(t.name, kind_value(t.kind), t.tensor.dtype, tuple(t.tensor.shape))

    def to_proto(self) -> state_pb2.TensorSpec:
        return state_pb2.TensorSpec(name=self.name, kind=self.kind, dtype=_TO_PB[self.dtype],
                                    shape=self.shape, nbytes=self.nbytes)


def byte_view(t: torch.Tensor) -> memoryview:
    """Zero-copy flat uint8 view of a contiguous CPU tensor's bytes."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ---- sender -------------------------------------------------------------------------------------
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


def _parts(*, session_id: str, fingerprint: str, position: int, next_token: int, tensors=None,
           specs=None, tensor_source=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, mode: int = 0,
           engine: int = 0):
    """Yields the header, then each data chunk as a list of memoryview pieces, then the trailer."""
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
    yield state_pb2.StateChunk(header=state_pb2.StateHeader(
        format_version=FORMAT_VERSION, session_id=session_id, model_fingerprint=fingerprint,
        position=position, next_token=next_token, tensors=[s.to_proto() for s in specs],
        total_bytes=total, mode=mode, engine=engine))
    digest, pieces, filled, chunks = hashlib.sha256(), [], 0, 0
    for host in _host_tensors(specs, tensor_source):
        mv, off = byte_view(host), 0
        while off < len(mv):
            piece = mv[off:off + chunk_bytes - filled]
            digest.update(piece)  # NOTE: releases the GIL for large pieces
            pieces.append(piece)
            filled, off = filled + len(piece), off + len(piece)
            if filled == chunk_bytes:
                yield pieces
                pieces, filled, chunks = [], 0, chunks + 1
    if pieces:
        yield pieces
        chunks += 1
    yield state_pb2.StateChunk(trailer=state_pb2.StateTrailer(
        sha256=digest.digest(), total_bytes=total, data_chunks=chunks))


def encode_state(*, session_id: str, fingerprint: str, position: int, next_token: int,
                 tensors: Iterable[WireTensor] | None = None,
                 specs: Iterable[TensorDesc] | None = None,
                 tensor_source: Iterable[torch.Tensor] | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, mode: int = 0, engine: int = 0,
                 ) -> Iterator[state_pb2.StateChunk]:
    """Header, data chunks of <= chunk_bytes, trailer. Give either `tensors` (all known now), or
    `specs` (the table) plus `tensor_source` yielding each tensor in table order once it is final:
    the header goes out first and each tensor is read only when its bytes are due. A CUDA tensor
    must be final on the current stream (D2H copies are queued there). Wrap in pipelined() to send."""
    for p in _parts(session_id=session_id, fingerprint=fingerprint, position=position,
                    next_token=next_token, tensors=tensors, specs=specs, tensor_source=tensor_source,
                    chunk_bytes=chunk_bytes, mode=mode, engine=engine):
        yield state_pb2.StateChunk(data=b"".join(p)) if isinstance(p, list) else p


def encode_state_frames(**kw) -> Iterator[bytes]:
    """encode_state(**kw) with every StateChunk already serialized, for a channel method made with
    request_serializer=None. Data frames are framed by hand straight from tensor memory (one copy,
    no protobuf object) and parse as the identical StateChunk."""
    for p in _parts(**kw):
        if isinstance(p, list):
            yield b"".join([_DATA_TAG, _varint(sum(len(x) for x in p)), *p])
        else:
            yield p.SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _data_frame(buf) -> memoryview | None:
    """The payload of a serialized StateChunk that is exactly one data field, else None."""
    mv = memoryview(buf)
    if len(mv) < 2 or mv[0] != 0x12:
        return None
    n, shift, i = 0, 0, 1
    while i < min(len(mv), 11):
        b = mv[i]
        n, i, shift = n | (b & 0x7F) << shift, i + 1, shift + 7
        if b < 0x80:
            return mv[i:] if len(mv) - i == n else None
    return None


def pipelined(items: Iterable, depth: int = 2) -> Iterator:
    """Iterates `items` on a helper thread up to `depth` ahead, so producing chunk i+1 (hashing,
    framing, D2H copy) overlaps gRPC sending chunk i. The producer's exception re-raises in the
    consumer; closing or dropping this iterator stops the helper."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def run():
        try:
            for x in items:
                if not put((x, None)):
                    return
            put((_END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((_END, e))

    threading.Thread(target=run, daemon=True, name="baton-wire-pipelined").start()
    try:
        while True:
            x, err = q.get()
            if err is not None:
                raise err
            if x is _END:
                return
            yield x
    finally:
        stop.set()


_END = object()


@dataclass
class BridgeStats:
    total_bytes: int = 0
    bytes_by_kind: dict[str, int] = field(default_factory=dict)  # REPORT_KEY values
    tokens: int = 0
    chunks: int = 0      # data chunks
    seconds: float = 0.0

    @classmethod
    def from_specs(cls, specs: Iterable[TensorDesc], *, tokens: int, chunks: int = 0,
                   seconds: float = 0.0) -> BridgeStats:
        by_kind: dict[str, int] = {}
        for s in specs:
            key = REPORT_KEY[kind_value(s.kind)]
            by_kind[key] = by_kind.get(key, 0) + s.nbytes
        return cls(sum(by_kind.values()), by_kind, tokens, chunks, seconds)

    def to_proto(self) -> common_pb2.BridgeReport:
        return common_pb2.BridgeReport(seconds=self.seconds, total_bytes=self.total_bytes,
                                       bytes_by_kind=self.bytes_by_kind, tokens=self.tokens,
                                       chunks=self.chunks)



# The receiving side lives in baton/wire_receive.py; re-exported so `baton.wire` stays the one API.
from baton.wire_receive import (  # noqa: E402,F401
    LayoutEntry, ExpectedLayout, ReceivedState, StateReceiver, decode_stream,
)
