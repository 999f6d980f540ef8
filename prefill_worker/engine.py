"""ExactEngine: the exact BF16 engine of the prefill worker, with kept sessions for exact mode.

Lifecycle of a request through this engine:
    prefill(prompt, keep)   -> a session in a free slot; wide kernels; first token (greedy, or sampled
                               by the session's SamplingTable row, set at open, cleared at release;
                               its token history begun at open: prompt [0, n - generated), penalties;
                               a re-prefill's `generated` tail runs as AR rows: replay.Replays)
                               (= open_prefill + run_prefill; in between a sender may take the slot's
                               views and stream each layer as run_prefill's PrefillProgress marks it)
    export(session)         -> the slot's state tensors (the service streams them to a decode worker)
    verify(session, block)  -> exact mode only: K+1 fixed-width rows, longest accepted prefix m and the
                               next token; on rejection restore the snapshot and re-advance m+1 rows
    release(session)        -> the slot and its KV pages are free again (also on TTL expiry)
Prefix cache (baton/engine/prefix_cache.py, `prefix_entries` > 0): run_prefill restores the longest cached
chain of the prompt's piece boundaries into the slot before its first piece, and _prefill_batch caches a
piece's end state after its pass (bitwise what computing the pieces gives: the cuts are the same), and restores
instead of running a piece whose end another prompt's earlier pass cached since (restore_pieces: out of step).
KV pages (baton/engine/pages.py): open_prefill reserves the prompt's; generate the whole window it will
write; Verify blocks grow them at the block boundary (ModelRunner.rows). Too few free: PagesExhausted
(RESOURCE_EXHAUSTED) before the work.
    generate(prompt, n)     -> the reference: the same engine decoding one token at a time (AR);
                               `baton complete` prints exactly this

Exactness: AR steps and verify blocks both go through ModelRunner.rows at width W, so verify row i
is bitwise equal to the AR step at the same position (tests/engine/test_row_invariance.py proves it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager

from baton import grammar, op_profile
from baton.engine import rejection
from baton.engine.gather import ROUND_SETTLE, Gather, unwrap
from baton.engine.prefill import PREFILL_CHUNK, prefill_pieces, run_pass, share_key, shared_pieces
from baton.engine.prefix_cache import PrefixCache, boundary_keys, restore_pieces
from baton.engine.runner import ModelRunner
from baton.engine.sample_rows import MAX_LOGPROBS
from baton.engine.sampling import Params
from baton.engine.slots import SessionLimit, SlotTable
from baton.engine.state import StateTensor
from baton.handoff.progress import PrefillProgress
from prefill_worker.announced import Announced
from prefill_worker.replay import Replays
from prefill_worker.session import Session, VerifyResult
from prefill_worker.verifying import VerifyItem, verify_batch

PREFILL_BUDGET = PREFILL_CHUNK  # tokens per batched prefill pass (a whole piece always fits)
PREFILL_GATHER_S = 0.020  # a pass waits at most this long for prompts already opened or arriving
PREFILL_SETTLE_S = 0.003  # ... and until no prompt arrived for this long (gather.py settle_s: a burst's first joins)


class ExactEngine:
    def __init__(
        self, runner: ModelRunner, *, ttl_s: float = 300.0, prefill_budget: int = PREFILL_BUDGET, prefix_entries=0
    ):
        self.runner = runner
        self.ttl_s = ttl_s
        # prompt prefixes' states at piece boundaries (baton/engine/prefix_cache.py); None: off
        self.prefix = PrefixCache(runner.state, runner.prefill_chunk, prefix_entries) if prefix_entries else None
        self.grammars = grammar.none  # structured outputs: the serve sets grammar.source(model_dir, ...)
        self._compute = threading.Lock()  # one model, one stream of work
        # every end of a session frees its KV pages (SlotTable on_free)
        self._table: SlotTable[Session] = SlotTable(
            ttl_s, {0: runner.state.slots}, on_free=lambda _, slot: runner.state.release_pages(slot)
        )
        # concurrent Verify calls of different sessions run as one batched pass (verify_blocks), a merged group's settling
        self.verifies = Gather(
            op_profile.window(lambda items: verify_batch(self.runner, items, self.verifies.seconds), "prefill"),
            self._compute,
            expected=self.session_count,
            **ROUND_SETTLE,
        )
        self.replays = Replays(self.runner, self._compute)  # re-prefills' generated tails, in shared passes
        # concurrent prompts' pieces run as one pass of at most prefill_budget tokens (verify passes take the
        # same lock: they interleave with a long prompt's pieces). Sessions opened for a prefill not ended yet,
        # and calls still being validated (arriving): a pass's leader waits up to PREFILL_GATHER_S for their
        # pieces (a burst's calls open a few ms apart), and PREFILL_SETTLE_S past the last arrival
        self._prefilling: set[str] = set()
        self._prefilling_lock = threading.Lock()
        self._arriving = 0  # Prefill calls received whose session is not open yet (arriving())
        self.announced = Announced()  # equal prompts their callers announced and not here yet
        self.passes: deque = deque(maxlen=256)  # recent prefill passes: (pieces, tokens, seconds), for stats
        self.pass_totals = [0, 0, 0, 0.0]  # passes, pieces, tokens, seconds since start (WorkerStats)
        self.prefills = Gather(
            self._prefill_batch,
            self._compute,
            expected=lambda: len(self._prefilling) + self._arriving + self.announced.pending(),
            gather_s=PREFILL_GATHER_S,
            settle_s=PREFILL_SETTLE_S,
            cost=lambda p: len(p.ids),
            budget=prefill_budget,
            share=share_key,  # equal prompts: one pass computes them once
        )

    # ---- sessions ------------------------------------------------------------------------------
    @property
    def width(self) -> int:
        return self.runner.width

    def session_count(self) -> int:
        return len(self._table)

    def session_bytes(self) -> int:
        st = self.runner.state
        return sum(st.held_bytes(s.slot) for s in self._table.sessions())

    def _open(self, session_id: str | None) -> Session:
        now = time.monotonic()
        return self._table.open(
            0, session_id, lambda sid, slot: Session(sid, slot, now, now), what=f"{self.runner.state.slots} session"
        )

    def get(self, session_id: str) -> Session:
        return self._table.get(session_id)

    def release(self, session_id: str) -> bool:
        self.verifies.forget(session_id)
        with self._prefilling_lock:
            self._prefilling.discard(session_id)
        try:
            self.runner.sampling.clear(self._table.get(session_id).slot)  # before the slot can be reused
        except KeyError:
            pass
        return self._table.release(session_id)

    def reap_expired(self) -> int:
        n = self._table.reap_expired()
        if n:  # a reaped session no longer prefills: the passes stop waiting for it
            with self._prefilling_lock:
                self._prefilling = {sid for sid in self._prefilling if sid in self._table}
        return n

    # ---- work ----------------------------------------------------------------------------------
    def validate_prompt(self, ids: list[int], max_new_tokens: int = 0) -> None:
        if not ids:
            raise ValueError("prompt_ids: empty prompt")
        self.runner.check_ids(ids, "prompt_ids")
        self.runner.check_window(len(ids), max_new_tokens, self.width)

    def prefill(
        self,
        ids: list[int],
        *,
        session_id: str | None = None,
        mtp: bool = True,
        sampling: Params | None = None,
        generated: int = 0,
        equal_prompts: int = 0,
    ) -> tuple[Session, int]:
        """Runs the prompt into a new session's slot; returns (session, first token). mtp: run_prefill."""
        s = self.open_prefill(ids, session_id=session_id, sampling=sampling, generated=generated, equal=equal_prompts)
        return s, self.run_prefill(s, ids, mtp=mtp)

    def open_prefill(
        self,
        ids,
        *,
        session_id=None,
        sampling: Params | None = None,
        generated=0,
        prompt_logprobs=-1,
        equal=0,
        cache_salt="",
    ) -> Session:
        """Validates the prompt and opens its session (a slot); run_prefill computes it. In between the
        slot's export views (`export(sid, position=len(ids))`) may already be handed to a sender.
        sampling: the session's parameters (None = greedy), set on the slot for its first token, every
        Verify and step (baton/engine/sampling.py); cleared at release. generated: the last `generated`
        ids were generated (a migration's re-prefill): the penalties count them as generated. equal: the
        caller's equal prompts sent together, this one included (prefill_worker/announced.py). cache_salt: the
        prompt's prefix-cache keys start from it (baton/engine/prefix_cache.py)."""
        self.validate_prompt(ids)
        if not 0 <= generated < len(ids):
            raise ValueError(f"generated_tokens: {generated} of {len(ids)} prompt ids (at most {len(ids) - 1})")
        if prompt_logprobs > MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs: {prompt_logprobs} alternatives, at most {MAX_LOGPROBS}")
        s = self._open(session_id)
        try:
            # its KV pages, before any work (PagesExhausted); zeroed by its first piece's pass (run_pass: reset_slots)
            self.runner.reserve(s.slot, len(ids), zero=False)
        except BaseException:
            self._table.release(s.id)
            raise
        try:
            self.runner.sampling.history.begin(s.slot, len(ids) - generated)  # the slot's passes record the rest
            self.runner.sampling.set(s.slot, sampling)
            if sampling is not None and sampling.constrained:  # the first pick follows the generated tokens
                c = grammar.constraint(self.grammars, sampling.structured, self.runner.cfg.vocab_size)
                s.masker = grammar.Masker(c, self.runner.sampling, s.slot)
                s.masker.start(ids[len(ids) - generated :], len(ids))  # ValueError naming sampling.structured
        except BaseException:
            self.release(s.id)
            raise
        s.replay, s.want_logprobs, s.cache_salt = generated, prompt_logprobs, cache_salt
        with self._prefilling_lock:
            self._prefilling.add(s.id)
        self.announced.arrive(ids, equal)
        return s

    @contextmanager
    def arriving(self):
        """Around a Prefill call's validation and open_prefill: a pass's leader expects its prompt too, so a
        burst whose calls are still being parsed joins the first pass (at most PREFILL_GATHER_S)."""
        with self._prefilling_lock:
            self._arriving += 1
        try:
            yield
        finally:
            with self._prefilling_lock:
                self._arriving -= 1

    def last_logprobs(self, session_id: str, n: int) -> list:
        """The session's logprobs of its last pass's rows 0..n-1 ([] unless its sampling asks)."""
        return self.runner.sampling.logprobs(self.get(session_id).slot, n)

    def run_prefill(
        self, s: Session, ids: list[int], progress: PrefillProgress | None = None, *, mtp: bool = True
    ) -> int:
        """Computes the prompt into the session's slot; -> first token. Its pieces (PREFILL_CHUNK tokens)
        join the passes of other concurrent prompts (self.prefills, at most prefill_budget tokens a pass),
        each bitwise as alone. `progress` is marked per layer during the last piece and finished with the
        token (or failed); on failure the session is released. mtp=False skips the MTP layer's KV
        (ModelRunner.prefill): only for a session whose export never ships it. s.want_logprobs >= 0: s.prompt_logprobs
        gets the prompt tokens' logprobs (baton/engine/prefill.py prompt_logprobs_of)."""
        ids, g = list(ids), s.replay
        try:
            tok = None
            marks = progress.mark if progress is not None and not g else None
            prompt, start, chunk = ids[: len(ids) - g], 0, self.runner.prefill_chunk
            keys = boundary_keys(prompt, chunk, s.cache_salt)  # equal keys: equal states (a pass's equal pieces)
            if (
                self.prefix is not None and keys and s.want_logprobs < 0
            ):  # the longest cached prefix: its pieces are not computed again
                with self._compute:
                    start = self.prefix.restore(s.slot, keys, mtp)
                self.runner.sampling.history.put(s.slot, prompt[:start])
            s.cached_tokens = start
            for p in prefill_pieces(self.runner, s.slot, prompt[start:], start, on_layer=marks, mtp=mtp):
                p.prompt_logprobs = s.want_logprobs
                # equal to another slot's piece after the same tokens and salt (shared_pieces)
                p.before = keys[p.start // chunk - 1] if p.start else s.cache_salt.encode() or None
                if not p.last and self.prefix is not None:  # a boundary: cached after its pass (_prefill_batch)
                    p.prefix = (keys, (p.start + len(p.ids)) // chunk - 1)
                got = self.prefills.call(p)
                if isinstance(got, BaseException):
                    raise got
                tok, s.prompt_logprobs = got, s.prompt_logprobs + (p.logprobs or [])
                s.cached_tokens += len(p.ids) if p.restored else 0
            if g:  # no piece of it is to come (the passes stop waiting); every layer is final only after it
                with self._prefilling_lock:
                    self._prefilling.discard(s.id)
                tok = self.replays.run(s.slot, len(ids) - g, ids[len(ids) - g :], mtp)
                for i in range(self.runner.cfg.num_hidden_layers if progress is not None else 0):
                    progress.mark(i)
        except BaseException as e:
            if progress is not None:
                progress.fail(e)
            self.release(s.id)
            raise
        finally:
            with self._prefilling_lock:
                self._prefilling.discard(s.id)
        if progress is not None:
            progress.finish(tok)
        return tok

    def _prefill_batch(self, items: list) -> list:
        """Under _compute: concurrent sessions' pieces in one pass (baton/engine/prefill.py run_pass) ->
        per item its token (None: not its last piece), or the refusal of that item alone (window, pages)
        with the others run."""
        out, ok = [None] * len(items), []
        for i, p in enumerate(items):
            try:
                self.runner.check_window(p.start + len(p.ids), 0)
                self.runner.reserve(p.slot, p.start + len(p.ids))
                ok.append(i)
            except (ValueError, SessionLimit) as e:  # WindowError; PagesExhausted
                out[i] = e
        if self.prefix is not None:  # pieces another prompt's earlier pass cached meanwhile: restored, not run
            cached = restore_pieces(self.prefix, self.runner.sampling.history, [items[i] for i in ok])
            ok = [i for j, i in enumerate(ok) if j not in cached]
        if ok:
            t0 = time.perf_counter()
            # between layers a waiting Verify batch takes the lock (its sessions are not these)
            give_way = lambda _: self.verifies.give_way()  # noqa: E731
            for i, tok in zip(ok, run_pass(self.runner, [items[i] for i in ok], give_way)):
                out[i] = tok
            for p in (items[i] for i in ok if items[i].prefix is not None and self.prefix is not None):
                self.prefix.insert(p.slot, *p.prefix, mtp=p.mtp)
            shared = shared_pieces([items[i] for i in ok])  # computed once: the tokens counted are the computed
            rec = (
                len(ok),
                sum(len(items[i].ids) for k, i in enumerate(ok) if k not in shared),
                time.perf_counter() - t0,
            )
            self.passes.append(rec)
            self.pass_totals = [a + b for a, b in zip(self.pass_totals, (1, *rec))]
        return out

    def warm_up(self, lengths=(1, 17, 64, 100)) -> float:
        """Throw-away prefills of these prompt lengths (ids 0; each released), so the wide kernels compile
        before the worker serves: fla's chunked delta rule is Triton, compiled and autotuned on first use (tens
        of seconds on a fresh cache), and Triton specialises ints equal to 1 or divisible by 16. -> seconds."""
        t0 = time.perf_counter()
        for n in lengths:
            n = min(n, self.runner.max_len - self.width)
            if n < 1:
                continue
            s, _ = self.prefill([0] * n)
            self.release(s.id)
        return time.perf_counter() - t0

    def progress(self) -> PrefillProgress:
        return PrefillProgress(self.runner.cfg.num_hidden_layers, self.runner.device)

    def export(self, session_id: str, position: int | None = None, only: tuple[str, ...] | None = None):
        """-> (state tensors of the slot, position, next_token). Views: copy before releasing.
        With `position` given (a prefill not run yet): the views for that position, next_token None.
        only: those names alone (a draft-only hand-off), the other layers' KV never gathered."""
        s = self.get(session_id)
        st = self.runner.state
        if position is not None:  # KV gathered from the pages only once each layer is final (lazy)
            return [t for t in st.export(s.slot, position, lazy=True) if only is None or t.name in only], position, None
        pos, nxt = int(st.position[s.slot]), int(st.next_token[s.slot])
        if only is None:
            return st.export(s.slot, pos), pos, nxt
        lazy = [t for t in st.export(s.slot, pos, lazy=True) if t.name in only]
        return [StateTensor(t.name, t.kind, t.materialize()) for t in lazy], pos, nxt

    def verify(self, session_id: str, tokens: list[int], draft_probs=(), want_hidden=False, tag=None) -> VerifyResult:
        """One session's block [t0, d1..dk]; concurrent calls of other sessions share its rows pass
        (self.verifies, prefill_worker/verifying.py), each bitwise as alone. draft_probs: the drafter's q' of
        d1..dk (baton.v1.TokenDistribution), required iff the session samples with the REJECTION policy.
        want_hidden: the result's hidden holds the kept rows' final-normed hidden rows [m + 1, hidden] (CPU).
        tag: (id, size) of the Draft batch of these drafts: the pass waits for that batch's other Verifys."""
        item = self.verify_item(session_id, tokens, draft_probs, want_hidden, tag)
        return self.verified(item, self.verifies.call(item))

    def verify_item(self, session_id: str, tokens: list[int], draft_probs=(), want_hidden=False, tag=None):
        """A checked Verify's VerifyItem for self.verifies (VerifyMany runs many by call_many)."""
        s = self.get(session_id)
        k = len(tokens) - 1
        if not 1 <= k < self.width:
            raise ValueError(f"tokens: a block of K={k} drafts; K must be in 1..{self.width - 1}")
        self.runner.check_ids(tokens, "tokens")
        dists = None
        if self.runner.sampling.params[s.slot].rejection:
            dists = rejection.parse(draft_probs, tokens[1:], self.runner.cfg.vocab_size)
        elif len(draft_probs):
            raise ValueError("draft_probs: only for a session sampled at T > 0 with exact_policy REJECTION")
        return VerifyItem(s, tokens, dists, want_hidden, tag)

    @staticmethod
    def verified(item: VerifyItem, got) -> VerifyResult:
        """The VerifyResult of item's pass result `got` (raised if an exception), the session's counters updated."""
        m, nxt, pos, lps, hidden = unwrap(got)
        c, k = item.session.counters, len(item.tokens) - 1
        c.drafted += k
        c.accepted += m
        c.rejected_blocks += int(m < k)
        c.verify_blocks += 1
        return VerifyResult(m, nxt, pos, c, lps, hidden)

    def step(self, session_id: str) -> int:
        """One AR step: consumes the pending token, returns the new one."""
        s = self.get(session_id)
        with self._compute:
            tok = self.runner.rows(s.slot, [int(self.runner.state.next_token[s.slot])])[0]
            self.runner.state.next_token[s.slot] = tok
        return tok

    def generate(
        self, ids: list[int], max_new_tokens: int, *, stop_ids=(), eos_ids=(), sampling: Params | None = None
    ) -> list[int]:
        """The exact AR reference: prefill, then one fixed-width row per token, each picked by
        `sampling` (None = greedy; seeded noise keyed by position, baton/engine/sampling.py)."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        self.validate_prompt(ids, max_new_tokens)
        s = self.open_prefill(ids, sampling=sampling)
        try:
            self.runner.reserve(s.slot, len(ids) + max_new_tokens)  # every page it will write, up front
        except BaseException:
            self.release(s.id)
            raise
        out = [self.run_prefill(s, ids)]
        try:
            ends = set(stop_ids) | set(eos_ids)
            while len(out) < max_new_tokens and out[-1] not in ends:
                if s.masker is not None:  # structured outputs: the next pick's mask after the last token
                    s.masker.step(out[-1:])
                out.append(self.step(s.id))
        finally:
            self.release(s.id)
        return out
