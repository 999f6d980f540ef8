"""The state hand-off: HybridState tensors -> StateChunk stream -> the decode worker's LoadState.

Lifecycle of one hand-off:
    prefill worker   engine.export(session) -> [StateTensor] (views of the slot, no copy)
      push_state     header + data frames cut straight from tensor memory, each hashed in the wire's
                     thread pool (wire.encode_state_frames; with a tail segment, the last `tail_layers`
                     layers' bytes on in tail_chunk_bytes chunks), over a cached channel to decode_target's
                     LoadState, under a deadline; polls `is_active` so a cancelled Prefill cancels the
                     stream. grpc errors -> HandoffError. With a sender process (settings.handoff_sender
                     "process", baton/sender_process.py) the same frames are made and sent by a child
                     process; this one only stages the bytes into shared memory
    decode worker    LoadState peeks the header (engine, MTP entries) and calls
      receive_state  builds the ExpectedLayout of the receiving runner's HybridState, feeds every chunk
                     through wire.StateReceiver (chunk digests verified in the pool as chunks arrive, then
                     the manifest) and returns a fully verified ReceivedState or raises a
                     wire.StateError (its `.code` is the gRPC status); nothing partial escapes
      engine.load    copies into a free slot only then
Timeline (start_push(timeline=True), asked for by PrefillRequest.timeline): each side stamps the marks of
baton/timeline.py; the receiver answers its own when the call carries `baton-timeline: 1`, and the
sender's result() returns them all in BridgeReport.timeline.

MTP KV entries (`mtp.key`, `mtp.value`: the MTP layer's KV rows for the prompt):
  * sent, and the receiver has an MTP head        -> loaded as usual;
  * not sent (a prefill worker without the head, or a Prefill for a bf16 / fp8 session: needs_mtp_kv)
                                                  -> accepted; the rows are zero-filled. The MTP layer
    then attends to zero keys/values over the prompt: drafts get worse (lower acceptance) but every
    draft is verified by the BF16 rows, so the output is unchanged;
  * sent to a receiver without an MTP head        -> accepted and dropped after the digests covered
    them (a prefill worker with the head can feed any decode worker; the cost is wire bytes only).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable, Iterable, Iterator, Mapping

import grpc
import torch

from baton.channel_pool import ChannelPool   # NOTE: re-exported (baton.handoff.ChannelPool): bounded LRU, leases
from baton.progress import PrefillProgress, tail_offset
from baton.settings import Settings
from baton.timeline import CLOCK_ID, METADATA as TIMELINE_METADATA, Timeline, now
from baton.v1 import common_pb2, decode_pb2, state_pb2
from baton.wire import (DEFAULT_CHUNK_BYTES, BridgeStats, ExpectedLayout, LayoutEntry, ReceivedState,
                        StateCorrupt, TensorDesc, decode_stream, encode_state, encode_state_frames)
from baton import wire_send   # NOTE: after baton.wire, which imports wire_send last

MTP_NAMES = ("mtp.key", "mtp.value")
LOAD_STATE = "/baton.v1.DecodeWorker/LoadState"
ENGINE_NAMES = {common_pb2.BF16: "bf16", common_pb2.FP8: "fp8", common_pb2.MTP: "mtp"}
ENGINE_VALUES = {v: k for k, v in ENGINE_NAMES.items()}


def needs_mtp_kv(engine: int) -> bool:
    """Whether a Prefill hand-off for a session of `engine` ships the MTP KV rows: only the mtp engine
    reads them, and UNSPECIFIED (the decode worker's default, unknown here) may be mtp. A bf16 / fp8
    session never switches engine, so for it they are ~8% of a 4K state spent on the wire for nothing,
    and they are computed last, so they were the tail of the hand-off. ExportState (migration: the
    target's engine is its own default) always ships them."""
    return engine in (common_pb2.ENGINE_UNSPECIFIED, common_pb2.MTP)


def computes_mtp_kv(exact: bool, engine: int, handed_off: bool) -> bool:
    """Whether a Prefill computes the MTP layer's KV (~1/(layers+1) of its compute): when its hand-off
    ships it (needs_mtp_kv), or when the session is kept (EXACT: a later ExportState ships it). A FAST
    Prefill for a bf16 / fp8 session, or one with no decode_target, skips it."""
    return exact or (handed_off and needs_mtp_kv(engine))


def shipped(tensors: list, mtp_kv: bool) -> list:
    """The exported tensors a hand-off sends: all of them, or (mtp_kv False: see needs_mtp_kv) all but the
    MTP KV rows."""
    return list(tensors) if mtp_kv else [t for t in tensors if t.name not in MTP_NAMES]


def engine_name(value: int) -> str | None:
    """Engine enum -> "bf16" | "fp8" | "mtp"; ENGINE_UNSPECIFIED -> None (the worker's default)."""
    if value == common_pb2.ENGINE_UNSPECIFIED:
        return None
    if value not in ENGINE_NAMES:
        raise ValueError(f"engine: unknown value {value}")
    return ENGINE_NAMES[value]


def engine_value(name: str | int | None) -> int:
    if name is None or isinstance(name, int):
        return int(name or 0)
    try:
        return ENGINE_VALUES[name]
    except KeyError:
        raise ValueError(f"engine: unknown {name!r}; choose one of {', '.join(ENGINE_VALUES)}") from None


class HandoffError(Exception):
    """The hand-off to `target` failed with gRPC status `code` (UNAVAILABLE: target down)."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str):
        super().__init__(f"decode_target {target}: {code.name}: {details}")
        self.target, self.code, self.details = target, code, details


# ---------------------------------------------------------------- sender
def stream_state(tensors: Iterable, *, session_id: str, fingerprint: str, position: int, next_token: int,
                 mode: int = 0, engine: int | str | None = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 frames: bool = False, tail_from: int = 0,
                 tail_chunk_bytes: int = 0) -> Iterator[state_pb2.StateChunk] | Iterator[bytes]:
    """StateChunks (frames=True: their serialized bytes) for a list of baton.state.StateTensor."""
    enc = encode_state_frames if frames else encode_state
    return enc(session_id=session_id, fingerprint=fingerprint, position=position, next_token=next_token,
               tensors=list(tensors), chunk_bytes=chunk_bytes, mode=int(mode), engine=engine_value(engine),
               tail_from=tail_from, tail_chunk_bytes=tail_chunk_bytes)


DEFAULT_POOL = ChannelPool()


class _Frames:
    """Wraps the frame iterator: counts frames and keeps an exception raised while encoding
    (grpc would only report it as a cancelled call). timed: when each frame was handed to gRPC and when
    gRPC asked for the next one (its send completed), for the timeline."""

    def __init__(self, it: Iterator[bytes], timed: bool = False):
        self.it, self.count, self.error, self.timed = it, 0, None, timed
        self.handed: list[int] = []
        self.sent: list[int] = []

    def __iter__(self):
        try:
            for f in self.it:
                self.count += 1
                if self.timed:
                    self.handed.append(now())
                yield f
                if self.timed:
                    self.sent.append(now())
        except Exception as e:
            self.error = e
            raise


class Push:
    """One LoadState call in flight (start_push); result() waits for the decode worker's answer."""

    def __init__(self, target: str, fut, frames: _Frames, specs: list[TensorDesc], position: int, t0: float,
                 timeline: Timeline | None = None):
        self.target, self._fut, self._frames, self._specs, self._position, self._t0 = \
            target, fut, frames, specs, position, t0
        self.timeline = timeline   # baton/timeline.py; the caller may add its own prefill.* marks

    def cancel(self) -> None:
        self._fut.cancel()

    def result(self, is_active: Callable[[], bool] | None = None,
               ) -> tuple[decode_pb2.LoadStateResponse, common_pb2.BridgeReport]:
        """(the decode worker's answer, the sender's BridgeReport: seconds from the stream's start to the
        answer, bytes by kind). Raises HandoffError (status of the decode worker, UNAVAILABLE when down,
        DEADLINE_EXCEEDED, CANCELLED when `is_active()` turned False); an encoding error as is."""
        target, fut, frames = self.target, self._fut, self._frames
        try:
            while True:
                try:
                    resp = fut.result(timeout=0.05 if is_active is not None else None)
                    t_reply = now()
                    break
                except grpc.FutureTimeoutError:
                    if not is_active():
                        fut.cancel()
                        raise HandoffError(target, grpc.StatusCode.CANCELLED, "the calling RPC ended") from None
        except grpc.RpcError as e:
            if frames.error is not None:
                raise frames.error from None
            raise HandoffError(target, e.code(), e.details() or "") from None
        except grpc.FutureCancelledError:
            raise HandoffError(target, grpc.StatusCode.CANCELLED, "hand-off cancelled") from None
        stats = BridgeStats.from_specs(self._specs, tokens=self._position, chunks=max(frames.count - 2, 0),
                                       seconds=time.perf_counter() - self._t0)
        report = stats.to_proto()
        if self.timeline is not None:   # frames: header, data..., trailer
            tl, h, sent = self.timeline, frames.handed, frames.sent
            tl.mark("sender.reply", t_reply)
            tl.mark("prefill.reply_received", t_reply)   # NOTE: one process, one moment
            if len(h) >= 3 and len(sent) == len(h):
                tl.update({"sender.last_chunk_handed": h[-2], "sender.last_chunk_sent": sent[-2],
                           "sender.trailer_handed": h[-1], "sender.trailer_sent": sent[-1]},
                          series={"sender.handed": h[1:-1]})
            if resp.HasField("bridge") and resp.bridge.HasField("timeline"):
                tl.merge_proto(resp.bridge.timeline)
            report.timeline.CopyFrom(tl.to_proto())
        return resp, report


def start_push(target: str, settings: Settings | None = None, *, tensors: list, session_id: str,
               fingerprint: str, position: int, next_token: int | Callable[[], int], mode: int = 0,
               engine: int | str | None = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float = 60.0,
               pool: ChannelPool | None = None, progress: PrefillProgress | None = None,
               sender=None, tail_chunk_bytes: int = 0, tail_layers: int = 1, timeline: bool = False) -> Push:
    """Starts streaming the state to `target`'s LoadState and returns at once. `progress` (a prefill
    still running): each tensor is sent once its layer is marked, and next_token is taken from it at
    the end. `sender`: a baton.sender_process.SenderProcess (settings.handoff_sender == "process"): the
    child process streams, this process only stages bytes into its ring (-> a ProcessPush, same
    contract); None: in this process, gRPC's request thread and the wire's threads do the work.
    tail_chunk_bytes (settings.handoff_tail_chunk_bytes; 0 = none): the wire's tail segment, from the start of
    the last `tail_layers` layers' tensors (progress.tail_offset) rounded down to a multiple of chunk_bytes.
    timeline: stamp the hand-off's marks (baton/timeline.py) and ask the receiver for its own (LoadState
    metadata); the push's `.timeline` takes the caller's marks, result()'s BridgeReport.timeline has them all."""
    settings = Settings.from_env() if settings is None else settings
    tensors = list(tensors)
    specs = [TensorDesc.of(t) for t in tensors]
    what = (dict(specs=specs, tensor_source=progress.source(tensors), next_token=progress.next_token)
            if progress is not None else dict(tensors=tensors, next_token=next_token))
    kw = dict(session_id=session_id, fingerprint=fingerprint, position=position, chunk_bytes=chunk_bytes,
              mode=int(mode), engine=engine_value(engine), tail_chunk_bytes=tail_chunk_bytes,
              tail_from=tail_offset(specs, tail_layers) if tail_chunk_bytes else 0, **what)
    if sender is not None and sender.fits(chunk_bytes):
        return sender.start_push(target, settings, wire_send.plan(**kw), method=LOAD_STATE, timeout=timeout,
                                 deserialize=decode_pb2.LoadStateResponse.FromString, position=position,
                                 timeline=timeline)
    lease = (pool or DEFAULT_POOL).lease(target, settings)   # NOTE: held until the call ends: never evicted under it
    try:
        method = lease.channel.stream_unary(LOAD_STATE, request_serializer=None,
                                            response_deserializer=decode_pb2.LoadStateResponse.FromString)
        t0 = time.perf_counter()
        frames = _Frames(encode_state_frames(**kw), timed=timeline)
        tl = Timeline({"prefill": CLOCK_ID, "sender": CLOCK_ID}) if timeline else None
        fut = method.future(iter(frames), timeout=timeout, metadata=TIMELINE_METADATA if timeline else None)
    except BaseException:
        lease.release()
        raise
    fut.add_done_callback(lambda _: lease.release())
    return Push(target, fut, frames, specs, position, t0, tl)


def push_state(target: str, settings: Settings | None = None, *, is_active: Callable[[], bool] | None = None,
               **kw) -> tuple[decode_pb2.LoadStateResponse, common_pb2.BridgeReport]:
    """start_push(target, settings, **kw).result(is_active): the whole hand-off of a computed state."""
    return start_push(target, settings, **kw).result(is_active)


# ---------------------------------------------------------------- receiver
def layout_of(state) -> dict:
    """receive_state keyword arguments describing a baton.state.HybridState (window = max_len - 1:
    a loaded state must leave room to consume its pending next_token)."""
    return dict(state_layout=state.layout(), kv_dims=(state.cfg.num_key_value_heads, state.cfg.head_dim),
                max_position=state.max_len - 1)


def peek_header(chunk) -> state_pb2.StateHeader | None:
    """The StateHeader of a first message (StateChunk or its bytes), or None if it is not one."""
    if chunk is None:
        return None
    if not isinstance(chunk, state_pb2.StateChunk):
        if bytes(chunk[:1]) == b"\x12":  # a data frame: never a header
            return None
        try:
            chunk = state_pb2.StateChunk.FromString(bytes(chunk))
        except Exception:  # noqa: BLE001 - the receiver reports it as DATA_LOSS
            return None
    return chunk.header if chunk.WhichOneof("part") == "header" else None


def _entries(state_layout: Mapping, kv_dims: tuple[int, int]) -> dict[str, LayoutEntry]:
    """HybridState.layout() (name -> (kind, dtype, fixed shape | None for KV)) -> LayoutEntry map."""
    return {name: LayoutEntry(kind, dtype, shape, None if shape is not None else tuple(kv_dims))
            for name, (kind, dtype, shape) in state_layout.items()}


def receive_state(chunks: Iterable, *, state_layout: Mapping, kv_dims: tuple[int, int], max_position: int,
                  fingerprint: str, max_total_bytes: int | None = None, alloc=None,
                  on_tensor: Callable[[str, torch.Tensor], None] | None = None) -> ReceivedState:
    """Verifies one whole stream (StateChunk messages or their bytes) against the receiving state's
    layout and returns it; raises wire.StateError (.code = gRPC status name). The returned tensors
    hold exactly the names of `state_layout` (MTP entries zero-filled or dropped, see module doc).
    max_total_bytes None = the layout's size at max_position. Messages are pulled on a helper thread
    (wire.pipelined), so receiving overlaps verification. on_tensor(name, cpu tensor): each tensor of
    `state_layout` that was sent, as soon as its chunks verified (see wire.StateReceiver); the
    zero-filled ones only come with the result."""
    it = iter(chunks)
    first = next(it, None)
    if first is None:
        raise StateCorrupt("stream ended without a header")
    header = peek_header(first)
    entries = _entries(state_layout, kv_dims)
    sent = {s.name for s in header.tensors} & set(MTP_NAMES) if header is not None else set()
    kv = next((e for e in entries.values() if e.kv_dims is not None), None)
    zero_fill: dict[str, LayoutEntry] = {}
    drop: list[str] = []
    if all(n in entries for n in MTP_NAMES):
        if header is not None and not sent:
            zero_fill = {n: entries.pop(n) for n in MTP_NAMES}
    elif sent and kv is not None:
        kinds = {"mtp.key": "attn_key", "mtp.value": "attn_value"}
        for n in sorted(sent):
            entries[n] = LayoutEntry(kinds[n], kv.dtype, None, kv.kv_dims)
            drop.append(n)
    layout = ExpectedLayout(entries, max_position)
    if max_total_bytes is None:
        max_total_bytes = sum(math.prod(e.shape_at(max_position)) * e.dtype.itemsize
                              for e in layout.entries.values())
    placed = None if on_tensor is None else (lambda name, t: None if name in drop else on_tensor(name, t))
    got = decode_stream(itertools.chain((first,), it), layout, fingerprint, max_total_bytes, alloc=alloc,
                        on_tensor=placed)
    if not zero_fill and not drop:
        return got
    tensors = {k: v for k, v in got.tensors.items() if k not in drop}
    for n, e in zero_fill.items():   # [kv_heads, position, head_dim], zero-stride: no host memory, and
        tensors[n] = torch.zeros((), dtype=e.dtype).expand(e.shape_at(got.position))   # filled on the device
    return dataclasses.replace(got, tensors=tensors)
