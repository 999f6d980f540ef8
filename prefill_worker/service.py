"""gRPC service `baton.v1.PrefillWorker`: the exact BF16 worker's front door.

Lifecycle of a request:
    Prefill(prompt_ids, session_id, mode, decode_target, engine)
        validate (INVALID_ARGUMENT naming `prompt_ids` / `session_id` / `mode` / `engine`)
        -> ExactEngine.open_prefill: a fresh session (EXACT: the caller's id, required; FAST: any)
        -> with decode_target: start_push to its LoadState first (header: everything known before the
           compute; settings.handoff_sender "process": streamed by the worker's sender child process,
           baton/handoff/sender/process.py, this process only stages the bytes; settings.handoff_tail_chunk_bytes:
           the last handoff_tail_layers layers' bytes in smaller chunks, wire format 4), then
           ExactEngine.run_prefill, whose layer hook marks each layer's state final so the sender streams
           it while later layers compute; the first token goes in the trailer. The decode worker
           activates nothing before the whole stream verified. Under this RPC's deadline
        -> prefill_seconds: until the first token is known; bridge.seconds: stream start -> LoadState
           answered (it overlaps prefill_seconds); with `timeline` (and a decode_target): bridge.timeline,
           the hand-off's marks in this process, its sender child and the decode worker (baton/handoff/timeline.py)
        -> FAST: release the session (always); EXACT: keep it for Verify (released on any failure,
           including a cancelled or timed-out call, except a hand-off that failed after PrefillStream's early
           answer: the router moves the session with ExportState, and the TTL reaps it if nobody does)
        -> first_token (the decode state's pending next_token), bridge, prompt_tokens, prefill_seconds,
           prompt_logprobs when asked; PrefillStream: the first token early (after heartbeats if asked)
    Verify(session_id, [last committed, d1..dK])  -> accepted m, next token, position, counters; VerifyMany:
        many sessions' Verifys in one RPC (prefill_worker/verify_calls.py)
    ExportState(session_id, decode_target)        -> re-stream a kept session (migration)
    draft_only (Prefill EXACT / ExportState, engine MTP): the hand-off ships the hidden row and the MTP KV
        rows alone (baton/handoff/policy.py: DRAFT_ONLY_NAMES; StateHeader.draft_only), where the state has them
    Release(session_id) / GetStats
A background thread reaps sessions idle for longer than the engine's TTL. Status codes: bad field ->
INVALID_ARGUMENT (a decode_target that is not HOST:PORT, a prompt too long for the window included);
unknown/released session -> NOT_FOUND; no free slot -> RESOURCE_EXHAUSTED; a Verify block that no longer
fits the window -> OUT_OF_RANGE; a session already in use by another call -> ABORTED; hand-off failure
-> the decode worker's status (UNAVAILABLE when it is down), message naming the target.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from baton import sampling_rules, stalls, thread_cpu
from baton.engine.gather import fill_stats
from baton.engine.pages import fill_capacity
from baton.engine.sampling import Params
from baton.handoff.channels import ChannelPool
from baton.handoff.policy import DRAFT_ONLY_NAMES, computes_mtp_kv, needs_mtp_kv, shipped
from baton.handoff.push import HandoffError, start_push
from baton.handoff.sender.process import SenderProcess
from baton.handoff.wire import DEFAULT_CHUNK_BYTES, check_chunk_bytes
from baton.names import engine_name
from baton.rpc import StatusError
from baton.settings import Settings
from baton.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from baton.worker.servicer import ServicerBase
from prefill_worker import heartbeat
from prefill_worker.checks import check_draft_only, check_tail_chunk_bytes, check_target
from prefill_worker.engine import ExactEngine
from prefill_worker.verify_calls import VerifyCalls

log = logging.getLogger("baton.prefill")
SERVICE = "baton.v1.PrefillWorker"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
_GONE = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)  # the Prefill caller went away
_RETRY_RELEASE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
RELEASE_ATTEMPTS = 3


class PrefillServicer(VerifyCalls, ServicerBase, prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        engine: ExactEngine,
        *,
        fingerprint: str,
        settings: Settings | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        handoff_timeout_s: float = 120.0,
        reap_interval_s: float = 2.0,
    ):
        self.settings = Settings() if settings is None else settings
        check_chunk_bytes(chunk_bytes, self.settings.max_message_bytes)  # NOTE: before any thread starts
        self.tail_chunk_bytes, self.tail_layers = (
            check_tail_chunk_bytes(self.settings, chunk_bytes),
            self.settings.handoff_tail_layers,
        )
        super().__init__(engine, reap_interval_s=reap_interval_s)
        self.fingerprint, self.chunk_bytes = fingerprint, chunk_bytes
        self.handoff_timeout_s, self.handoffs_done = handoff_timeout_s, 0
        self.channels = ChannelPool()  # one channel per decode worker, LRU-bounded (DEFAULT_MAX_CHANNELS)
        # "process": hand-offs are streamed by a sender child process (this process only stages bytes)
        self.sender = (
            SenderProcess(slots=self.settings.handoff_ring_slots, slot_bytes=max(chunk_bytes, DEFAULT_CHUNK_BYTES))
            if self.settings.handoff_sender == "process"
            else None
        )

    def close(self) -> None:
        super().close()
        self.channels.close()
        if self.sender is not None:
            self.sender.close()

    # ---- helpers ---------------------------------------------------------------------------------
    def _validate(self, r: prefill_pb2.PrefillRequest) -> tuple[list[int], bool]:
        n, runner = len(r.prompt_ids), self.engine.runner
        if not n:
            raise StatusError(INVALID, "prompt_ids: empty prompt")
        if n + runner.width > runner.max_len:  # NOTE: before list(): a 64 MiB message holds ~60M ids
            raise StatusError(
                INVALID,
                f"prompt_ids: {n} tokens do not fit the window of "
                f"{runner.max_len} tokens (at most {runner.max_len - runner.width})",
            )
        ids = list(r.prompt_ids)
        runner.check_ids(ids, "prompt_ids")
        if r.decode_target:
            check_target(r.decode_target)
        if r.mode not in (common_pb2.MODE_UNSPECIFIED, common_pb2.FAST, common_pb2.EXACT):
            raise StatusError(INVALID, f"mode: unknown value {r.mode}")
        engine_name(r.engine)  # ValueError naming `engine`
        if r.HasField("sampling"):
            sampling_rules.check(r.sampling, stops=False, vocab=self.engine.runner.cfg.vocab_size)  # names it
        exact = r.mode == common_pb2.EXACT
        if exact and not r.session_id:
            raise StatusError(INVALID, "session_id: required for EXACT mode (Verify addresses the session by it)")
        check_draft_only(r.draft_only, r.mode, r.engine)
        return ids, exact

    def _start_push(
        self,
        context,
        sid: str,
        target: str,
        *,
        mode: int,
        engine: int,
        target_sid: str,
        position: int | None = None,
        progress=None,
        timeline: bool = False,
        mtp_kv: bool = True,
        draft_only: bool = False,
    ):
        """Starts streaming the session `sid` to `target` (with `progress`: while its prefill runs);
        -> (handoff.Push, position, next_token | None). timeline: the push stamps baton/handoff/timeline.py's marks.
        mtp_kv=False leaves out the MTP layer's KV rows (the receiver zero-fills them: baton/handoff/);
        draft_only: a draft-only state, where this worker's state has an MTP layer (else the whole state)."""
        draft_only = draft_only and self.engine.runner.state.mtp_layer is not None
        tensors, pos, nxt = self.engine.export(sid, position, DRAFT_ONLY_NAMES if draft_only else None)
        tensors = shipped(tensors, mtp_kv)  # draft-only: EXACT mtp, so mtp_kv and the export is all shipped
        timeout = min(context.time_remaining(), self.handoff_timeout_s)
        push = start_push(
            target,
            self.settings,
            tensors=tensors,
            session_id=target_sid,
            fingerprint=self.fingerprint,
            position=pos,
            next_token=nxt,
            mode=mode,
            engine=engine,
            chunk_bytes=self.chunk_bytes,
            timeout=timeout,
            pool=self.channels,
            progress=progress,
            sender=self.sender,
            tail_chunk_bytes=self.tail_chunk_bytes,
            tail_layers=self.tail_layers,
            timeline=timeline,
            draft_only=draft_only,
        )
        return push, pos, nxt

    def finish_push(self, context, push):
        """-> (LoadStateResponse, BridgeReport); a failed hand-off is the decode worker's status."""
        try:
            return push.result(context.is_active)
        except HandoffError as e:
            raise StatusError(e.code, f"decode_target {push.target}: hand-off failed: {e.details}") from None
        finally:
            self.handoffs_done += 1  # progress for the heartbeats of the hand-offs still waiting

    def _release_remote(self, target: str, sid: str, attempts: int = RELEASE_ATTEMPTS, backoff_s: float = 0.2) -> None:
        """Best effort: the caller went away after the decode worker loaded (or while it loads) the state.
        A Release lost to a busy or restarting worker would leave the session there until its TTL, so a
        transient failure is retried (backoff_s, then doubling); NOT_FOUND (never loaded) ends it."""
        from baton.v1 import decode_pb2_grpc

        with self.channels.lease(target, self.settings) as channel:  # NOTE: never evicted under the retries
            stub = decode_pb2_grpc.DecodeWorkerStub(channel)
            for i in range(attempts):
                try:
                    stub.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=5)
                    return
                except grpc.RpcError as e:
                    if e.code() not in _RETRY_RELEASE or i + 1 == attempts:
                        msg = "release of %s on %s after a cancelled Prefill failed (attempt %d): %s"
                        log.warning(msg, sid, target, i + 1, e.code())
                        return
                    time.sleep(backoff_s * 2**i)

    @staticmethod
    def _ended(context) -> StatusError:
        if context.time_remaining() <= 0:
            return StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "Prefill: deadline exceeded")
        return StatusError(grpc.StatusCode.CANCELLED, "Prefill: cancelled by the client")

    # ---- RPCs ------------------------------------------------------------------------------------
    def Prefill(self, request, context):
        *_, last = self._prefill(request, context, early=False)  # one message: the whole answer
        return last

    def PrefillStream(self, request, context):
        """Prefill with the first token sent at once (docs/CONTRACTS.md, "Early first token")."""
        yield from self._prefill(request, context, early=True)

    def _prefill(self, request, context, early: bool):
        """Yields Prefill's answer: with early=True, first (while the hand-off is still in flight at the
        pick) the same answer without its bridge, as soon as the first token is picked; then the whole
        answer once the state has landed. A client gone after the early answer (the generator closed at
        its yield) cancels the hand-off and releases the session on both sides."""
        with self.call(context, "Prefill"):
            t0, t0_ns = time.perf_counter(), time.monotonic_ns()
            with self.engine.arriving():  # a pass being gathered waits for this prompt too
                ids, exact = self._validate(request)
                sid = request.session_id or uuid.uuid4().hex
                sampling = Params.from_proto(request.sampling) if request.HasField("sampling") else None
                plp = request.prompt_logprobs if request.HasField("prompt_logprobs") else -1
                session = self.engine.open_prefill(
                    ids,
                    session_id=sid,
                    sampling=sampling,
                    generated=request.generated_tokens,
                    prompt_logprobs=plp,
                    equal=request.equal_prompts,
                    cache_salt=request.cache_salt,
                )
            session.engine = request.engine  # ExportState re-sends with the same engine
            keep, target = False, request.decode_target
            mtp = computes_mtp_kv(exact, request.engine, bool(target))
            try:
                with self.sessions.hold(sid):
                    if not context.is_active():
                        raise self._ended(context)
                    bridge, beat_ms = common_pb2.BridgeReport(), request.heartbeat_ms if early else 0
                    if not target:
                        first = yield from heartbeat.prefill(self.engine, beat_ms, session, ids, mtp=mtp)
                        prefill_s = time.perf_counter() - t0
                        if not context.is_active():  # NOTE: an EXACT session nobody will Verify
                            raise self._ended(context)
                        lps = self.engine.last_logprobs(sid, 1)
                    else:
                        # NOTE: the stream starts before the compute: each layer goes out once it is done
                        progress = self.engine.progress()
                        push, _, _ = self._start_push(
                            context,
                            sid,
                            target,
                            mode=request.mode,
                            engine=request.engine,
                            target_sid=sid,
                            position=len(ids),
                            progress=progress,
                            timeline=request.timeline,
                            mtp_kv=needs_mtp_kv(request.engine),
                            draft_only=request.draft_only,
                        )
                        try:
                            first = yield from heartbeat.prefill(self.engine, beat_ms, session, ids, progress, mtp=mtp)
                        except BaseException as e:
                            push.cancel()
                            if isinstance(e, GeneratorExit):  # gone at a heartbeat: D may hold it already
                                self._release_remote(target, sid)
                            raise
                        prefill_s = time.perf_counter() - t0  # to the first token
                        lps = self.engine.last_logprobs(sid, 1)
                        if push.timeline is not None:
                            push.timeline.update(
                                {
                                    "prefill.rpc_start": t0_ns,
                                    "prefill.last_layer_enqueued": progress.last_layer_ns,
                                    "prefill.compute_end": progress.finished_ns,
                                }
                            )
                        answered = False
                        try:
                            if early and push.admitted(context.is_active):
                                # the decode worker reserved the slot (it can no longer refuse for full slots,
                                # which must fail the call before any token: the router tries another one)
                                answered = True
                                yield self._answer(first, None, ids, prefill_s, lps, session)
                            if not context.is_active():  # gone during the compute: stop the stream now
                                push.cancel()
                            _, bridge = yield from heartbeat.landing(self, context, push, beat_ms)
                        except (StatusError, GeneratorExit) as e:  # GeneratorExit: the client left at a yield
                            if isinstance(e, GeneratorExit) or e.code in _GONE:  # it may have landed already
                                push.cancel()
                                self._release_remote(target, sid)
                            else:  # D failed after the first token: the router moves S by ExportState
                                keep = exact and answered  # (router.exact: migrate); else the TTL reaps it
                            raise
                        if not context.is_active():
                            self._release_remote(target, sid)
                            raise self._ended(context)
                    keep = exact
            finally:
                if not keep:
                    self.engine.release(sid)
            yield self._answer(first, bridge, ids, prefill_s, lps, session)

    @staticmethod
    def _answer(first: int, bridge, ids, prefill_s: float, lps, session) -> prefill_pb2.PrefillResponse:
        """A PrefillResponse; bridge None: the early answer (the hand-off still in flight). session: the prompt's
        logprobs and its tokens restored from the prefix cache."""
        resp = prefill_pb2.PrefillResponse(
            first_token=first, prompt_tokens=len(ids), prefill_seconds=prefill_s, cached_tokens=session.cached_tokens
        )
        plps = session.prompt_logprobs
        if bridge is not None:
            resp.bridge.CopyFrom(bridge)
            if bridge.HasField("timeline"):
                resp.bridge.timeline.marks_ns["prefill.rpc_reply"] = time.monotonic_ns()
        if lps:
            resp.first_logprob.CopyFrom(sampling_rules.logprob_protos(lps, [first])[0])
        resp.prompt_logprobs.extend(sampling_rules.logprob_protos(plps, ids[1:]))  # tokens 1 .. n-1 of the prompt
        return resp

    def Release(self, request, context):
        with self.call(context, "Release"):
            sid = request.session_id
            return common_pb2.ReleaseResponse(
                released=self.sessions.release_or_defer(sid, lambda: self.engine.release(sid))
            )

    def ExportState(self, request, context):
        with self.call(context, "ExportState"), self.sessions.hold(request.session_id):
            kept = self.engine.get(request.session_id)  # NOT_FOUND first
            if not request.decode_target:
                raise StatusError(INVALID, "decode_target: required")
            check_target(request.decode_target)
            check_draft_only(request.draft_only, common_pb2.EXACT, kept.engine)
            push, pos, nxt = self._start_push(
                context,
                request.session_id,
                request.decode_target,
                mode=common_pb2.EXACT,
                engine=kept.engine,
                target_sid=request.target_session_id or request.session_id,
                draft_only=request.draft_only,
            )
            _, bridge = self.finish_push(context, push)
            return prefill_pb2.ExportStateResponse(bridge=bridge, position=pos, next_token=nxt)

    def stats(self) -> common_pb2.WorkerStats:
        return common_pb2.WorkerStats(
            sessions=self.engine.session_count(),
            session_bytes=self.engine.session_bytes(),
            outstanding=self.outstanding,
            engine="exact",
            model_fingerprint=self.fingerprint,
            max_len=self.engine.runner.max_len,
            prefill_piece=self.engine.runner.prefill_chunk,
            requests_total=self.requests_total,
            batched_rpcs=self.batched_rpcs,
            batched_items=self.batched_items,
        )

    def GetStats(self, request, context):
        out = self.stats()
        fill_stats(out, (self.engine.verifies,))
        t = self.engine.pass_totals
        out.prefill_passes, out.prefill_pieces, out.prefill_tokens, out.prefill_pass_s = t
        out.stall_s_p99, out.stall_s_max, out.stall_share = stalls.read()
        out.thread_cpu_s.update(thread_cpu.read())
        fill_capacity(out, (self.engine.runner,))
        if self.engine.prefix is not None:
            pc = self.engine.prefix.stats()
            out.prefix_cache_entries, out.prefix_cache_pages = pc["entries"], pc["pages"]
            out.prefix_cache_hits, out.prefix_cache_tokens = pc["hits"], pc["tokens_reused"]
            out.prefix_cache_evicted, out.prefix_cache_reclaimed = pc["evicted"], pc["reclaimed"]
        return out
