"""RouterServicer: the public `baton.v1.Router` (Generate, GetModelInfo).

Lifecycle of a Generate request:
    admit      past `max_inflight` requests in flight -> RESOURCE_EXHAUSTED at once
    validate   router/validate.py plan_request: INVALID_ARGUMENT naming the field (prompt, token_ids,
               max_new_tokens, mode, engine, draft_block, stop_token_ids, request_id, sampling.<field>);
               text prompts are tokenized there; a request without a seed gets a random one (returned in
               Stats.seed); no prefill or no decode worker up -> UNAVAILABLE
    line       the workers' session slots full: the request waits for a slot, by priority (lower first),
               then first come first served, at
               most RouterConfig.queue_s (--queue-timeout: 30 s; RouterConfig's own default 0: none;
               router/slot_line.py), then RESOURCE_EXHAUSTED
    hand-off   start_session: PrefillStream on P with decode_target=D, the state goes P -> D; the
               first token is sent as soon as P picks it, while the state may still be on its way
               (a failure before it is retried once on another prefill worker; a hand-off that fails
               after it is recovered as a decode worker lost mid-stream: FAST re-prefills prompt +
               the first token, EXACT exports the state again)
    relay      FAST: D's Decode stream (max_new_tokens - 1 tokens after the first); if D dies, the
                     prompt + tokens sent so far are re-prefilled on a fresh session and another
                     decode worker: nothing is lost or repeated
               EXACT: router.exact.ExactLoop (Draft on D / Verify on P; migration by ExportState; a lost
                     exact worker: prompt + tokens sent re-prefilled on another, as FAST does)
    finish     the last message carries finish_reason, usage and stats; Release on P and D always
               (also when the client cancels: context callback -> downstream calls cancelled)
Every downstream call has a deadline no later than the client's. One JSON log line per request (`error`: the
message a failed one got; WARNING for SERVER_FAULTS). At shutdown router/drain.py cuts what is left. The HTTP
API calls Generate in process (router/http/bridge.py), with a context that has only time_remaining(),
add_callback() and abort(): Generate must use no other ServicerContext method. Exact mode's K per round:
RouterConfig.draft_length ("adaptive": baton/engine/draft_length.py; "fixed": the request's K every round).

Status codes: INVALID_ARGUMENT (message starts with the field); RESOURCE_EXHAUSTED (past max_inflight,
or the workers' session slots stayed full for queue_s); UNAVAILABLE (no worker up, Prefill failed twice, workers
kept failing past RouterConfig.max_migrations); DEADLINE_EXCEEDED / CANCELLED (the
client's); OUT_OF_RANGE (a worker's window); INTERNAL (a worker refused the router's token, or broke
the protocol); UNAUTHENTICATED (the client's token, checked by baton.rpc.AuthInterceptor).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Iterator

import grpc

from baton import sampling_rules
from baton.names import ENGINE_NAMES, ENGINE_VALUES, MODE_NAMES
from baton.rpc import StatusError, abort_with
from baton.v1 import common_pb2, decode_pb2, router_pb2, router_pb2_grpc
from router.calls import Calls, Cancelled, WorkerFault, unavailable
from router.config import ModelMeta, Plan, RouterConfig
from router.drain import SHUTTING_DOWN, Drain
from router.exact import ExactLoop
from router.metrics import RouterMetrics
from router.registry import Registry
from router.session import Budget, RunStats, first_logprob, first_tokens, land, start_session
from router.slot_line import SlotLine
from router.stops import TextStream
from router.validate import MAX_REQUEST_ID, plan_request

log = logging.getLogger("baton.router")
C = grpc.StatusCode
SERVER_FAULTS = (C.UNAVAILABLE, C.INTERNAL, C.UNKNOWN, C.DATA_LOSS)  # the request line is a WARNING, else INFO
__all__ = ["ModelMeta", "RouterConfig", "RouterServicer"]  # the first two live in router/config.py


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        registry: Registry,
        meta: ModelMeta,
        config: RouterConfig = RouterConfig(),
        metrics: RouterMetrics | None = None,
    ):
        self.registry, self.meta, self.config = registry, meta, config
        self.metrics = metrics or RouterMetrics()
        self._admit = threading.BoundedSemaphore(config.max_inflight)
        self.line = SlotLine(config.queue_s)  # new requests waiting for a session slot (router/slot_line.py)
        self.drain = Drain()  # the requests in flight, cut at shutdown (router/drain.py)
        self.metrics.watch_line(self.line)

    # ---- GetModelInfo ----------------------------------------------------------------------------
    def GetModelInfo(self, request, context):
        cfg, reg = self.config, self.registry
        engines = sorted(ENGINE_VALUES[e] for e in reg.engines() if e in ENGINE_VALUES)
        return router_pb2.ModelInfo(
            model_id=self.meta.model_id,
            fingerprint=reg.fingerprint(),
            max_context=reg.max_context(cfg.max_context),
            engines=engines,
            vocab_size=self.meta.vocab_size,
            eos_token_ids=self.meta.eos_ids,
            max_new_tokens_limit=cfg.max_new_tokens_limit,
            default_draft_block=cfg.default_draft_block,
            max_draft_block=cfg.width - 2,
        )

    # ---- Generate --------------------------------------------------------------------------------
    def Generate(self, request, context):
        t0 = time.monotonic()
        rec = {
            "request_id": request.request_id[:MAX_REQUEST_ID] or uuid.uuid4().hex,
            "mode": MODE_NAMES.get(request.mode, str(request.mode)),
            "engine": ENGINE_NAMES.get(request.engine, "default"),
            "tokens": 0,
            "migrations": 0,
        }
        if request.priority:  # (vLLM's; the slot line's order)
            rec["priority"] = request.priority
        if not self._admit.acquire(blocking=False):
            rec["error"] = f"router: {self.config.max_inflight} requests in flight (max_inflight); retry later"
            self._done(rec, t0, C.RESOURCE_EXHAUSTED)
            abort_with(context, C.RESOURCE_EXHAUSTED, rec["error"])
        self.metrics.inflight.inc()
        calls, status = None, C.UNKNOWN
        try:
            plan = self._validate(request, rec["request_id"])
            budget = self.config.request_timeout_s
            remaining = context.time_remaining()
            if remaining is not None:
                budget = min(budget, remaining)
            calls = Calls(self.registry, deadline=t0 + budget, call_timeout=self.config.call_timeout_s)
            if not self.drain.enter(calls):
                calls = None
                raise StatusError(C.UNAVAILABLE, SHUTTING_DOWN)
            if not context.add_callback(calls.cancel):
                raise Cancelled()
            yield from self._relay(plan, calls, rec, t0)
            status = C.OK
        except StatusError as e:
            status = e.code
            rec["error"] = e.message
            abort_with(context, e.code, e.message)
        except (Cancelled, GeneratorExit) as e:
            status = C.CANCELLED
            if isinstance(e, Cancelled) and calls is not None and self.drain.cut(calls):  # stop_router cut it
                status, rec["error"] = C.UNAVAILABLE, SHUTTING_DOWN
                abort_with(context, status, SHUTTING_DOWN)
        except Exception as e:  # a router bug: gRPC answers UNKNOWN (HTTP: INTERNAL) and logs the traceback
            rec["error"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            if calls is not None:
                self.drain.leave(calls)
                calls.close()
                self.line.freed()  # its sessions are released: the head of the line may start
            self._admit.release()
            self.metrics.inflight.dec()
            self._done(rec, t0, status)

    def _done(self, rec: dict, t0: float, status: grpc.StatusCode) -> None:
        rec.update(status=status.name, ms=round((time.monotonic() - t0) * 1e3, 2))
        self.metrics.request_done(rec["mode"], status.name, rec["ms"] / 1e3)
        log.log(
            logging.WARNING if status in SERVER_FAULTS else logging.INFO, "request %s", json.dumps(rec, sort_keys=True)
        )

    def _validate(self, r: router_pb2.GenerateRequest, request_id: str) -> Plan:
        return plan_request(r, request_id, self.config, self.meta, self.registry)

    # ---- relay -----------------------------------------------------------------------------------
    def _relay(self, plan: Plan, calls: Calls, rec: dict, t0: float) -> Iterator[router_pb2.GenerateResponse]:
        budget = Budget(plan.max_new_tokens, plan.stop_ids, self.meta.eos_ids, plan.ignore_eos)
        stats = RunStats()
        # the text leaves special tokens out (an EOS's "<|im_end|>"), as HF decode(skip_special_tokens=True) and
        # OpenAI-style servers do, unless the request says otherwise; token_ids keep every id
        tk = self.meta.tokenizer
        decoder = tk.stream(skip_special_tokens=plan.skip_special) if tk is not None else None
        out = TextStream(decoder, plan.stops, plan.include_stop, plan.sampling.min_tokens)
        t_first = t_second = last = None
        rec["prompt_tokens"] = len(plan.prompt_ids)
        self.metrics.prompt_tokens.inc(len(plan.prompt_ids))
        gen = self._tokens(plan, calls, budget, stats)
        try:
            for toks, finish, lps in gen:
                now = time.monotonic()
                if t_first is None:
                    t_first = now
                    rec["ttft_ms"] = round((now - t0) * 1e3, 2)
                    self.metrics.first_token(rec["mode"], now - t0)
                elif t_second is None and toks:
                    t_second = now  # the first tokens after the hand-off
                text, kept = out.feed(toks)
                if kept < len(toks):  # a stop string ended the output at toks[kept - 1]
                    del budget.emitted[len(budget.emitted) - (len(toks) - kept) :]
                    toks = toks[:kept]
                if out.stopped:
                    finish = common_pb2.STOP
                elif finish is not None:
                    tail, hit = out.finish()
                    text += tail
                    finish = common_pb2.STOP if hit else finish
                self.metrics.tokens(rec["mode"], rec["engine"], len(toks), None if last is None else now - last)
                last = now
                msg = router_pb2.GenerateResponse(token_ids=toks, text=text, logprobs=lps[: len(toks)])
                if stats.prompt_logprobs is not None:  # the first message (the Prefill's answer)
                    msg.prompt_logprobs.extend(stats.prompt_logprobs)
                    stats.prompt_logprobs = None
                rec["tokens"], rec["migrations"] = len(budget.emitted), stats.migrations
                if finish is not None:
                    self._last(msg, plan, rec, stats, len(budget.emitted), finish, now, t_first, t_second)
                    msg.stop_string = out.matcher.matched or ""
                yield msg
                if finish is not None:
                    return
        finally:
            gen.close()  # a stop string: the downstream stream is cancelled (Calls.close releases)
            if stats.decode:  # the log line names the workers and the engine that ran (metrics keep the asked one)
                rec.update(
                    prefill=stats.prefill, decode=stats.decode, engine=ENGINE_NAMES.get(stats.engine, rec["engine"])
                )

    def _last(
        self, msg, plan: Plan, rec: dict, stats: RunStats, n_out: int, finish: int, now: float, t_first, t_second
    ):
        """Fills the last message: finish_reason, usage, stats (handoff_ms / first_decode_ms: the first
        token -> the state landed -> the next tokens, where the request got that far)."""
        msg.finish_reason = finish
        msg.usage.prompt_tokens, msg.usage.completion_tokens = len(plan.prompt_ids), n_out
        msg.usage.cached_tokens = rec["cached_tokens"] = stats.cached_tokens
        stats.fill(msg.stats, ttft_ms=rec["ttft_ms"], request_id=plan.request_id, seed=plan.sampling.seed)
        if stats.landed_at and t_first is not None:
            msg.stats.handoff_ms = max(0.0, stats.landed_at - t_first) * 1e3
            if t_second is not None:
                msg.stats.first_decode_ms = max(0.0, t_second - stats.landed_at) * 1e3
            rec["handoff_ms"] = round(msg.stats.handoff_ms, 2)
        if n_out > 1 and now > t_first:
            msg.stats.decode_tokens_per_s = (n_out - 1) / (now - t_first)
        rec.update(finish=common_pb2.FinishReason.Name(finish), drafted=stats.drafted, accepted=stats.accepted)
        if stats.mean_accept_len:  # fast mtp: its tokens a round, on the request's log line too
            rec["mean_accept_len"] = round(stats.mean_accept_len, 3)
        if plan.mode == common_pb2.EXACT:
            self.metrics.exact(rec["engine"], stats.drafted, stats.accepted)

    def _tokens(self, plan: Plan, calls: Calls, budget: Budget, stats: RunStats):
        """Yields (tokens, finish_reason | None, logprobs) batches; the batch with a finish_reason is the
        last. logprobs: TokenLogprob per token when the request asked (else empty)."""
        h = self.line.start(  # in line while the workers' session slots are full (router/slot_line.py)
            lambda: self._start(plan, calls, stats, prompt_logprobs=plan.prompt_logprobs),
            calls.deadline,
            lambda: calls.cancelled,
            priority=plan.priority,
        )
        if plan.prompt_logprobs >= 0:
            stats.prompt_logprobs = list(h.response.prompt_logprobs)
        toks, finish = first_tokens(h, calls, budget, self._record(stats))
        yield toks, finish, first_logprob(h)
        if finish is not None:
            return
        if plan.mode == common_pb2.EXACT:
            loop = ExactLoop.for_plan(
                calls,
                h,
                budget,
                stats,
                plan,
                self.config,
                on_migrate=lambda: self.metrics.migration("exact"),
                on_bridge=lambda b: self.metrics.bridge(b.total_bytes, b.seconds, b.draft_only),
                # the exact worker lost: prompt + sent re-prefilled elsewhere (router/exact.py, "Migration")
                restart=lambda sent, bad: self._start(plan, calls, stats, sent, exclude_prefill=bad),
            )
            yield from loop.run(h.first_token)  # lands h first: a failure migrates or restarts the session
            return
        attempts, sent = 0, []  # sent: what the decode worker's state was re-prefilled with (penalties)
        while True:
            req = decode_pb2.DecodeRequest(
                history=sampling_rules.history(plan.sampling, plan.prompt_ids + sent, len(plan.prompt_ids)),
                session_id=h.session_id,
                max_new_tokens=budget.remaining,
                stop_token_ids=plan.stop_ids,
                ignore_eos=plan.ignore_eos,
                engine=plan.engine,
                release_at_end=True,
                sampling=plan.sampling,
            )
            try:
                reason = None
                land(h, self._record(stats))  # the state is on D before D is asked for it
                for resp in calls.stream(h.decode, "Decode", req):
                    stats.mean_accept_len = resp.mean_accept_len or stats.mean_accept_len  # (its last message)
                    toks, finish = budget.take(resp.token_ids)
                    if toks or finish is not None:
                        yield toks, finish, list(resp.logprobs)
                    if finish is not None:
                        return
                    reason = resp.finish_reason or reason
                yield [], reason or common_pb2.LENGTH, []  # the worker stopped on a condition of its own
                return
            except WorkerFault as e:
                attempts += 1
                if attempts > self.config.max_migrations:
                    raise unavailable(f"decode workers failed {attempts} times: {e}") from None
                log.warning(
                    "request %s: decode worker failed (%s); re-prefilling %d + %d tokens",
                    plan.request_id,
                    e,
                    len(plan.prompt_ids),
                    len(budget.emitted),
                )
                # NOTE: the re-prefill's first token is the next token to send: nothing lost or repeated
                # NOT_FOUND: only the session is lost; a prefill worker's fault (its hand-off stream broke): D is fine
                gone = [] if e.code == C.NOT_FOUND or e.worker is not h.decode else [h.decode]
                sent = list(budget.emitted)
                h = self._start(plan, calls, stats, sent, exclude_decode=gone, decode_wait_s=self.config.migrate_wait_s)
                stats.migrations += 1
                self.metrics.migration("fast")
                toks, finish = first_tokens(h, calls, budget, self._record(stats))
                yield toks, finish, first_logprob(h)
                if finish is not None:
                    return

    def _start(self, plan: Plan, calls: Calls, stats: RunStats, sent=(), **kw):
        """Prefill of the prompt + `sent` (a re-prefill: those count as generated for the penalties, and the
        prefill worker replays them as AR rows). kw: start_session's exclude_decode, exclude_prefill,
        decode_wait_s, prompt_logprobs."""
        ids, timeline = plan.prompt_ids + list(sent), plan.timeline and stats.timeline is None
        kw |= dict(
            mode=plan.mode,
            engine=plan.engine,
            engine_name=plan.engine_name,
            sampling=plan.sampling,
            cache_salt=plan.cache_salt,
        )
        kw.setdefault("equal_prompts", 0 if sent else plan.equal_prompts)  # a re-prefill comes alone
        h = start_session(
            calls, ids, generated=len(sent), on_retry=self.metrics.prefill_retries.inc, timeline=timeline, **kw
        )
        stats.prefill, stats.decode, stats.engine = h.prefill.address, h.decode.address, h.engine
        if not sent:  # the request's own prefill (a re-prefill's restored tokens are not the prompt's)
            stats.cached_tokens = h.response.cached_tokens
        return h

    def _record(self, stats: RunStats):
        """-> a BridgeReport's recorder: the request's stats and the router's metrics."""

        def record(bridge) -> None:
            stats.bridge(bridge)
            self.metrics.bridge(bridge.total_bytes, bridge.seconds, bridge.draft_only)

        return record
