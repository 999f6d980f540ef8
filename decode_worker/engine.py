"""DecodeEngine: sessions decoded fast from a handed-over state, with bf16, fp8 or mtp.

Lifecycle of a request through this engine:
    load(engine, tensors, position, next_token)  -> a session in a free slot of that engine's runner
    decode(session, ...)   fast mode: yields token batches until EOS / stop id / max_new_tokens
        bf16 / fp8: every session's step together (baton/engine/scheduler.py, pipelined); opt-in,
                    each alone in the ping-pong pipelined loop (serve_decode(pipeline=True))
        mtp:        the MTP head drafts K tokens, the BF16 model checks them in one K+1-row pass;
                    row invariance makes the output token-identical to bf16
    draft(session, k, verdict)  exact mode: apply the exact worker's verdict (m accepted, next
                    token), rolling back and re-advancing as needed, then propose K new drafts
    release(session)       the slot and its KV pages are free (also on TTL expiry, replace, failed hand-off)
KV pages (baton/engine/pages.py): LoadState reserves [0, position + 1) (SlotFill); Decode reserves
position + max_new_tokens + speculation rows before its first step; Draft grows them per round. Too few
free: PagesExhausted (RESOURCE_EXHAUSTED) before the work, the session untouched.

Session state lives in slot `session.slot` of `runner.state`; the runner replays captured graphs when they exist.
"""

from __future__ import annotations

import threading
import time

import torch

from baton import grammar, op_profile
from baton.engine.draft_length import DEFAULT_K_MAX, POLICIES
from baton.engine.gather import PERIODIC, ROUND_BARRIER, Gather, fill_stats, unwrap
from baton.engine.runner import ModelRunner
from baton.engine.scheduler import StepScheduler, p50_p99
from baton.engine.slots import SessionLimit, SlotTable
from baton.engine.speculation import GREEDY, Drafter
from baton.handoff.slot_fill import SlotFill
from decode_worker import constrained, drafting, mtp, mtp_launch
from decode_worker.session import DecodeSession

ENGINES = ("bf16", "fp8", "mtp")
# tokens (mtp: rounds) a released-at-end batched decode may run ahead of its reader: at least 3, so the
# pipeline keeps going; 16, so a reader that waits out its message budget (decode_worker/pacing.py: up to
# 25 ms, ~8 steps of the fastest) or falls behind stays in every step and takes its queued tokens as one
# message (Job.take). Running ahead costs no step at an end token or max_new_tokens (the scheduler stops
# the job at once); a reader that stops early (the router's stop string, a cancel) wastes up to 16 rows.
RUN_AHEAD = 16


class DecodeEngine:
    def __init__(
        self,
        runners: dict[str, ModelRunner],
        *,
        default_engine: str,
        ttl_s: float = 300.0,
        drafter: Drafter = GREEDY,
        batch_steps: bool | None = None,
        draft_length: str = "adaptive",
    ):
        """runners: engine name -> runner. "mtp" and "bf16" may share one runner (BF16 model + MTP head).
        drafter: picks every draft token (baton.engine.speculation.Drafter; the default, the model's own).
        batch_steps: bf16 / fp8 fast-mode sessions step together through one StepScheduler
        (baton/engine/scheduler.py); None = for eager runners (the CPU path) and fused runners with a
        batched step (ModelRunner.enable_batching); other fused runners keep the per-session pipelined loop.
        draft_length: fast MTP's K a round: "adaptive" (baton/engine/draft_length.py, K = 0 too) or "fixed" (the Decode's K)."""
        if default_engine not in runners:
            raise ValueError(f"engine: default {default_engine!r} not among {sorted(runners)}")
        self.runners, self.default_engine, self.ttl_s, self.drafter = runners, default_engine, ttl_s, drafter
        if draft_length not in POLICIES:
            raise ValueError(f"draft_length {draft_length!r}: one of {', '.join(POLICIES)}")
        self.draft_length = draft_length
        self.k_max = 0 if draft_length == "fixed" else min(DEFAULT_K_MAX, self.width - 2)
        self.grammars = grammar.none  # structured outputs: the serve sets grammar.source(model_dir, ...)
        self._compute = threading.Lock()
        self.batch_steps = batch_steps
        self._scheduler: StepScheduler | None = None
        by_id = {id(r): r for r in runners.values()}  # every end of a session frees its KV pages
        self._table: SlotTable[DecodeSession] = SlotTable(
            ttl_s,
            {k: r.state.slots for k, r in by_id.items()},
            on_free=lambda k, slot: by_id[k].state.release_pages(slot),
        )
        # concurrent Draft calls of different sessions share their drafting steps (drafting.draft_batch), rounds merged
        run = op_profile.window(lambda items: drafting.draft_batch(self, items, self.drafts.seconds), "decode")
        self.drafts = Gather(run, self._compute, expected=self._exact_sessions, **ROUND_BARRIER)
        self._mtp_lock, self._mtp_active = threading.Lock(), 0  # mtp sessions in a fast-mode decode
        self._mtp_ctl = None  # their K per round (mtp.control)
        self._rounds: StepScheduler | None = None  # batched engines: every mtp session's rounds (mtp_launch)
        self._mtp_launched: list = []  # its rounds not collected yet, in launch order (mtp_launch.Launched)
        self._mtp_last_read = 0.0  # when the last round's tokens were read (perf_counter)
        self._mtp_seq, self._mtp_judging = 0, []  # plain rounds launched; flushes not judged yet (mtp_launch.py)
        self.mtp_jobs: dict[tuple[int, int], tuple[DecodeSession, int]] = {}  # (runner id, slot) -> (s, k_max)
        self.mtp_rounds = Gather(
            lambda items: mtp.rounds(self, items), self._compute, expected=lambda: self._mtp_active, **PERIODIC
        )

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(e for e in ENGINES if e in self.runners)

    def offered(self) -> list[str]:
        """The engines, the default first (WorkerStats.engines / engine)."""
        return [self.default_engine] + [e for e in self.engines if e != self.default_engine]

    @property
    def width(self) -> int:
        return next(iter(self.runners.values())).width

    @property
    def max_len(self) -> int:
        return next(iter(self.runners.values())).max_len

    def runner_for(self, engine: str | None) -> ModelRunner:
        e = engine or self.default_engine
        if e not in self.runners:
            raise ValueError(f"engine: {e!r} is not available on this worker (have {', '.join(self.engines)})")
        return self.runners[e]

    # ---- sessions ------------------------------------------------------------------------------
    def session_count(self) -> int:
        return len(self._table)

    def session_bytes(self) -> int:
        return sum(s.runner.state.held_bytes(s.slot) for s in self._table.sessions())

    def get(self, session_id: str) -> DecodeSession:
        return self._table.get(session_id)

    def release(self, session_id: str) -> bool:
        self.drafts.forget(session_id)
        self.mtp_rounds.forget(session_id)
        return self._table.release(session_id)

    def reap_expired(self) -> int:
        return self._table.reap_expired()

    def reserve(self, engine: str | None, session_id: str | None, position: int) -> SlotFill:
        """A slot for a state being received (baton/handoff/slot_fill.py); invisible until its commit()."""
        e = engine or self.default_engine
        fill = SlotFill(self, e, self.runner_for(e), session_id, position)
        try:
            fill._reserve(replace=False)
        except SessionLimit:
            if session_id is None or session_id not in {s.id for s in self._table.sessions()}:
                raise
            # NOTE: a re-sent state with every slot in use: kept on the host, replaces the old one at commit
        return fill

    def load(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        position: int,
        next_token: int,
        engine: str | None = None,
        session_id: str | None = None,
        fill: SlotFill | None = None,
        draft_only: bool = False,
    ) -> DecodeSession:
        """Imports a verified state into a free slot (the wire layer has checked every tensor) and makes
        it live; a re-sent state replaces the session of the same id (migration, retry). `fill`: the
        slot reserved for this state (LoadState placed tensors into it while they arrived). draft_only: a
        draft-only state (hidden row, MTP KV: baton/handoff/receive.py), the session draft_only at once."""
        fill = fill or self.reserve(engine, session_id, position)
        try:
            s = fill.commit(tensors, next_token, draft_only)
        except BaseException:
            fill.abort()
            raise
        s.runner.sampling.history.forget(s.slot)  # a penalized session sends its history (Decode / Draft)
        try:
            self.drafter.attach(s, position, next_token)
        except BaseException:
            self.release(s.id)
            raise
        return s

    def _publish(self, sid: str, e: str, runner: ModelRunner, slot: int, position: int, next_token: int, now: float,
                 draft_only: bool = False) -> DecodeSession:  # fmt: skip
        s = DecodeSession(sid, e, runner, slot, now, now, draft_only=draft_only, loaded_position=position)
        if e == "mtp":
            s.mtp_pairs_h = runner.state.hidden[slot].clone()[None]
            s.mtp_pairs_ids = [next_token]
            s.mtp_start = position - 1
        return self._table.publish(id(runner), sid, s)

    # ---- fast mode -----------------------------------------------------------------------------
    def decode(
        self,
        session_id: str,
        max_new_tokens: int,
        *,
        stop_ids=(),
        eos_ids=(),
        k: int = 4,
        run_ahead: bool = False,
        masker=None,
    ):
        """Yields lists of new tokens (after the state's next_token) until a stop condition.
        run_ahead: the session is released when the caller stops (Decode release_at_end), so batched
        steps may run up to RUN_AHEAD tokens ahead of the caller (StepScheduler `ahead`), unless the
        session asks for logprobs (read from the sampling table after each token); else the state is
        always exactly that of the tokens yielded. masker (structured outputs, baton/grammar.py): each
        token list is accepted and the next pick's mask written before the session's next step is asked
        for, so such a session neither runs ahead nor takes the pipelined one-session loop; bf16 / fp8 (mtp: a budget alone).
        A session with min_tokens' ban drops it once past its end (decode_worker/constrained.py)."""
        if masker is not None:  # structured outputs
            yield from constrained.structured(self, session_id, max_new_tokens, stop_ids, eos_ids, k, masker, run_ahead)
            return
        s = self.get(session_id)
        if not s.runner.sampling.params[s.slot].banning:
            yield from self._decode(session_id, max_new_tokens, stop_ids, eos_ids, k, run_ahead)
            return
        toks = self._decode(session_id, max_new_tokens, stop_ids, eos_ids, k, run_ahead)
        yield from constrained.unbanning(toks, s, s.position())

    def _decode(self, session_id, max_new_tokens, stop_ids, eos_ids, k, run_ahead, plain: bool = False):
        s = self.get(session_id)
        r = s.runner
        pos = s.position()
        s.loaded_position = None
        kk = min(k, self.width - 2)
        k_max = max(kk, self.k_max)  # adaptive K's ceiling (fixed: k); a round's K also fits the window
        extra = kk + 2 if s.engine == "mtp" else 0
        r.check_window(pos, max_new_tokens, extra)
        r.reserve(s.slot, pos + max_new_tokens + (k_max + 2 if extra else 0))  # every KV page it may write
        ends = set(stop_ids) | set(eos_ids)
        batched = r.fast is None or r.batched is not None
        scheduled = self.batch_steps if self.batch_steps is not None else batched  # a scheduler thread steps it
        ahead = RUN_AHEAD if self.runs_ahead(s, run_ahead) else 0
        if s.engine != "mtp" and scheduled:
            yield from self._ar_batched(s, max_new_tokens, ends, ahead)
            return
        if s.engine != "mtp" and r.state.pingpong and not r.sampling.wants_logprobs(s.slot) and not plain:
            yield from self._ar_pipelined(s, max_new_tokens, ends)
            return
        if s.engine == "mtp":  # K per round from the worker's controller (mtp.control), up to k_max
            mtp.control(self, kk)
            s.round_ends = frozenset(ends)  # a round's accept stops at one (DecodeSession.round_ends)
            if scheduled:
                yield from self._mtp_batched(s, max_new_tokens, ends, k_max, ahead)
            else:
                yield from mtp.decode(self, s, max_new_tokens, ends, k_max)
            return
        produced = 0
        while produced < max_new_tokens:
            with self._compute:
                toks, ended = mtp.cut(self._ar_step(s), max_new_tokens - produced, ends)
            produced += len(toks)
            s.last_used = time.monotonic()
            yield toks
            if ended:
                return

    @staticmethod
    def runs_ahead(s: DecodeSession, run_ahead: bool) -> bool:
        """Whether decode(..., run_ahead) steps `s` ahead of its reader: a session released at the end of its
        call, unless it asks for logprobs (read from the table after each token: a step ahead overwrites
        them). Only such a reader may wait without holding a step (decode_worker/pacing.py)."""
        return run_ahead and not s.runner.sampling.wants_logprobs(s.slot)

    def _ar_pipelined(self, s: DecodeSession, max_new_tokens: int, ends: set):
        """bf16 / fp8 AR with step t+1 launched before token t is read, so the host's launch and
        read-back overlap the device (runner.ar_launch). Phases alternate 0, 1, ...; a step launched
        past a stop token (or left unread when the caller stops early) is undone, and the GDN state ends
        in the main buffers either way (HybridState.undo_step / settle): the session's state is exactly
        that of the tokens yielded."""
        r, slot = s.runner, s.slot
        if max_new_tokens <= 0:
            return
        # NOTE: a device error inside ar_launch / ar_collect leaves the session undefined (as in _ar_step)
        with self._compute:
            fed = int(r.state.next_token[slot])  # the token the pending step consumes
            r.ar_launch(slot, 0)
        pending: int | None = 0  # phase of the launched, unread step
        kept: int | None = None  # phase of the last step whose token was yielded
        produced = 0
        try:
            while pending is not None:
                with self._compute:
                    cur, pending = pending, None
                    if produced + 1 < max_new_tokens:
                        pending = 1 - cur
                        r.ar_launch(slot, pending)
                    tok = r.ar_collect(slot, cur)
                kept, fed = cur, tok
                produced += 1
                s.last_used = time.monotonic()
                yield [tok]
                if tok in ends:
                    break
        finally:
            with self._compute:
                if pending is not None:
                    r.state.undo_step(slot, pending, fed)
                else:
                    r.state.settle(slot, kept)

    def _ar_batched(self, s: DecodeSession, max_new_tokens: int, ends: set, ahead: int = 0):
        """bf16 / fp8 AR through the step scheduler: this session's steps run together with every other
        session's (one ModelRunner.ar_batch per step and runner); with ahead = 0 the state is always that
        of the tokens yielded, as in the plain loop, else up to `ahead` tokens past them."""
        if max_new_tokens <= 0:
            return
        sched = self._scheduler  # (a Decode takes the lock, which every launch holds, only to start it)
        if sched is None:
            with self._compute:  # the scheduler is started once, under the lock its steps take
                if self._scheduler is None:
                    self._scheduler = StepScheduler(
                        lambda r, slots: r.ar_batch(slots),
                        self._compute,
                        launch=lambda r, slots: r.ar_batch_launch(slots),  # pages reserved by decode() above
                    )
                sched = self._scheduler
        job = sched.join(s.runner, s.slot, max_new_tokens, ends, ahead)
        try:
            while (toks := job.take()) is not None:  # what queued while the reader was away: one message
                s.last_used = time.monotonic()
                yield toks
        finally:
            job.close()

    def _mtp_batched(self, s: DecodeSession, max_new_tokens: int, ends: set, k_max: int, ahead: int = 0):
        """Fast-mode MTP through the rounds scheduler (StepScheduler(multi=True), its own thread): every
        joined mtp session's round runs together (decode_worker/mtp_launch.py: plain rounds pipelined as
        batched AR steps, speculative ones at once), back to back, a run-ahead session (ahead > 0:
        rounds) not waiting for its reader. Yields each round's tokens."""
        if max_new_tokens <= 0:
            return
        with self._mtp_lock:  # not the compute lock: a round computed at once holds it (a join waited ~200 ms)
            if self._rounds is None:
                self._rounds = StepScheduler(
                    lambda r, slots, left: mtp_launch.launch(self, r, slots, left)(),
                    self._compute,
                    launch=lambda r, slots, left: mtp_launch.launch(self, r, slots, left),
                    multi=True,
                    name="baton-mtp-rounds",
                )
        key = (id(s.runner), s.slot)
        self.mtp_jobs[key] = (s, k_max)  # before the join: a round reads it
        job = self._rounds.join(s.runner, s.slot, max_new_tokens, ends, ahead)
        try:
            while (rounds := job.take()) is not None:  # the rounds queued since the last read: one message
                s.last_used = time.monotonic()
                yield [t for toks in rounds for t in toks]
        finally:
            job.close()  # no round holds the job after this
            self.mtp_jobs.pop(key, None)

    @property
    def mtp_round_max(self) -> int:
        """The most mtp sessions one round has held (either path)."""
        return max(self.mtp_rounds.max_items, self._rounds.max_rows if self._rounds else 0)

    def fill_step_stats(self, out, reset: bool = False) -> None:
        """WorkerStats' batched-work fields (steps, their rows and durations, gathered batches)."""
        sched = self._scheduler
        scheds = [x for x in (sched, self._rounds) if x is not None]  # a Decode call's join -> its first tokens
        out.first_tokens_s_p50, out.first_tokens_s_p99 = p50_p99([t for x in scheds for t in x.first_s])
        for x in scheds if reset else ():
            x.first_s.clear()
        if sched is not None:
            batched = {id(r.batched): r.batched for r in self.runners.values() if r.batched is not None}
            sched.fill_stats(out, [b.device_s for b in batched.values()], reset)
        fill_stats(out, (self.drafts, self.mtp_rounds))
        if self._rounds is not None:  # the scheduled mtp rounds count as gathered batches, as the Gather's did
            out.gathered_batches += self._rounds.steps
            out.gathered_items += self._rounds.rows
        ctl = self._mtp_ctl
        for k, (n, secs) in dict(getattr(ctl, "by_k", {})).items():  # (a copy: the step thread adds)
            out.mtp_rounds_by_k[k], out.mtp_round_s_by_k[k] = n, secs
        for n, k, b, secs, probe in list(getattr(ctl, "spec_log", ())):
            out.mtp_spec_rounds.add(round=n, k=k, batch=b, seconds=secs, probe=probe)

    def close(self) -> None:
        """Stops the step scheduler's thread, if it runs; a later decode starts a new one."""
        with self._compute:
            scheds = (self._scheduler, self._rounds)
            self._scheduler = self._rounds = None
        for sched in scheds:
            if sched is not None:
                sched.close()

    def _ar_step(self, s: DecodeSession) -> list[int]:
        return [s.runner.ar_step(s.slot)]  # window checked once by decode()

    # ---- exact mode ----------------------------------------------------------------------------
    def draft(self, session_id: str, k: int, verdict: tuple | None) -> list[int]:
        """Exact mode: apply the verdict (m, next[, hidden rows]), then propose k new ones; concurrent Draft calls
        share their drafting steps (self.drafts -> drafting.draft_batch), each bitwise as alone."""
        return unwrap(self.drafts.call(self.draft_item(session_id, k, verdict)))

    def draft_item(self, session_id: str, k: int, verdict: tuple | None) -> tuple:
        """A checked Draft's item for self.drafts: (session, k, verdict); DraftMany runs many by call_many."""
        s = self.get(session_id)
        if not 1 <= k <= self.width - 2:
            raise ValueError(f"k: {k} out of range 1..{self.width - 2}")
        s.exact = True  # its position, if known (loaded_position), is drafting.draft_batch's to read and clear
        return s, k, verdict

    def _exact_sessions(self) -> int:
        return sum(1 for s in self._table.sessions() if s.exact)
