"""Exact mode: the draft/verify loop that makes fast drafts token-identical to exact greedy decoding.

Lifecycle of one exact request after its Prefill (docs/ARCHITECTURE.md, "An exact request"):
    committed = [first]                           (the router has already sent it)
    Draft(S, k, has_verdict=False)                -> d1..dk      decode worker D (fp8 / mtp / bf16)
    Verify(S, [pending, d1..dk])                  -> (m, next)   prefill worker P (the exact state)
    send d1..dm, next   (truncated after the first stop / EOS, and at max_new_tokens)
    Draft(S, k, has_verdict=True, accepted=m, next_token=next) -> the next drafts
    ...                                           the caller Releases S on P and D at the end
The next Draft is sent before the round's tokens are yielded (so it forms and runs while they go to the
client; BATON_DRAFT_PREFETCH=0: after), and abandoned if the caller stops reading.
Only verified tokens are ever sent, so the output is the exact engine's output whatever D drafts: its
greedy tokens, or (sampling) its own picks with the request's seed; D drafts with the same noise, so a
draft is accepted iff it equals the exact engine's pick at that position (issue 22, rule 3). With
sampling.exact_policy = REJECTION (T > 0) D also returns each draft's proposal q' (draft_probs), which
Verify judges by rejection sampling (baton/engine/rejection.py): exact in distribution only.

Migration: when D fails (dies, hangs, loses S), ExportState(S, decode_target=D') on P re-streams the
exact state (position, next_token = the pending token) to another decode worker and the loop goes on
with Draft(has_verdict=False): the output is unchanged. When P fails (its Verify, its ExportState, or the
first hand-off after the first token) the exact state is rebuilt: `restart` re-prefills prompt + every token
sent on another prefill worker (generated = those tokens, replayed as AR rows: bitwise the lost state,
prefill_worker/replay.py) with a fresh decode session (the old one on D is released); its
first token is the next one to send, and the loop goes on from it. Without `restart`: UNAVAILABLE.
Migrations and restarts together are bounded by max_migrations.

Draft-only states (mtp drafts relaying verdict hidden rows; router.session.draft_only_for): the first
hand-off and a migration's ExportState may ship only the hidden row and the MTP KV rows, since D drafts from
those and the relayed hidden rows alone. D's session is then draft_only, and so is one that applied a
verdict with hidden rows: it cannot apply a verdict without them. If a Verify comes back without hidden rows
all the same (an older exact worker), D gets the whole exact state again by ExportState (_refresh) and the
loop goes on with Draft(has_verdict=False); later migrations of the request ship whole states.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterator

import grpc

from baton import names, sampling_rules
from baton.engine.draft_length import FixedLength, controller
from baton.engine.speculation import check_verdict
from baton.rpc import StatusError
from baton.v1 import common_pb2, decode_pb2, prefill_pb2
from router import batcher
from router.calls import Calls, WorkerFault, unavailable
from router.registry import NoWorker
from router.session import Budget, Handoff, RunStats, draft_only_for, first_logprob, first_tokens, land, verdict_hidden

log = logging.getLogger("baton.router")
# "0": a round's Draft is sent after the previous round's tokens went to the client, not before (A/B runs)
PREFETCH_ENV = "BATON_DRAFT_PREFETCH"


class ExactLoop:
    def __init__(
        self,
        calls: Calls,
        handoff: Handoff,
        budget: Budget,
        stats: RunStats,
        *,
        k: int,
        engine: int,
        engine_name: str | None,
        migrate_wait_s: float = 3.0,
        max_migrations: int = 3,
        on_migrate: Callable[[], None] | None = None,
        on_bridge: Callable[[object], None] | None = None,
        sampling=None,
        draft_length=None,
        prompt_ids=(),
        restart: Callable[[list[int], list], Handoff] | None = None,
    ):
        # ExportState re-sends the engine the prefill worker kept from the Prefill, so a migration target
        # must offer that engine (the request's, else the first decode worker's default)
        self.export_engine = engine_name or names.engine_name(handoff.engine)
        self.calls, self.budget, self.stats = calls, budget, stats
        self.sid, self.exact, self.decode = handoff.session_id, handoff.prefill, handoff.decode
        self.k, self.engine, self.engine_name = k, engine, engine_name
        self.migrate_wait_s, self.max_migrations = migrate_wait_s, max_migrations
        self.on_migrate, self.on_bridge = on_migrate, on_bridge
        self._attempts = 0
        self.sampling = sampling  # SamplingParams (seed resolved): the drafts use the exact engine's noise
        # penalties: the tokens of the decode worker's loaded state, sent with the first Draft after a load
        self.prompt_ids, self.loaded = list(prompt_ids), list(prompt_ids)
        # K per round (baton/engine/draft_length.py): the request's K, or the adaptive controller's choice
        self.draft_length = draft_length if draft_length is not None else FixedLength(k)
        # restart(sent, exclude_prefill) -> a Handoff of prompt + sent (the exact worker was lost)
        self.restart = restart
        self._unlanded: Handoff | None = handoff  # run() lands it before the first Draft
        self._round = None  # the last Draft's DraftResponse.round, relayed with its Verify
        # D's session is draft-only (loaded so, or a verdict with hidden rows relayed since its last whole
        # load): a verdict without hidden rows cannot be applied there (_refresh)
        self.draft_only = False
        self.slim = True  # False once the exact worker sent no hidden rows: migrations then ship the whole state
        self._ahead: tuple | None = None  # (k, calls.Pending): the next round's Draft, sent before a yield
        self.prefetch = os.environ.get(PREFETCH_ENV, "1") != "0"

    @classmethod
    def for_plan(cls, calls, handoff, budget, stats, plan, config, **hooks) -> "ExactLoop":
        """The loop of a validated request (router.service.Plan) under the router's RouterConfig: K per
        round from config.draft_length (baton/engine/draft_length.py), the request's K as fixed K or prior."""
        k_max = min(config.max_adaptive_k, config.width - 2)
        s = plan.sampling
        # NOTE: a REJECTION session's tokens depend on which positions are drafts (its seeded replay
        # holds for one K schedule): K stays the request's, not timing-dependent
        policy = "fixed" if s.temperature > 0 and s.exact_policy == common_pb2.REJECTION else config.draft_length
        return cls(
            calls,
            handoff,
            budget,
            stats,
            k=plan.k,
            engine=plan.engine,
            engine_name=plan.engine_name,
            migrate_wait_s=config.migrate_wait_s,
            max_migrations=config.max_migrations,
            sampling=plan.sampling,
            draft_length=controller(policy, plan.k, k_max),
            prompt_ids=plan.prompt_ids,
            **hooks,
        )

    def run(self, pending: int) -> Iterator[tuple[list[int], int | None, list]]:
        """pending = the last committed token (already sent). Yields (tokens, finish_reason | None,
        logprobs: the exact engine's TokenLogprob per token, when asked)."""
        try:
            yield from self._rounds(pending)
        finally:  # however it ends: a Draft sent ahead is not waited for; the round batchers stop expecting S
            if self._ahead is not None:
                self.calls.abandon(self._ahead[1])
                self._ahead = None
            batcher.forget(self.sid, self.decode, self.exact)

    def _rounds(self, pending: int) -> Iterator[tuple[list[int], int | None, list]]:
        verdict: tuple | None = None  # (m, next, hidden rows or None) of the last Verify, for the next Draft
        if self._unlanded is not None:
            h, self._unlanded = self._unlanded, None
            try:
                land(h, self._record)  # the state is on D before D is asked for it
            except WorkerFault as e:
                pending, done = yield from self._recover(pending, e)
                if done:
                    return
        while True:
            try:
                if self._ahead is None:
                    if verdict is not None and verdict[2] is None and self.draft_only:
                        verdict = self._refresh(pending)  # None: the first Draft after a load
                    self._ahead = self._submit_draft(self._next_k(), verdict)
                (k, call), self._ahead = self._ahead, None
                drafts, probs = self._drafts(k, call)
                draft_s, t1 = call.seconds(), time.perf_counter()
                m, nxt, lps, hidden = self._verify(pending, drafts, probs)
            except WorkerFault as e:
                self.draft_length.forget_costs()  # another decode (or exact) worker: other costs
                verdict = None
                pending, done = yield from self._recover(pending, e)
                if done:
                    return
                continue
            verify_s = time.perf_counter() - t1
            self.draft_length.observe(k, m, draft_s, verify_s)
            self.stats.rounds += 1
            self.stats.draft_s += draft_s
            self.stats.verify_s += verify_s
            self.stats.drafted += k
            self.stats.accepted += m
            toks, finish = self.budget.take(drafts[:m] + [nxt])
            pending, verdict = nxt, (m, nxt, hidden)
            if finish is None and self.prefetch and not (hidden is None and self.draft_only):
                # the next round's Draft goes now, before this round's tokens are sent to the client: its batch
                # forms and runs while the tokens go out (run() abandons it if the client stops reading)
                self._ahead = self._submit_draft(self._next_k(), verdict)
            yield toks, finish, lps[: len(toks)]
            if finish is not None:
                return

    def _next_k(self) -> int:
        """The next round's K: the controller's, at most remaining - 1 (one block then yields at most the tokens
        still wanted), at least 1."""
        return max(1, min(self.draft_length.next_k(), self.budget.remaining - 1))

    def _submit_draft(self, k: int, verdict: tuple | None) -> tuple[int, object]:
        """Sends the Draft of k tokens (applying `verdict` first, when given) -> (k, its calls.Pending)."""
        req = decode_pb2.DraftRequest(
            session_id=self.sid, k=k, engine=self.engine, has_verdict=verdict is not None, sampling=self.sampling
        )
        if verdict is not None:
            req.accepted, req.next_token, hidden = verdict
            if hidden is not None:
                req.verdict_hidden.CopyFrom(hidden)
                self.draft_only = True  # D's session advances from hidden rows only from now on
        else:  # the first Draft after a load: a penalized session's history
            hist = sampling_rules.history(self.sampling, self.loaded, len(self.prompt_ids))
            if hist is not None:
                req.history.CopyFrom(hist)
        return k, self.calls.submit(self.decode, "Draft", req)  # with the round's other sessions (router/batcher.py)

    def _drafts(self, k: int, call) -> tuple[list[int], list]:
        """The submitted Draft's answer -> (k drafts, their q' when the REJECTION policy is on)."""
        resp = self.calls.answer(call)
        self._round = resp.round if resp.HasField("round") else None  # relayed with the Verify
        drafts = list(resp.draft_tokens)
        if len(drafts) != k:
            raise StatusError(grpc.StatusCode.INTERNAL, f"decode worker returned {len(drafts)} drafts for k={k}")
        # REJECTION policy: q' of each draft, relayed to the exact worker as is (empty otherwise)
        return drafts, list(resp.draft_probs)

    def _verify(self, pending: int, drafts: list[int], probs=()) -> tuple[int, int, list, object]:
        want = self.export_engine == "mtp" and verdict_hidden()
        req = prefill_pb2.VerifyRequest(
            session_id=self.sid, tokens=[pending, *drafts], draft_probs=probs, want_hidden=want, round=self._round
        )
        resp = self.calls.batched(self.exact, "Verify", req)  # a WorkerFault of P: run() restarts the session
        m = int(resp.accepted)
        try:
            check_verdict(m, len(drafts))
        except ValueError:
            raise StatusError(grpc.StatusCode.INTERNAL, f"exact worker accepted {m} of {len(drafts)} drafts") from None
        hidden = resp.hidden if want and resp.HasField("hidden") else None  # absent: an exact worker without them
        self.slim = self.slim and (hidden is not None or not want)
        if hidden is not None and hidden.rows != m + 1:
            raise StatusError(grpc.StatusCode.INTERNAL, f"exact worker sent {hidden.rows} hidden rows for m={m}")
        return m, int(resp.next_token), list(resp.logprobs), hidden

    def migrate(self, pending: int, fault: WorkerFault) -> None:
        """Moves S to another decode worker by ExportState from the exact worker (also when its first
        hand-off failed after the first token was sent: RouterServicer._tokens, router.session.land)."""
        # NOTE: a worker that only lost the session (NOT_FOUND) may take it back
        reg, dead = self.calls.registry, [] if fault.code == grpc.StatusCode.NOT_FOUND else [self.decode]
        log.warning("exact session %s: decode worker failed (%s); migrating", self.sid, fault)
        while True:
            self._attempts += 1
            if self._attempts > self.max_migrations:
                raise unavailable(f"decode workers failed {self._attempts - 1} times: {fault}")
            try:
                wait = min(self.migrate_wait_s, max(0.0, self.calls.remaining()))
                target = reg.wait_pick("decode", self.export_engine, exclude=dead, timeout=wait)
            except NoWorker as e:
                raise unavailable(f"cannot migrate: {e}") from None
            self.calls.lease(target)
            self.calls.track(target, self.sid)
            slim = self.slim and draft_only_for(common_pb2.EXACT, names.engine_value(self.export_engine), target)
            try:
                self._export(target, pending, slim)
            except WorkerFault as e:
                if not reg.probe(self.exact):
                    raise _ExactLost(WorkerFault(self.exact, e.code, e.details)) from None
                dead.append(target)  # the exact worker is fine: the new target failed the hand-off
                fault = e
                continue
            self.stats.migrations += 1
            if self.on_migrate is not None:
                self.on_migrate()
            return

    def _export(self, target, pending: int, draft_only: bool) -> None:
        """ExportState of S to `target` (its session of that id replaced, or made there) -> D; the next Draft
        starts from the exported state (has_verdict false). draft_only: a draft-only state (router.session:
        draft_only_for)."""
        req = prefill_pb2.ExportStateRequest(
            session_id=self.sid, decode_target=target.address, target_session_id=self.sid, draft_only=draft_only
        )
        resp = self.calls.unary(self.exact, "ExportState", req)
        if int(resp.next_token) != pending:
            raise StatusError(
                grpc.StatusCode.INTERNAL, f"exported next_token {resp.next_token} != pending token {pending}"
            )
        self.loaded = (self.prompt_ids + self.budget.emitted)[: int(resp.position)]  # the exported state's tokens
        if len(self.loaded) != int(resp.position) and sampling_rules.penalized(self.sampling):
            raise StatusError(
                grpc.StatusCode.INTERNAL,
                f"exported position {resp.position} is past the {len(self.loaded)} tokens sent so far",
            )
        self._record(resp.bridge)
        if target is not self.decode:
            batcher.forget(self.sid, self.decode)
        self.decode, self.stats.decode = target, target.address  # the request's log line names the one now
        # NOTE: ExportState re-sends the engine named in the Prefill (export_engine), which the new
        # worker offers; UNSPECIFIED = "as loaded" from now on. The output cannot change either way.
        self.engine = 0

    def _refresh(self, pending: int) -> None:
        """The exact worker sent a verdict without hidden rows (an older one), but D's session is draft-only
        (loaded so, or advanced by hidden rows alone): D cannot apply it, so D gets the whole exact state
        again by ExportState (draft_only false; its session replaced) and the next Draft starts from it. The
        tokens are the exact worker's either way; it costs one whole hand-off, and later migrations of this
        request ship whole states (self.slim). -> None: the next Draft's verdict. A failed ExportState is a
        fault of the exact worker if it fails its health probe, else of D (run() migrates or restarts)."""
        log.warning("exact session %s: a verdict without hidden rows for a draft-only session; re-exporting", self.sid)
        try:
            self._export(self.decode, pending, False)
        except WorkerFault as e:
            if not self.calls.registry.probe(self.exact):
                raise
            raise WorkerFault(self.decode, e.code, e.details) from None

    # ---- recovery ----------------------------------------------------------------------------------
    def _record(self, bridge) -> None:
        self.draft_only = bridge.draft_only  # a fresh load on D: draft-only or whole
        self.stats.bridge(bridge)
        if self.on_bridge is not None:
            self.on_bridge(bridge)

    def _recover(self, pending: int, fault: WorkerFault):
        """After `fault`: D's -> migrate (ExportState; the pending token stays); P's -> a restarted session
        (yields its first token's batch). Generator; returns (pending, finished)."""
        try:
            if fault.worker is not self.exact:
                self.migrate(pending, fault)
                return pending, False
        except _ExactLost as lost:
            fault = lost.fault
        while True:
            h, toks, finish, lps = self._restart(fault)
            yield toks, finish, lps
            if finish is not None:
                return pending, True
            try:
                land(h, self._record)
                return h.first_token, False
            except WorkerFault as e:
                if e.worker is not h.decode:
                    fault = e
                    continue
                try:
                    self.migrate(h.first_token, e)
                    return h.first_token, False
                except _ExactLost as lost:
                    fault = lost.fault

    def _restart(self, fault: WorkerFault):
        """Re-prefills prompt + every token sent on another prefill worker (module doc) -> (handoff, tokens,
        finish, logprobs) of its first token, taken through the budget."""
        self._attempts += 1
        if self.restart is None:
            raise unavailable(f"exact worker lost the session: {fault}")
        if self._attempts > self.max_migrations:
            raise unavailable(f"workers failed {self._attempts - 1} times: {fault}")
        sent = list(self.budget.emitted)
        log.warning(
            "exact session %s: exact worker failed (%s); re-prefilling %d + %d tokens",
            self.sid, fault, len(self.prompt_ids), len(sent),
        )  # fmt: skip
        self.calls.release(self.decode, self.sid)  # D's copy is stale: the re-prefill hands off a fresh one
        h = self.restart(sent, [fault.worker])
        batcher.forget(self.sid, self.decode, self.exact)
        self.sid, self.exact, self.decode = h.session_id, h.prefill, h.decode
        self.export_engine = self.engine_name or names.engine_name(h.engine)
        self.engine = 0  # as loaded: the Prefill named the engine
        self.loaded = self.prompt_ids + sent  # the new state's tokens (its pending token is the first)
        self.stats.migrations += 1
        if self.on_migrate is not None:
            self.on_migrate()
        toks, finish = first_tokens(h, self.calls, self.budget, self._record)
        return h, toks, finish, first_logprob(h)


class _ExactLost(Exception):
    """migrate() found the exact worker gone (its ExportState failed and it fails its health probe)."""

    def __init__(self, fault: WorkerFault):
        super().__init__(str(fault))
        self.fault = fault
