"""State wire format: one request's state as a stream of `StateChunk` messages, and its verified decode.

Stream, format_version 4 (never pickled; tensor bytes little-endian, C-contiguous, concatenated in table order):
    StateChunk(header)    format_version, fingerprint, position, the full tensor table, the chunk plan
                          (chunk_bytes, tail_from, tail_chunk_bytes): all known before prefill computes, so
                          the stream can start at once
    StateChunk(data) * n  the bytes in two segments (ChunkPlan): head [0, tail_from) in chunks of exactly
                          chunk_bytes (tail_from is a multiple of it), then tail [tail_from, total) in chunks
                          of tail_chunk_bytes (1..chunk_bytes; the last may be short). No tail segment
                          (tail_chunk_bytes = tail_from = 0): [0, total) in chunk_bytes pieces, the last may
                          be short. A chunk may span tensor boundaries; chunk_index = i, chunk_sha256 =
                          SHA-256(data)
    StateChunk(trailer)   total_bytes, data_chunks = n, next_token (known only once the logits are),
                          manifest_sha256 = SHA-256(MANIFEST_TAG || SHA-256(header, deterministic)
                          || chunk digests in order || SHA-256(trailer without manifest_sha256, deterministic))
Why a tail segment: what is final last (the last layers' state, then hidden and the MTP KV) is all that is
left to send once the prefill ended; it crosses D2H -> frame+hash -> gRPC -> verify -> H2D one chunk at a
time, so smaller chunks there shorten the hand-off's tail, while big chunks keep the per-chunk cost of the
rest low. The sender's policy (handoff.start_push): tail_from = the start of the last `tail_layers` layers'
tensors (baton/handoff/progress.py: tail_offset), rounded down to a multiple of chunk_bytes.
The table is layer-major, in the order prefill finishes the tensors (layers 0..N-1, then the final
hidden row, then the MTP KV), so a sender streams each layer while later ones compute.
The chunk digests make hashing parallel on both sides (a thread pool; hashlib releases the GIL); the
manifest binds the header, every chunk digest, their order and the trailer into one value, so a stream
is accepted only if every byte of it, header and trailer included, is what the sender produced, in the
sender's order. Integrity, not secrecy or authorship: peers are authenticated by the channel (bearer
token, TLS). Format 3 (format 4 without a tail segment; a header of format 3 with tail fields is
INVALID_ARGUMENT) is still read; formats 1 and 2 (next_token in the header) are refused (FAILED_PRECONDITION).
MANIFEST_TAG stays "baton/state/v3": the manifest is built as in format 3, and it covers the header's
format_version and chunk plan.

Sender: baton/handoff/encode.py: encode_state(...) -> StateChunks; encode_state_frames: the same,
          serialized, data frames built straight from tensor memory (baton/handoff/frames.py: the framing
          and the manifest, torch-free, shared with the sender child process). Chunks are hashed and
          framed up to `workers + 2` ahead in the pool; the consumer (gRPC) gets them in order.
Receiver: baton/handoff/decode.py: StateReceiver(...): feed(chunk) per message, then finish(). The header
          is validated before anything is allocated (the chunk plan strictly); each chunk's index and size
          (as the plan says) are checked on arrival, its digest verified and its bytes copied into
          per-tensor CPU buffers by the pool while later chunks arrive; the trailer's manifest is checked
          after every chunk verified. A ReceivedState exists only once everything verified, so nothing
          half-loaded becomes visible.
This module holds what both sides share: constants, errors, the tensor table, the chunk plan, the
hashing pool and BridgeStats.
Errors carry `.code` ("DATA_LOSS" | "FAILED_PRECONDITION" | "INVALID_ARGUMENT"); services answer
`getattr(grpc.StatusCode, err.code)` with the message, which names the first thing that failed.
"""

from __future__ import annotations

import collections
import math
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from baton.handoff.frames import _SHA_TAG, DIGEST_BYTES, FRAME_OVERHEAD
from baton.v1 import common_pb2, state_pb2

FORMAT_VERSION = 4
READ_VERSIONS = (3, 4)  # what a receiver accepts: 3 is 4 without a tail segment
MAX_DATA_CHUNKS = (1 << 32) - 1  # chunk_index and data_chunks are uint32
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 16 << 20  # hard cap on one data chunk, both ways (gRPC messages: 64 MiB)
PARALLEL_MIN_BYTES = 64 << 10  # smaller chunks are hashed inline: a pool hop costs more than the hash

_TO_PB = {torch.float32: state_pb2.FLOAT32, torch.bfloat16: state_pb2.BFLOAT16, torch.float16: state_pb2.FLOAT16}
_FROM_PB = {v: k for k, v in _TO_PB.items()}
_KIND_BY_NAME = {
    "gdn_conv": state_pb2.GDN_CONV,
    "gdn_recurrent": state_pb2.GDN_RECURRENT,  # baton.engine.state names
    "attn_key": state_pb2.ATTN_KEY,
    "attn_value": state_pb2.ATTN_VALUE,
    "hidden": state_pb2.HIDDEN,
}
_KV_KINDS = (state_pb2.ATTN_KEY, state_pb2.ATTN_VALUE)
REPORT_KEY = {
    state_pb2.GDN_CONV: "gdn_conv",
    state_pb2.GDN_RECURRENT: "gdn_recurrent",  # BridgeReport keys
    state_pb2.ATTN_KEY: "attn_kv",
    state_pb2.ATTN_VALUE: "attn_kv",
    state_pb2.HIDDEN: "hidden",
}
if sys.byteorder != "little":  # NOTE: tensor bytes are sent as host memory; the format is little-endian
    raise ImportError("baton.handoff.wire needs a little-endian host")


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


def check_chunk_bytes(chunk_bytes: int, max_message_bytes: int | None = None) -> int:
    """chunk_bytes if a sender can use it: 1..MAX_CHUNK_BYTES (what every receiver accepts) and, given the
    channel's gRPC message limit, a framed chunk (FRAME_OVERHEAD more) fits in one message; else ValueError.
    For configuration time (a worker's --chunk-mib), so a bad size never reaches a hand-off."""
    if not isinstance(chunk_bytes, int) or not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES} (16 MiB), got {chunk_bytes!r}")
    if max_message_bytes is not None and chunk_bytes + FRAME_OVERHEAD > max_message_bytes:
        raise ValueError(
            f"chunk_bytes {chunk_bytes}: a data frame of up to {chunk_bytes + FRAME_OVERHEAD} bytes "
            f"does not fit the gRPC message limit max_message_bytes={max_message_bytes}"
        )
    return chunk_bytes


@dataclass(frozen=True)
class ChunkPlan:
    """Where data chunk i's bytes lie: head [0, split) in chunk_bytes pieces, then tail [split, total) in
    tail_chunk_bytes pieces; split = tail_from with a tail segment (tail_chunk_bytes > 0), else total.
    The last chunk of each segment may be short. Assumes a valid plan (the receiver checks headers first)."""

    total: int
    chunk_bytes: int
    tail_from: int = 0
    tail_chunk_bytes: int = 0  # 0: no tail segment

    @classmethod
    def of(cls, header) -> ChunkPlan:
        return cls(header.total_bytes, header.chunk_bytes, header.tail_from, header.tail_chunk_bytes)

    @property
    def split(self) -> int:
        return self.tail_from if self.tail_chunk_bytes else self.total

    @property
    def head_chunks(self) -> int:
        return -(-self.split // self.chunk_bytes)

    @property
    def count(self) -> int:
        return self.chunks_to(self.total)

    def chunks_to(self, end: int) -> int:
        """Data chunks that cover bytes [0, end)."""
        head = -(-min(end, self.split) // self.chunk_bytes)
        return head + (-(-(end - self.split) // self.tail_chunk_bytes) if end > self.split else 0)

    def cap(self, i: int) -> int:
        """Chunk i's nominal size (its segment's chunk size)."""
        return self.chunk_bytes if i < self.head_chunks else self.tail_chunk_bytes

    def span(self, i: int) -> tuple[int, int]:
        """(start byte, size) of chunk i < count."""
        h = self.head_chunks
        start = i * self.chunk_bytes if i < h else self.split + (i - h) * self.tail_chunk_bytes
        end = min(start + self.cap(i), self.split if i < h else self.total)
        return start, end - start

    def describe(self) -> str:
        s = f"chunk_bytes {self.chunk_bytes}, total_bytes {self.total}"
        return s + (
            f", tail from {self.tail_from} in tail_chunk_bytes {self.tail_chunk_bytes}" if self.tail_chunk_bytes else ""
        )


def kind_value(kind: int | str) -> int:
    """state_pb2.TensorKind value of `kind` (the enum value, or a baton.engine.state name like "attn_key")."""
    k = _KIND_BY_NAME.get(kind) if isinstance(kind, str) else int(kind)
    if k not in REPORT_KEY:
        raise ValueError(f"unknown tensor kind {kind!r}")
    return k


@dataclass(frozen=True)
class WireTensor:
    name: str
    kind: int  # state_pb2.TensorKind (a baton.engine.state kind name is accepted too)
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
        """From anything with .name, .kind and .tensor (WireTensor, baton.engine.state.StateTensor)."""
        return cls(t.name, kind_value(t.kind), t.tensor.dtype, tuple(t.tensor.shape))

    def to_proto(self) -> state_pb2.TensorSpec:
        return state_pb2.TensorSpec(
            name=self.name, kind=self.kind, dtype=_TO_PB[self.dtype], shape=self.shape, nbytes=self.nbytes
        )


def byte_view(t: torch.Tensor) -> memoryview:
    """Zero-copy flat uint8 view of a contiguous CPU tensor's bytes."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ---- digests and the hashing pool -----------------------------------------------------------------
def default_workers() -> int:
    """Chunks hashed in parallel per stream by default: the usable cores, at most 8 (eight
    SHA-256 streams outrun what one gRPC stream carries); 0 (inline) on one core."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, n) if n > 1 else 0


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's hashing pool (both directions share it), made on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max(1, default_workers()), thread_name_prefix="baton-wire-hash")
        return _POOL


def _forget_pool() -> None:  # a forked child has the pool object but none of its threads
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def ordered_map(fn: Callable, items: Iterable[tuple], workers: int, *, producer_thread: bool = True) -> Iterator:
    """fn(*item) for each item, in order, with up to `workers + 2` calls running ahead in the pool
    (workers == 0: inline). producer_thread: a helper thread pulls `items` and submits the calls, so
    producing items (D2H staging, a wait on prefill progress) never holds back results that are ready;
    without it (items that never block: CPU tensors already final) the consumer submits as it goes,
    one thread fewer contending for the GIL. Closing the iterator stops submitting (calls already
    submitted still run to completion)."""
    if workers <= 0:
        for it in items:
            yield fn(*it)
        return
    pool = _pool()
    if producer_thread:
        futures = pipelined((pool.submit(fn, *it) for it in items), depth=workers + 2)
        try:
            for f in futures:
                yield f.result()
        finally:
            futures.close()
        return
    window = collections.deque()
    try:
        for it in items:
            window.append(pool.submit(fn, *it))
            if len(window) > workers + 2:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
    finally:
        for f in window:
            f.cancel()


def _read_varint(mv: memoryview, i: int) -> tuple[int, int] | None:
    n, shift, end = 0, 0, min(len(mv), i + 10)
    while i < end:
        b = mv[i]
        n, i, shift = n | (b & 0x7F) << shift, i + 1, shift + 7
        if b < 0x80:
            return n, i
    return None


def _data_frame(buf) -> tuple[memoryview, int, bytes] | None:
    """(data, chunk_index, chunk_sha256) of a serialized data StateChunk in the canonical layout that
    the sender writes (no copy of data), else None (the caller then parses it with protobuf)."""
    mv = memoryview(buf)
    if len(mv) < 2 or mv[0] != 0x12 or (r := _read_varint(mv, 1)) is None:
        return None
    n, i = r
    data, j, index = mv[i : i + n], i + n, 0
    if j < len(mv) and mv[j] == 0x20:
        if (r := _read_varint(mv, j + 1)) is None:
            return None
        index, j = r
    if len(data) != n or len(mv) != j + 2 + DIGEST_BYTES or bytes(mv[j : j + 2]) != _SHA_TAG:
        return None
    return data, index, bytes(mv[j + 2 :])


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
        it = iter(items)
        try:
            for x in it:
                if not put((x, None)):
                    return
            put((_END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((_END, e))
        finally:
            if hasattr(it, "close"):
                it.close()  # NOTE: on this thread: a producer's finally (staging buffers) runs now

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
    chunks: int = 0  # data chunks
    seconds: float = 0.0

    @classmethod
    def from_specs(
        cls, specs: Iterable[TensorDesc], *, tokens: int, chunks: int = 0, seconds: float = 0.0
    ) -> BridgeStats:
        by_kind: dict[str, int] = {}
        for s in specs:
            key = REPORT_KEY[kind_value(s.kind)]
            by_kind[key] = by_kind.get(key, 0) + s.nbytes
        return cls(sum(by_kind.values()), by_kind, tokens, chunks, seconds)

    def to_proto(self) -> common_pb2.BridgeReport:
        return common_pb2.BridgeReport(
            seconds=self.seconds,
            total_bytes=self.total_bytes,
            bytes_by_kind=self.bytes_by_kind,
            tokens=self.tokens,
            chunks=self.chunks,
        )
