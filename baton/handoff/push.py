"""The prefill worker's side of a hand-off: a computed state -> one LoadState call on the decode worker.

    start_push(target, ...)   header + data frames cut straight from tensor memory, each hashed in the
                              wire's thread pool (encode.encode_state_frames; with a tail segment, the
                              last `tail_layers` layers' bytes go in tail_chunk_bytes chunks), over a
                              pooled channel to decode_target's LoadState, under a deadline
    Push.result(is_active)    waits for the answer; polls `is_active` so a cancelled Prefill cancels the
                              stream; grpc errors -> HandoffError
With a sender process (settings.handoff_sender "process", baton/handoff/sender/) the same frames are made
and sent by a child process; this one only stages the bytes into shared memory.
Timeline (start_push(timeline=True), asked for by PrefillRequest.timeline): each side stamps the marks of
baton/handoff/timeline.py; the receiver answers its own when the call carries `baton-timeline: 1`, and the
sender's result() returns them all in BridgeReport.timeline.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Iterator

import grpc

from baton.handoff import encode
from baton.handoff.admission import wait_admitted, watch_admission
from baton.handoff.channels import ChannelPool
from baton.handoff.encode import encode_state, encode_state_frames
from baton.handoff.progress import PrefillProgress, tail_offset
from baton.handoff.timeline import CLOCK_ID, Timeline, now
from baton.handoff.timeline import METADATA as TIMELINE_METADATA
from baton.handoff.wire import DEFAULT_CHUNK_BYTES, BridgeStats, TensorDesc
from baton.names import engine_value
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, state_pb2

LOAD_STATE = "/baton.v1.DecodeWorker/LoadState"


class HandoffError(Exception):
    """The hand-off to `target` failed with gRPC status `code` (UNAVAILABLE: target down)."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str):
        super().__init__(f"decode_target {target}: {code.name}: {details}")
        self.target, self.code, self.details = target, code, details


# ---------------------------------------------------------------- sender
def stream_state(
    tensors: Iterable,
    *,
    session_id: str,
    fingerprint: str,
    position: int,
    next_token: int,
    mode: int = 0,
    engine: int | str | None = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    frames: bool = False,
    tail_from: int = 0,
    tail_chunk_bytes: int = 0,
    draft_only: bool = False,
) -> Iterator[state_pb2.StateChunk] | Iterator[bytes]:
    """StateChunks (frames=True: their serialized bytes) for a list of baton.engine.state.StateTensor."""
    enc = encode_state_frames if frames else encode_state
    return enc(
        session_id=session_id,
        fingerprint=fingerprint,
        position=position,
        next_token=next_token,
        tensors=list(tensors),
        chunk_bytes=chunk_bytes,
        mode=int(mode),
        engine=engine_value(engine),
        tail_from=tail_from,
        tail_chunk_bytes=tail_chunk_bytes,
        draft_only=draft_only,
    )


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

    def __init__(
        self,
        target: str,
        fut,
        frames: _Frames,
        specs: list[TensorDesc],
        position: int,
        t0: float,
        timeline: Timeline | None = None,
        draft_only: bool = False,
    ):
        self.target, self._fut, self._frames, self._specs, self._position, self._t0 = (
            target,
            fut,
            frames,
            specs,
            position,
            t0,
        )
        self.draft_only = draft_only  # the header's (BridgeReport.draft_only)
        self.timeline = timeline  # baton/handoff/timeline.py; the caller may add its own prefill.* marks
        self._admitted = threading.Event()
        watch_admission(fut, self._admitted.set)

    def cancel(self) -> None:
        self._fut.cancel()

    def admitted(self, is_active: Callable[[], bool] | None = None) -> bool:
        """Waits until the decode worker admitted the session (its slot is reserved: it can no longer refuse
        for full slots) -> True, or the call ended first (or `is_active()` turned False) -> False."""
        return wait_admitted(self._admitted, self._fut.done, is_active)

    def result(
        self,
        is_active: Callable[[], bool] | None = None,
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
        stats = BridgeStats.from_specs(
            self._specs, tokens=self._position, chunks=max(frames.count - 2, 0), seconds=time.perf_counter() - self._t0
        )
        report = stats.to_proto()
        report.draft_only = self.draft_only
        if self.timeline is not None:  # frames: header, data..., trailer
            tl, h, sent = self.timeline, frames.handed, frames.sent
            tl.mark("sender.reply", t_reply)
            tl.mark("prefill.reply_received", t_reply)  # NOTE: one process, one moment
            if len(h) >= 3 and len(sent) == len(h):
                tl.update(
                    {
                        "sender.last_chunk_handed": h[-2],
                        "sender.last_chunk_sent": sent[-2],
                        "sender.trailer_handed": h[-1],
                        "sender.trailer_sent": sent[-1],
                    },
                    series={"sender.handed": h[1:-1]},
                )
            if resp.HasField("bridge") and resp.bridge.HasField("timeline"):
                tl.merge_proto(resp.bridge.timeline)
            report.timeline.CopyFrom(tl.to_proto())
        return resp, report


def start_push(
    target: str,
    settings: Settings | None = None,
    *,
    tensors: list,
    session_id: str,
    fingerprint: str,
    position: int,
    next_token: int | Callable[[], int],
    mode: int = 0,
    engine: int | str | None = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout: float = 60.0,
    pool: ChannelPool | None = None,
    progress: PrefillProgress | None = None,
    sender=None,
    tail_chunk_bytes: int = 0,
    tail_layers: int = 1,
    timeline: bool = False,
    draft_only: bool = False,
) -> Push:
    """Starts streaming the state to `target`'s LoadState and returns at once. `progress` (a prefill
    still running): each tensor is sent once its layer is marked, and next_token is taken from it at
    the end. `sender`: a baton.handoff.sender.process.SenderProcess (settings.handoff_sender == "process"): the
    child process streams, this process only stages bytes into its ring (-> a ProcessPush, same
    contract); None: in this process, gRPC's request thread and the wire's threads do the work.
    tail_chunk_bytes (settings.handoff_tail_chunk_bytes; 0 = none): the wire's tail segment, from the start of
    the last `tail_layers` layers' tensors (progress.tail_offset) rounded down to a multiple of chunk_bytes.
    timeline: stamp the hand-off's marks (baton/handoff/timeline.py) and ask the receiver for its own (LoadState
    metadata); the push's `.timeline` takes the caller's marks, result()'s BridgeReport.timeline has them all.
    draft_only: the header marks a draft-only state (the caller ships DRAFT_ONLY_NAMES alone: baton/handoff/policy.py)."""
    settings = Settings.from_env() if settings is None else settings
    tensors = list(tensors)
    specs = [TensorDesc.of(t) for t in tensors]
    what = (
        dict(specs=specs, tensor_source=progress.source(tensors), next_token=progress.next_token)
        if progress is not None
        else dict(tensors=tensors, next_token=next_token)
    )
    kw = dict(
        session_id=session_id,
        fingerprint=fingerprint,
        position=position,
        chunk_bytes=chunk_bytes,
        mode=int(mode),
        engine=engine_value(engine),
        tail_chunk_bytes=tail_chunk_bytes,
        tail_from=tail_offset(specs, tail_layers) if tail_chunk_bytes else 0,
        draft_only=draft_only,
        **what,
    )
    if sender is not None and sender.fits(chunk_bytes):
        return sender.start_push(
            target,
            settings,
            encode.plan(**kw),
            method=LOAD_STATE,
            timeout=timeout,
            deserialize=decode_pb2.LoadStateResponse.FromString,
            position=position,
            timeline=timeline,
        )
    lease = (pool or DEFAULT_POOL).lease(target, settings)  # held until the call ends: never evicted under it
    try:
        method = lease.channel.stream_unary(
            LOAD_STATE, request_serializer=None, response_deserializer=decode_pb2.LoadStateResponse.FromString
        )
        t0 = time.perf_counter()
        frames = _Frames(encode_state_frames(**kw), timed=timeline)
        tl = Timeline({"prefill": CLOCK_ID, "sender": CLOCK_ID}) if timeline else None
        fut = method.future(iter(frames), timeout=timeout, metadata=TIMELINE_METADATA if timeline else None)
    except BaseException:
        lease.release()
        raise
    fut.add_done_callback(lambda _: lease.release())
    return Push(target, fut, frames, specs, position, t0, tl, draft_only)


def push_state(
    target: str, settings: Settings | None = None, *, is_active: Callable[[], bool] | None = None, **kw
) -> tuple[decode_pb2.LoadStateResponse, common_pb2.BridgeReport]:
    """start_push(target, settings, **kw).result(is_active): the whole hand-off of a computed state."""
    return start_push(target, settings, **kw).result(is_active)
