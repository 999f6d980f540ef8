"""gRPC service `baton.v1.DecodeWorker`: the fast worker's front door.

Lifecycle of a request:
    LoadState(stream StateChunk)   header peeked -> engine (ENGINE_UNSPECIFIED = the worker default)
        -> DecodeEngine.reserve: a slot, not live (baton/handoff/slot_fill.py)
        -> handoff.receive_state against that engine's HybridState layout (digest, fingerprint, table);
           each tensor is copied into the reserved slot (H2D) as soon as its chunks verified
        -> SlotFill.commit once the whole stream verified: only then is the session live; a draft-only
           state (StateHeader.draft_only, mtp only: the hidden row and MTP KV alone) makes it draft_only
        -> session_id, position, BridgeReport (seconds: first chunk received -> state in its slot; with call
           metadata `baton-timeline: 1`: its timeline, the decode.* marks of baton/handoff/timeline.py, for which
           LoadState waits for the slot's device copies before it answers)
    Decode(session, max_new_tokens, stop ids, ignore_eos, sampling)   fast mode, server stream (sampling:
        written into the session's row of its runner's SamplingTable first; logprobs per token if asked;
        with a penalty, the first call after LoadState carries the state's tokens, `history`):
        one DecodeResponse per engine step (1 token for bf16/fp8, 1..K+1 for mtp; a release_at_end
        stream without logprobs may group several steps' tokens under load: decode_worker/pacing.py); the
        message that ends the stream carries finish_reason (STOP beats EOS beats LENGTH) and, for mtp,
        mean_accept_len of this call. Tokens start AFTER the state's next_token (Prefill's first
        token), so a request of N tokens is Prefill's first token + Decode(max_new_tokens=N-1).
        A cancelled or timed-out client stops it within one step; release_at_end releases the
        session however the stream ends.
    Draft(session, k, verdict)    exact mode: apply the exact worker's verdict, then K drafts that
        follow the pending token; DraftMany: many sessions' Drafts in one RPC (decode_worker/draft_calls.py)
    Release / GetStats
A background thread reaps sessions idle longer than the TTL. One RPC at a time per session (ABORTED
otherwise); Release of a busy session takes effect when its call ends.

Status codes: unknown session -> NOT_FOUND; bad field -> INVALID_ARGUMENT naming it (engine mismatch
included); the session's window cannot hold the request -> OUT_OF_RANGE; no free slot ->
RESOURCE_EXHAUSTED; bad state stream -> its wire.StateError code (DATA_LOSS corrupt/truncated,
FAILED_PRECONDITION foreign model/format, INVALID_ARGUMENT table/position).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time

import grpc
import torch

from baton import grammar, hidden_rows, sampling_rules, stalls, thread_cpu
from baton.engine.pages import fill_capacity
from baton.engine.sampling import Params
from baton.handoff import timeline
from baton.handoff.admission import ADMITTED
from baton.handoff.receive import layout_of, peek_header, receive_state
from baton.names import engine_name
from baton.rpc import StatusError
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from baton.worker.servicer import ServicerBase, window_field
from decode_worker.call_waits import CallWaits
from decode_worker.draft_calls import DraftCalls
from decode_worker.engine import DecodeEngine
from decode_worker.pacing import MessagePace

log = logging.getLogger("baton.decode")
SERVICE = "baton.v1.DecodeWorker"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
DEFAULT_MTP_K = 4
MAX_IDS = 1024  # stop_token_ids per Decode (the router sends at most 64)


class DecodeServicer(DraftCalls, ServicerBase, decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        engine: DecodeEngine,
        *,
        fingerprint: str,
        settings: Settings | None = None,
        eos_ids: tuple[int, ...] | None = None,
        mtp_k: int = DEFAULT_MTP_K,
        reap_interval_s: float = 2.0,
    ):
        super().__init__(engine, reap_interval_s=reap_interval_s)
        self.fingerprint = fingerprint
        self.settings = Settings() if settings is None else settings
        runner = next(iter(engine.runners.values()))
        self.vocab = runner.cfg.vocab_size
        self.eos_ids = tuple(runner.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.mtp_k = mtp_k
        self.pace = MessagePace(self.settings.stream_messages_per_s)  # Decode streams' messages a second
        self.waits = CallWaits()  # what a Decode call waits for before its first message (WorkerStats decode_*_s)

    # ---- helpers ---------------------------------------------------------------------------------
    def close(self) -> None:
        super().close()
        self.engine.close()  # the step scheduler's thread

    def _session(self, sid: str, engine: int):
        """The session, checking the request's engine (UNSPECIFIED = whatever the session was loaded as)."""
        s = self.engine.get(sid)
        want = engine_name(engine)
        if want is not None and want != s.engine:
            raise StatusError(INVALID, f"engine: session {sid!r} was loaded for {s.engine}, not {want}")
        return s

    @staticmethod
    def _hidden(s, request):
        """The verdict's hidden rows [accepted + 1, hidden] (CPU), or None when not sent."""
        if not request.HasField("verdict_hidden"):
            return None
        h = s.runner.state.hidden
        try:
            return hidden_rows.decode(request.verdict_hidden, request.accepted + 1, h.shape[-1], h.dtype)
        except ValueError as e:
            raise StatusError(INVALID, str(e)) from None

    def _ids(self, field: str, ids) -> list[int]:
        if len(ids) > MAX_IDS:  # NOTE: before scanning: a 64 MiB message holds ~60M ids
            raise StatusError(INVALID, f"{field}: {len(ids)} ids; at most {MAX_IDS}")
        bad = [t for t in ids if t >= self.vocab]
        if bad:
            raise StatusError(INVALID, f"{field}: token id {bad[0]} out of range [0, {self.vocab})")
        return list(ids)

    def _set_sampling(self, s, request, proposing: bool = False, fresh: bool = True) -> None:
        """The session's sampling parameters for this call, on its runner's table (absent = greedy).
        proposing (Draft): a REJECTION-policy session's drafts come from the cut q', recorded.
        request.history (penalties): the tokens of the loaded state's positions, accepted only on a call
        that starts from the loaded state (fresh: not a Draft with a verdict)."""
        p = None
        if request.HasField("sampling"):
            sampling_rules.check(request.sampling, stops=False, vocab=s.runner.cfg.vocab_size)  # names the field
            p = Params.from_proto(request.sampling)
        table = s.runner.sampling
        if request.HasField("history"):
            h = request.history
            pos = int(s.runner.state.position[s.slot])
            if not fresh:
                raise StatusError(INVALID, "history: only on the first Draft after LoadState (has_verdict false)")
            if len(h.token_ids) != pos:  # NOTE: before list(): at most the window
                raise StatusError(
                    INVALID, f"history.token_ids: {len(h.token_ids)} ids; the session's state holds {pos}"
                )
            ids = list(h.token_ids)
            bad = [t for t in ids if t >= self.vocab]
            if bad:
                raise StatusError(INVALID, f"history.token_ids: token id {bad[0]} out of range [0, {self.vocab})")
            table.history.load(s.slot, ids, h.generated_from)  # ValueError naming history.generated_from
        if p is not None and p.constrained and proposing:  # exact mode's drafts: masked while its grammar is known
            p = self._draft_grammar(s, request, p, fresh)  # (DraftCalls: structured dropped without one)
        table.set(s.slot, p, proposing=proposing)

    def _masker(self, s, request):
        """A structured session's grammar masks (baton/grammar.py Masker), started from the generated tokens of
        the history the router sends with its first Decode and the pending token; None when unconstrained."""
        p = s.runner.sampling.params[s.slot]
        if not p.constrained:
            return None
        if not request.HasField("history"):
            raise StatusError(INVALID, "history: a structured session's Decode needs its token history")
        m = grammar.Masker(
            grammar.constraint(self.engine.grammars, p.structured, self.vocab), s.runner.sampling, s.slot
        )
        h, pending = request.history, int(s.runner.state.next_token[s.slot])
        m.start([*h.token_ids[h.generated_from :], pending], s.position() + 1)  # the first step picks position + 1
        return m

    # ---- RPCs ------------------------------------------------------------------------------------
    def LoadState(self, request_iterator, context):
        with self.call(context, "LoadState"):
            it = iter(request_iterator)
            first = next(it, None)
            t0 = time.perf_counter()  # first chunk received
            tl = timeline.Timeline({"decode": timeline.CLOCK_ID}) if timeline.asked(context) else None
            if tl is not None:
                tl.mark("decode.first_message")
                it = arrivals = timeline.Arrivals(it)
            header = peek_header(first)
            name = engine_name(header.engine) if header is not None else None
            runner = self.engine.runner_for(name)  # ValueError naming `engine`
            fill = (
                self.engine.reserve(name, header.session_id or None, header.position)  # not live yet
                if header is not None
                else None
            )
            if fill is not None:  # the slot is reserved: no refusal for full slots can come any more
                context.send_initial_metadata((ADMITTED,))  # the sender may let the first token go
            pinned = runner.device.type == "cuda"  # H2D straight from the receive buffers
            # NOTE: the session is held from the header on, so a Release that arrives while the state is
            # still streaming (a cancelled Prefill) is deferred to the end of this call and then finds
            # the committed session (or nothing, if the stream failed): it can never run first and miss it.
            sid = header.session_id if header is not None else ""
            place = fill.place if fill is not None else None
            if tl is not None and place is not None:

                def place(name, t, _place=place):
                    _place(name, t)
                    tl.mark("decode.last_tensor_placed")

            try:
                with self.sessions.hold(sid) if sid else contextlib.nullcontext():
                    got = receive_state(
                        itertools.chain((first,), it),
                        **layout_of(runner.state),
                        fingerprint=self.fingerprint,
                        alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pinned),
                        on_tensor=place,
                        draft_only_ok=(name or self.engine.default_engine) == "mtp",
                    )
                    if tl is not None:
                        tl.mark("decode.received")
                    s = self.engine.load(
                        got.tensors,
                        position=got.position,
                        next_token=got.next_token,
                        engine=name,
                        session_id=got.session_id or None,
                        fill=fill,
                        draft_only=got.draft_only,
                    )
                    if tl is not None:
                        if runner.device.type == "cuda":  # the slot's copies (and finish_import) done
                            torch.cuda.current_stream(runner.device).synchronize()
                        tl.mark("decode.loaded")
            except BaseException:
                if fill is not None:
                    fill.abort()
                raise
            if not context.is_active():  # the sender went away: nobody will use it
                self.engine.release(s.id)
                raise StatusError(grpc.StatusCode.CANCELLED, "LoadState: cancelled by the sender")
            got.stats.seconds = time.perf_counter() - t0
            resp = decode_pb2.LoadStateResponse(session_id=s.id, position=got.position, bridge=got.stats.to_proto())
            resp.bridge.draft_only = got.draft_only
            if tl is not None:
                data = arrivals.ns[:-1]  # NOTE: after the header: the data chunks, then the trailer
                tl.update({f"decode.{k}": v for k, v in got.marks.items()}, series={"decode.received": data})
                tl.update(
                    {"decode.trailer_received": arrivals.ns[-1], "decode.stream_closed": arrivals.closed}
                    | ({"decode.last_chunk_received": data[-1]} if data else {})
                )
                tl.mark("decode.reply")
                resp.bridge.timeline.CopyFrom(tl.to_proto())
            return resp

    def Decode(self, request, context):
        sid, held = request.session_id, False
        try:
            with self.call(context, "Decode"), self.sessions.hold(sid):
                held = True
                s = self._session(sid, request.engine)
                entered = self.waits.called(s.created if s.loaded_position is not None else None)
                n = request.max_new_tokens
                if n < 1:
                    raise StatusError(INVALID, "max_new_tokens: must be >= 1")
                if s.draft_only:  # its BF16 state stopped at its first verdict with hidden rows (drafting.py)
                    raise StatusError(
                        grpc.StatusCode.FAILED_PRECONDITION, f"session {sid!r} drafts for exact mode only"
                    )
                stop = set(self._ids("stop_token_ids", request.stop_token_ids))
                eos = set() if request.ignore_eos else set(self.eos_ids)
                self._set_sampling(s, request)
                masker = self._masker(s, request)
                table = s.runner.sampling
                rounds0, emitted0 = s.rounds, s.emitted_in_rounds
                gen = self.engine.decode(
                    sid, n, stop_ids=stop, eos_ids=eos, k=self.mtp_k, run_ahead=request.release_at_end, masker=masker
                )
                produced, finish = 0, common_pb2.FINISH_REASON_UNSPECIFIED
                # a run-ahead decode's tokens may wait for a shared message budget (decode_worker/pacing.py)
                ahead = self.engine.runs_ahead(s, request.release_at_end)
                paced = self.pace.stream() if ahead else contextlib.nullcontext(lambda: None)
                try:
                    self.waits.asked(entered)
                    with window_field("max_new_tokens"):  # the first next() checks the window
                        first = next(gen, None)
                    self.waits.first(entered)
                    with paced as wait:
                        for toks in itertools.chain([first] if first is not None else [], gen):
                            produced += len(toks)
                            last = toks[-1] if toks else None
                            finish = (
                                common_pb2.STOP
                                if last in stop
                                else common_pb2.EOS
                                if last in eos
                                else common_pb2.LENGTH
                                if produced >= n
                                else finish
                            )
                            msg = decode_pb2.DecodeResponse(token_ids=toks, finish_reason=finish)
                            if table.wants_logprobs(s.slot):  # the step that picked toks: rows 0..len-1
                                msg.logprobs.extend(
                                    sampling_rules.logprob_protos(table.logprobs(s.slot, len(toks)), toks)
                                )
                            if finish and s.engine == "mtp":
                                msg.mean_accept_len = _mean(s.rounds - rounds0, s.emitted_in_rounds - emitted0)
                            if not context.is_active():
                                return  # cancelled or deadline passed: stop within one step
                            yield msg
                            if finish:
                                break
                            wait()
                finally:
                    gen.close()
                if not finish:  # defensive: the engine ended without a stop condition
                    yield decode_pb2.DecodeResponse(finish_reason=common_pb2.LENGTH)
        finally:
            if request.release_at_end and held:
                self.sessions.release_or_defer(sid, lambda: self.engine.release(sid))

    def Release(self, request, context):
        with self.call(context, "Release"):
            sid = request.session_id
            return common_pb2.ReleaseResponse(
                released=self.sessions.release_or_defer(sid, lambda: self.engine.release(sid))
            )

    def stats(self) -> common_pb2.WorkerStats:
        return common_pb2.WorkerStats(
            sessions=self.engine.session_count(),
            session_bytes=self.engine.session_bytes(),
            outstanding=self.outstanding,
            engine=",".join(self.engine.offered()),
            model_fingerprint=self.fingerprint,
            max_len=self.engine.max_len,
            requests_total=self.requests_total,
            batched_rpcs=self.batched_rpcs,
            batched_items=self.batched_items,
            draft_only_states=True,  # LoadState takes StateHeader.draft_only (baton/handoff/receive.py)
        )

    def GetStats(self, request, context):
        out = self.stats()
        out.engines.extend(self.engine.offered())
        fill_capacity(out, self.engine.runners.values())
        self.engine.fill_step_stats(out, reset=request.reset_steps)
        self.waits.fill(out, reset=request.reset_steps)
        out.stall_s_p99, out.stall_s_max, out.stall_share = stalls.read(reset=request.reset_steps)
        out.thread_cpu_s.update(thread_cpu.read())
        return out


def _mean(rounds: int, emitted: int) -> float:
    return emitted / rounds if rounds else 0.0


def add_to_server(servicer: DecodeServicer, server: grpc.Server) -> None:
    """add_DecodeWorkerServicer_to_server, except that LoadState receives raw bytes: data frames go
    straight from the gRPC buffer into the receiver's tensors (no protobuf object, no extra copy)."""
    c = common_pb2
    h = {
        "LoadState": grpc.stream_unary_rpc_method_handler(
            servicer.LoadState,
            request_deserializer=None,
            response_serializer=decode_pb2.LoadStateResponse.SerializeToString,
        ),
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode,
            request_deserializer=decode_pb2.DecodeRequest.FromString,
            response_serializer=decode_pb2.DecodeResponse.SerializeToString,
        ),
        "Draft": grpc.unary_unary_rpc_method_handler(
            servicer.Draft,
            request_deserializer=decode_pb2.DraftRequest.FromString,
            response_serializer=decode_pb2.DraftResponse.SerializeToString,
        ),
        "DraftMany": grpc.unary_unary_rpc_method_handler(
            servicer.DraftMany,
            request_deserializer=decode_pb2.DraftManyRequest.FromString,
            response_serializer=decode_pb2.DraftManyResponse.SerializeToString,
        ),
        "Release": grpc.unary_unary_rpc_method_handler(
            servicer.Release,
            request_deserializer=c.ReleaseRequest.FromString,
            response_serializer=c.ReleaseResponse.SerializeToString,
        ),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats,
            request_deserializer=c.WorkerStatsRequest.FromString,
            response_serializer=c.WorkerStats.SerializeToString,
        ),
    }
    assert set(h) == set(decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].methods_by_name)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, h),))
    server.add_registered_method_handlers(SERVICE, h)
