"""One request's session: its stop conditions (Budget) and its start on a worker pair (start_session).

h = start_session(calls, ids, mode=..., engine=..., engine_name=..., exclude_decode=())
    pick prefill P + decode D (least outstanding work), PrefillStream(session, decode_target=D): the
    state goes P -> D directly; EXACT keeps the exact session on P; an EXACT mtp session's state is
    draft-only where draft_only_for says so (the hidden row and the MTP KV rows alone). A worker fault before the first
    token is retried once on another prefill worker (a dead decode target is excluded too). P sends
    heartbeats while the prompt waits or computes (HEARTBEATS_PER_TIMEOUT), which h skips.
    h.first_token is known as soon as P picks it, while the state may still be on its way to D;
h.landed()  waits for the state to land on D (the rest of the stream) -> P's whole PrefillResponse;
    call it before D is asked for the session (Decode, Draft). A failure here comes after the first
    token was sent: the caller recovers as from a decode worker lost mid-stream.
budget = Budget(max_new_tokens, stop_ids, eos_ids, ignore_eos)
toks, finish = budget.take(tokens)   # truncated after the first stop / EOS (inclusive) or at
                                     # max_new_tokens: every path reports the same finish_reason
stats = RunStats()                   # its counters (hand-offs, exact rounds), reported in the last message
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Iterator

import grpc

from baton.rpc import StatusError
from baton.v1 import common_pb2, prefill_pb2
from router.calls import Calls, Cancelled, WorkerFault, unavailable
from router.registry import NoWorker, Worker

log = logging.getLogger("baton.router")
C = grpc.StatusCode
# exact mode, mtp drafts: each Verify returns the kept rows' hidden rows and the next Draft relays them, so the
# decode worker's MTP head reads them instead of running those rows (decode_worker/drafting.py). "0": it runs
# them (the A/B of benchmarks/gpu_pending.sh spec-merged)
ENV_VERDICT_HIDDEN = "BATON_VERDICT_HIDDEN"
# ... and then the hand-offs of such a session ship a draft-only state: the hidden row and the MTP KV rows,
# none of the GDN or attention state its decode worker would never read (docs/CONTRACTS.md, "Draft-only
# states"). "0": the whole state (an A/B of the hand-off's bytes)
ENV_SLIM_HANDOFF = "BATON_SLIM_HANDOFF"


def verdict_hidden() -> bool:
    """Whether this router asks the exact worker for verdict hidden rows (mtp drafts): ENV_VERDICT_HIDDEN."""
    return os.environ.get(ENV_VERDICT_HIDDEN, "1") != "0"


def draft_only_for(mode: int, engine: int, d: Worker) -> bool:
    """Whether a hand-off to `d` asks for a draft-only state (PrefillRequest / ExportStateRequest.draft_only):
    an EXACT session drafted by the mtp engine, while this router relays verdict hidden rows (so d never runs
    that session's BF16 model; a Verify that still comes without them gets d the whole state again:
    router/exact.py, ExactLoop._refresh), ENV_SLIM_HANDOFF not "0", and d says its LoadState takes one."""
    return (
        mode == common_pb2.EXACT
        and engine == common_pb2.MTP
        and d.draft_only_states
        and verdict_hidden()
        and os.environ.get(ENV_SLIM_HANDOFF, "1") != "0"
    )


class Budget:
    """Stop conditions of one request over the tokens it emits (first token included)."""

    def __init__(self, max_new_tokens: int, stop_ids, eos_ids, ignore_eos: bool):
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(stop_ids)
        self.eos_ids = frozenset(() if ignore_eos else eos_ids)
        self.emitted: list[int] = []

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.emitted)

    def take(self, tokens) -> tuple[list[int], int | None]:
        """-> (tokens to send, FinishReason or None). Truncates after the first stop/EOS (inclusive)."""
        out: list[int] = []
        for t in tokens:
            if self.remaining <= 0:
                break
            t = int(t)
            out.append(t)
            self.emitted.append(t)
            if t in self.stop_ids:
                return out, common_pb2.STOP
            if t in self.eos_ids:
                return out, common_pb2.EOS
        return out, (common_pb2.LENGTH if self.remaining <= 0 else None)


@dataclass
class Handoff:
    """A prefilled session: P keeps it (exact mode) and D holds its state (once `landed`)."""

    session_id: str
    prefill: Worker
    decode: Worker
    response: prefill_pb2.PrefillResponse  # P's answer so far: the early one (no bridge) until landed()
    engine: int = 0  # the engine named in the Prefill (the request's, else D's default): P keeps it for ExportState
    rest: Iterator | None = field(default=None, repr=False)  # PrefillStream's messages still to come

    @property
    def first_token(self) -> int:
        return int(self.response.first_token)

    @property
    def pending(self) -> bool:
        """The state may still be on its way to D (landed() not returned yet)."""
        return self.rest is not None

    def landed(self) -> prefill_pb2.PrefillResponse:
        """Waits for P's last message (the state is on D) -> the whole PrefillResponse. Raises as the
        stream does (WorkerFault, StatusError, Cancelled)."""
        if self.rest is not None:
            rest, self.rest = self.rest, None
            for msg in rest:
                if not msg.heartbeat:
                    self.response = msg
        return self.response


def first_logprob(h: Handoff) -> list:
    """[TokenLogprob] of h's first token when the request asked for logprobs, else []."""
    return [h.response.first_logprob] if h.response.HasField("first_logprob") else []


def land(h: Handoff, record) -> None:
    """Waits for h's state to land on its decode worker; record(BridgeReport) once it has (call it once per
    Handoff, before D is first asked for the session). A failure (after the first token was sent) is a
    WorkerFault of the worker at fault: D when the hand-off to it failed (P names decode_target), else P;
    the client's deadline / cancel stay what they are."""
    try:
        resp = h.landed()
    except WorkerFault as e:
        if e.worker is h.prefill and "decode_target" in e.details:
            raise WorkerFault(h.decode, e.code, e.details) from None
        raise
    except StatusError as e:
        if e.code in (C.DEADLINE_EXCEEDED, C.CANCELLED):
            raise
        raise WorkerFault(h.decode if "decode_target" in e.message else h.prefill, e.code, e.message) from None
    record(resp.bridge)


def first_tokens(h: Handoff, calls: Calls, budget: Budget, record) -> tuple[list[int], int | None]:
    """h's first token through the budget -> (tokens, finish). When it ends the request (the caller stops at
    that batch), a hand-off still in flight is marked: its session may land on D after the Release."""
    toks, finish = budget.take([h.first_token])
    if finish is not None:
        if h.pending:
            calls.mark_uncertain(h.session_id)
        else:
            land(h, record)
    return toks, finish


def _prefill(calls: Calls, p: Worker, d: Worker, sid: str, req) -> Handoff:
    """P's PrefillStream: its first message now (the first token), the rest in Handoff.landed(). A prefill
    worker without it (UNIMPLEMENTED: an older build) gets the unary Prefill, from then on."""
    if p.prefill_stream:
        stream = calls.stream(p, "PrefillStream", req)
        try:
            first = next(stream)
            while first.heartbeat:  # the prompt is queued or computing: each one re-arms the stall check
                first = next(stream)
        except StopIteration:
            raise StatusError(C.INTERNAL, "prefill worker: PrefillStream ended without an answer") from None
        except StatusError as e:
            if e.code != C.UNIMPLEMENTED:
                raise
            p.prefill_stream = False
            log.info("prefill worker %s has no PrefillStream: using Prefill", p.address)
        else:
            return Handoff(sid, p, d, first, req.engine, rest=stream)
    return Handoff(sid, p, d, calls.unary(p, "Prefill", req), req.engine)


# PrefillStream asks for this many heartbeats per call timeout: a prompt queued behind others for longer than
# the timeout is not a stalled stream, while a worker whose passes stopped still goes silent (prefill_worker/heartbeat.py)
HEARTBEATS_PER_TIMEOUT = 3
FULL_HOLD_S = 2.0  # a decode worker that refused for full slots gets no new request for this long ...


def _note_full(w: Worker) -> None:
    w.full_at, w.full_until = max(0, w.outstanding - 1), time.monotonic() + FULL_HOLD_S  # - the refused one


def _full(w: Worker) -> bool:
    """... unless one of the requests we had on it ended (its slot is free again).
    NOTE: without this, every refused request cost a full Prefill plus a state hand-off: under 64
    clients (benchmarks/load.py) the refusals ate the CPU and starved the admitted streams."""
    return time.monotonic() < w.full_until and w.outstanding >= w.full_at


def _default_engine(d: Worker) -> int:
    """The engine d loads an UNSPECIFIED session as (its reported default), or UNSPECIFIED when unknown.
    Named explicitly in the Prefill, it lets the prefill worker leave out what that engine never reads
    (the MTP KV rows for bf16 / fp8: baton.handoff.policy.needs_mtp_kv); d loads the session the same way."""
    name = d.engines[0].upper() if d.engines else ""
    return common_pb2.Engine.Value(name) if name in common_pb2.Engine.keys() else common_pb2.ENGINE_UNSPECIFIED


PREFILL_PIECE = 8192  # baton/engine/prefill.py PREFILL_CHUNK (the router imports no torch; a test checks them equal):
# the piece a prefill worker that reports none cuts prompts into
PREFIX_SLACK = 4  # a prompt's prefix worker is passed over when it has this many more calls in flight than the least


def prefix_affinity(ids: list[int], salt: str = "", piece: int = PREFILL_PIECE) -> bytes:
    """The Registry.pick affinity of a prompt longer than one prefill piece: a digest of its first `piece`
    tokens (Registry.prefill_piece: the smallest the prefill workers cut prompts into), so prompts that begin
    alike go to the prefill worker whose prefix cache holds their first pieces (baton/engine/prefix_cache.py),
    unless it is PREFIX_SLACK calls busier than the least loaded. salt: the request's cache_salt (salted
    prompts meet where their own entries are)."""
    data = salt.encode() + b"\0" + array("i", ids[:piece]).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def start_session(
    calls: Calls,
    ids: list[int],
    *,
    mode: int,
    engine: int,
    engine_name: str | None,
    exclude_decode=(),
    exclude_prefill=(),
    retries: int = 1,
    decode_wait_s: float = 0.0,
    on_retry=None,
    sampling=None,
    generated: int = 0,
    timeline: bool = False,
    prompt_logprobs: int = -1,
    equal_prompts: int = 0,
    cache_salt: str = "",
) -> Handoff:
    """Prefill `ids` on a prefill worker with the state pushed to a decode worker.

    A worker fault before the first token is retried `retries` times on another prefill worker (the
    same one only when no other is up); a decode target that no longer answers its health check is
    excluded too (exclude_prefill / exclude_decode: workers to pass over from the start). A decode worker
    that refused for full slots is skipped (see _full); with every one full the request is
    RESOURCE_EXHAUSTED before any Prefill. decode_wait_s > 0 waits that long for a
    decode worker to come up (migration). sampling: the request's SamplingParams (seed resolved), which
    pick the first token (a re-prefill after a migration picks at the same positions with the same seed).
    equal_prompts: PrefillRequest.equal_prompts (the caller's equal prompts sent together; a hint); above 1
    the prefill worker is picked by the prompt (Registry.pick affinity), so the group meets on one.
    generated: the last `generated` ids were generated (a re-prefill): the penalties count them so.
    timeline: P reports the hand-off's marks (PrefillRequest.timeline) in the landed answer's bridge.
    prompt_logprobs >= 0: P's answer carries the prompt's logprobs (PrefillRequest.prompt_logprobs).
    cache_salt: PrefillRequest.cache_salt (the prompt's prefix-cache entries are keyed with it).
    Raises StatusError (UNAVAILABLE when no worker can serve), Cancelled."""
    reg = calls.registry
    bad_p: list[Worker] = list(exclude_prefill)  # passed over while another prefill worker is up
    bad_d: list[Worker] = list(exclude_decode)
    full_d: StatusError | None = None  # a decode target's refusal (its slots are full)
    group = tuple(ids) if equal_prompts > 1 else None  # equal prompts: one prefill worker computes them once
    slack, piece = None, reg.prefill_piece(PREFILL_PIECE)
    if group is None and len(ids) > piece:  # prompts that begin alike meet where their prefix is cached
        group, slack = prefix_affinity(ids, cache_salt, piece), PREFIX_SLACK
    for attempt in range(retries + 1):
        busy = [w for w in reg.up("decode") if _full(w) and w not in bad_d]
        try:
            try:
                p = reg.pick("prefill", exclude=bad_p, affinity=group, slack=slack)
            except NoWorker:
                p = reg.pick("prefill")
            d = reg.wait_pick("decode", engine_name, bad_d + busy, min(decode_wait_s, max(0.0, calls.remaining())))
        except NoWorker as e:
            if full_d is not None:
                raise full_d from None  # no other decode worker: the refusal stands (not UNAVAILABLE)
            if busy:  # refused here, before a Prefill and a hand-off are spent on it
                raise StatusError(
                    C.RESOURCE_EXHAUSTED,
                    f"decode workers: all session slots are in use ({len(busy)} full); retry later",
                ) from None
            raise unavailable(str(e)) from None
        sid = uuid.uuid4().hex
        calls.lease(p)
        calls.lease(d)
        calls.track(p, sid)
        calls.track(d, sid)
        req = prefill_pb2.PrefillRequest(
            session_id=sid,
            prompt_ids=ids,
            mode=mode,
            decode_target=d.address,
            engine=engine or _default_engine(d),
            sampling=sampling,
            generated_tokens=generated,
            heartbeat_ms=max(1, int(calls.call_timeout * 1e3 / HEARTBEATS_PER_TIMEOUT)),
            timeline=timeline,
            cache_salt=cache_salt,
        )
        req.draft_only = draft_only_for(mode, req.engine, d)
        req.equal_prompts = equal_prompts  # the caller's equal prompts sent together (a hint for the pass)
        if prompt_logprobs >= 0:
            req.prompt_logprobs = prompt_logprobs
        try:
            return _prefill(calls, p, d, sid, req)
        except StatusError as e:
            calls.mark_uncertain(sid)
            if e.code != C.RESOURCE_EXHAUSTED or attempt == retries:
                raise
            if "decode_target" in e.message:
                bad_d.append(d)  # the decode target's slots are full (the prefill worker names it)
                full_d = e
                _note_full(d)
            else:
                bad_p.append(p)  # the prefill worker's slots are full
        except Cancelled:
            calls.mark_uncertain(sid)
            raise
        except WorkerFault as e:
            calls.mark_uncertain(sid)
            log.warning("prefill attempt %d failed: %s", attempt + 1, e)
            if attempt == retries:
                raise unavailable(f"prefill failed after {retries + 1} attempts: {e}") from None
            bad_p.append(p)
            if not reg.probe(d):
                bad_d.append(d)
            if on_retry is not None:
                on_retry()
    raise AssertionError("unreachable")


@dataclass
class RunStats:
    """Per-request counters reported in the last GenerateResponse."""

    drafted: int = 0
    accepted: int = 0
    migrations: int = 0
    bridge_bytes: int = 0
    bridge_seconds: float = 0.0
    landed_at: float = 0.0  # time.monotonic() when the first state landed on a decode worker (0: never)
    timeline: object = None  # the first hand-off's common_pb2.HandoffTimeline, when asked for
    prompt_logprobs: list | None = None  # the Prefill's prompt logprobs, until the first message carries them
    rounds: int = 0  # exact mode: draft / verify rounds, and their calls' summed wall time (Stats.rounds ...)
    draft_s: float = 0.0
    verify_s: float = 0.0
    handoffs: int = 0  # state hand-offs, and how many of them were draft-only (Stats.handoffs ...)
    draft_only_handoffs: int = 0
    prefill: str = ""  # the session's workers (the last re-prefill's after a migration) and its engine, for the
    decode: str = ""  # request's log line (router/service.py)
    engine: int = 0  # common_pb2.Engine the Prefill named: the request's, else the decode worker's default
    cached_tokens: int = 0  # prompt tokens the first Prefill restored from its prefix cache (Usage.cached_tokens)
    mean_accept_len: float = 0.0  # fast mtp: the last Decode call's tokens a round (Stats.mean_accept_len)

    def bridge(self, report) -> None:
        self.handoffs += 1
        self.draft_only_handoffs += bool(report.draft_only)
        self.bridge_bytes += int(report.total_bytes)
        self.bridge_seconds += float(report.seconds)
        self.landed_at = self.landed_at or time.monotonic()
        if self.timeline is None and report.HasField("timeline"):
            self.timeline = report.timeline

    def fill(self, st, **extra) -> None:
        """Writes these counters (and `extra` fields) into a router_pb2.Stats."""
        st.migrations, st.bridge_bytes, st.bridge_seconds = self.migrations, self.bridge_bytes, self.bridge_seconds
        st.drafted, st.accepted = self.drafted, self.accepted
        st.rounds, st.draft_ms, st.verify_ms = self.rounds, 1e3 * self.draft_s, 1e3 * self.verify_s
        st.handoffs, st.draft_only_handoffs = self.handoffs, self.draft_only_handoffs
        st.mean_accept_len = self.mean_accept_len
        st.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        if self.timeline is not None:
            st.handoff_timeline.CopyFrom(self.timeline)
        for k, v in extra.items():
            setattr(st, k, v)
