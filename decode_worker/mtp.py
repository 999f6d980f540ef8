"""MTP speculation on the decode worker: the MTP head drafts, the BF16 model verifies (fast mode, engine
mtp), for one session or for many at once.

    chains(engine, [(s, k), ...])    finalise each session's pending MTP pairs and draft k tokens, every
                                     session's chain step in one pass (ModelRunner.mtp_batch)
    pending_pairs(s, p, ids, h)      after a verify that kept rows 0..m from position p: the pairs the
                                     next chain finalises, (h_{p-1}, ids[0]) .. (h_{p+m}, next)
    rounds(engine, [(s, k), ...])    one round for each session: the chains together, then one verify
                                     pass over every session's block (speculation.verify_blocks)
    (batched engines run every mtp session's rounds in a scheduler thread: decode_worker/mtp_launch.py)

Each session's round is bitwise the one it runs alone: each group of an MTP pass is its chain step
alone (batch invariance of the fused MTP pass, baton/engine/fused_blocks.py; one group at a time on the
eager path), and verify_blocks leaves each slot as verify_block alone would, with the same hidden rows.
Runs under the engine's compute lock: on batched engines in the rounds scheduler's thread
(DecodeEngine._mtp_batched, baton/engine/scheduler.py with multi=True: sessions join and leave between
rounds, a run-ahead session's rounds do not wait for its reader), else as a Gather of the sessions'
concurrent calls (decode(): each round waits for every live session's call, up to PERIODIC's 50 ms).
On the H200 at 32 streams a K = 0 round run by rounds() (a one-row verify) took ~22 ms against ~7 ms for
a plain batched step (benchmarks/results/gpu-h200-2026-12-02-later.md): the rounds scheduler runs plain
rounds as pipelined batched AR steps instead (decode_worker/mtp_launch.py).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from baton.engine.draft_length import controller
from baton.engine.graph import MAX_DRAFT
from baton.engine.speculation import known_ahead, verify_blocks


def control(engine, k: int | None = None):
    """The draft-length controller of every fast-mode mtp session of the engine (their rounds are one
    batch): made at the first mtp Decode, its K the prior (baton/engine/draft_length.py, k_min 0; the
    engine's draft_length policy; engine.k_max the adaptive ceiling)."""
    with engine._mtp_lock:
        if engine._mtp_ctl is None:
            prior = k or 4
            engine._mtp_ctl = controller(engine.draft_length, prior, engine.k_max or prior, k_min=0)
        return engine._mtp_ctl


def round_start(s) -> tuple[int, int]:
    """(position, pending token t0) of an mtp session between rounds, from the host: its pending MTP
    pairs end with (h_{p-1}, t0) at KV index p - 1 (_publish, pending_pairs), so p = mtp_start + their
    count; reading the state's device tensors would cost a sync a round and session."""
    return s.mtp_start + len(s.mtp_pairs_ids), s.mtp_pairs_ids[-1]


# "1": a lone session's chain runs on the device too (one host read a chain instead of one a step). Off until
# measured: on a GPU shared with the prefill worker a lone session's speculative rounds took 100-800 ms
# (benchmarks/results/gpu-h100-2026-12-07-stop59.md), each of its K + 1 host reads waiting behind the other
# worker's passes; alone on a GPU the step-by-step reads cost ~nothing.
CHAIN_ONE_ENV = "BATON_MTP_CHAIN_ONE"


def flush_at(runner) -> int:
    """Pending pairs at which a K = 0 session's chain runs anyway (finalising them, no draft): the most
    pairs one MTP pass takes (its graphs: K_max + 2; at most W)."""
    return min(MAX_DRAFT + 2, runner.width)


def chains(engine, items: list, before_step=None) -> list[list[int] | None]:
    """items [(session, k)] of distinct sessions -> each session's k drafts: finalises its pending MTP
    pairs (h_{P-1}, x_P) ... and drafts k tokens, the MTP output row chained as the next step's hidden.
    Every session's chain step runs together (ModelRunner.mtp_batch per runner: the catch-up pass over
    each session's pending pairs, then k - 1 one-pair steps), each bitwise its chain alone.
    k = 0 (fast mode's plain AR round): no chain, None, the pending pairs kept for a later one, unless
    they reached flush_at: then they are finalised now, [] (no draft). In a round where no session
    drafts, one session's flush takes every session's pending pairs along: the plain sessions of a batch
    then flush together (their pairs aligned after the first flush), one MTP pass every ~flush_at rounds
    instead of a small one in nearly every round. Only the flush's timing depends on the batch: the MTP KV
    of a finalised position is bitwise the same under any schedule, and the drafts and tokens with it.
    (The pipelined plain rounds flush with flush_later.) before_step(step, drafts), if given, runs before
    each step's passes (drafts: each session's drafts so far): a masked session's grammar writes the mask of
    the step's pick (_round); the chains then run step by step, not on the device."""
    due = [k > 0 or len(s.mtp_pairs_ids) >= flush_at(s.runner) for s, k in items]
    if any(due) and not any(k for _, k in items):  # a plain round's flush: every session's pairs join it
        due = [True] * len(items)
    live = [i for i, d in enumerate(due) if d]
    if before_step is None and (on_device := _on_device(engine, [items[i] for i in live])) is not None:
        out: list = [None] * len(items)  # a session not due keeps its pairs: None, as below
        for i, d in zip(live, on_device):
            out[i] = d
        return out
    drafts: list = [[] if d else None for d in due]
    h: list = [None] * len(items)
    idx = [0] * len(items)  # KV index of each session's next pair
    for step in range(max((max(k, 1) for (_, k), d in zip(items, drafts) if d is not None), default=0)):
        if before_step is not None:
            before_step(step, drafts)
        by_runner: dict[int, list[int]] = {}
        for i, (s, k) in enumerate(items):
            if drafts[i] is not None and max(k, 1) > step:
                by_runner.setdefault(id(s.runner), []).append(i)
        for live in by_runner.values():
            r, groups = items[live[0]][0].runner, []
            for i in live:
                s = items[i][0]
                if step == 0:
                    groups.append((s.slot, pairs_h(s), s.mtp_pairs_ids, s.mtp_start))
                    idx[i] = s.mtp_start + len(s.mtp_pairs_ids)
                else:
                    groups.append((s.slot, h[i][None], [drafts[i][-1]], idx[i]))
                    idx[i] += 1
            toks, outs = r.mtp_batch(groups)
            for i, t, o in zip(live, toks, outs):
                if items[i][1] > step:
                    drafts[i].append(engine.drafter.propose(items[i][0], step, t[-1]))
                h[i] = o[-1]  # chained: the MTP output row is the next step's hidden
    return drafts


def flush_later(sessions: list):
    """The pipelined plain rounds' flush (mtp_launch.py): every session's pending pairs (those read so far)
    finalised in one MTP pass per runner, launched without a host read -> a function giving each session's
    head picks, one after each pair, to call once a later read of the stream has passed the pass (it then
    waits for nothing). The same passes on the same inputs as chains' step 0: the same MTP KV bits."""
    by_runner: dict[int, list[int]] = {}
    for i, s in enumerate(sessions):
        by_runner.setdefault(id(s.runner), []).append(i)
    reads = []
    for idx in by_runner.values():
        # each session's rows as pieces (mtp_pairs_h, then a row a plain round): one copy of them all
        groups = [
            (s.slot, [s.mtp_pairs_h, *s.mtp_h_more], s.mtp_pairs_ids, s.mtp_start) for s in (sessions[i] for i in idx)
        ]
        reads.append((idx, sessions[idx[0]].runner.mtp_later(groups)))

    def read() -> list[list[int]]:
        out: list = [None] * len(sessions)
        for idx, picks in reads:
            for i, t in zip(idx, picks()):
                out[i] = t
        return out

    return read


def _on_device(engine, items: list) -> list[list[int]] | None:
    """chains() of the due items (the others keep their pairs), on one fused runner with batched rows (a Draft batch of
    exact mode, a fast-mode round), when one drafts >= 2, the drafter knows its drafts ahead or takes the
    model's own (Drafter.ahead), and the chains fit one bucket: run on the device with one host read
    (BatchedRows.mtp_chain: bitwise the host-chained steps, without a read and an upload a step; each
    session its own k). -> each session's drafts, or None: chains() runs them step by step (nothing was
    run or drawn)."""
    if len(items) < (1 if os.environ.get(CHAIN_ONE_ENV) == "1" else 2):
        return None
    r = items[0][0].runner
    rows = getattr(r, "batched_rows", None)
    ks = [k for _, k in items]
    if rows is None or max(ks) < 2 or any(s.runner is not r for s, _ in items):
        return None
    if rows.chain_bucket(len(items), max(len(s.mtp_pairs_ids) for s, _ in items)) is None:
        return None
    forced = known_ahead(engine.drafter, items)
    if forced is None:
        return None
    groups = [(s.slot, pairs_h(s), s.mtp_pairs_ids, s.mtp_start) for s, _ in items]
    return rows.mtp_chain(groups, ks, forced)


def pairs_h(s) -> torch.Tensor:
    """The hidden rows of session s's pending pairs [len(mtp_pairs_ids), hidden]: mtp_pairs_h with the rows
    plain rounds appended since (mtp_h_more, one [1, hidden] view a round: joined here, once a chain
    needs them, not once a round)."""
    if s.mtp_h_more:
        s.mtp_pairs_h = torch.cat([s.mtp_pairs_h, *s.mtp_h_more])
        s.mtp_h_more = []
    return s.mtp_pairs_h


def pending_pairs(s, p: int, ids: list[int], h_rows: torch.Tensor, kept: bool = False) -> None:
    """After m+1 accepted rows from position p (ids = [t0, d1..dm, next]; h_rows [>= m+1, hidden] the
    final-normed hidden rows of the accepting rows pass): pairs (h_{p-1}, ids[0]) .. (h_{p+m}, next) at
    KV index p-1 onward. kept (a round whose chain did not run, so the pairs were not finalised; then
    m = 0): the pending pairs, whose last is (h_{p-1}, t0), plus (h_p, next)."""
    if kept:
        s.mtp_pairs_h = torch.cat([pairs_h(s), h_rows[:1]])
        s.mtp_pairs_ids = s.mtp_pairs_ids + [ids[-1]]
        return
    s.mtp_pairs_h = torch.cat([pairs_h(s)[-1:], h_rows[: len(ids) - 1]])  # h_{p-1}, then the kept rows (copies)
    s.mtp_pairs_ids = ids
    s.mtp_start = p - 1


def rounds(engine, items: list, K: int | None = None, own: list[int] | None = None) -> list[list[int]]:
    """items [(session, cap)] of distinct sessions -> each session's emitted tokens d1..dm, next. The
    round's K is the worker's controller's (control(engine): one K for the batch, 0 = a plain round; K:
    already asked of it, with `own` each session's own cap at K), cut to each session's own cap (own_caps:
    its acceptance) and to its cap (its tokens left, its window). The controller then observes the round
    at the most drafts the own caps left (the chain's steps): the pooled acceptance of the sessions that
    took them and the round's seconds (not observed when caps cut every session below it); each
    session's own cap observes its block."""
    ctl = control(engine)
    if K is None:
        K = ctl.next_k(batch=len(items))
    if own is None:
        own = own_caps(ctl, K, [s for s, _ in items])
    target = max(own, default=0)
    items = [(s, min(o, cap)) for (s, cap), o in zip(items, own)]
    t = time.perf_counter()
    out = _round(engine, items)
    at_k = [len(o) - 1 for o, (_, k) in zip(out, items) if k == target]
    if target and at_k:
        ctl.observe_round(target, at_k, 0.0, time.perf_counter() - t)
    for o, (s, k) in zip(out, items):
        if k:
            s.draft_cap.observe(k, len(o) - 1)
    return out


# "0": every session drafts the batch's K (no own caps), as until 2026-12-07: the A/B of own caps
OWN_CAPS_ENV = "BATON_MTP_OWN_CAPS"
# "0": a masked session's drafts are unconstrained proposals (its mask off for the chain), as until 2026-12-07 in
# fast mtp and 2026-12-08 in exact mode (decode_worker/draft_calls.py reads it too)
MASKED_DRAFTS_ENV = "BATON_MTP_MASKED_DRAFTS"


def binds(masker, start: int, t0: int, k: int) -> bool:
    """Whether a masked session's grammar may refuse one of its next k draft picks after pending token t0 at
    `start` (t0 accepted first: Masker.at): not while free with more than k of its budget left (a reasoning
    part: its masks allow everything), nor past any_text's switch or the grammar's end. Only a binding
    session's drafts are masked step by step; the others draft unmasked (`unbound`), so a batch whose masked
    sessions all reason keeps its chains on the device."""
    masker.at(start, t0)
    c = masker.c
    if c.free:
        return c.budget_left is not None and c.budget_left <= k
    return not c.grammarless and not c.finished


def mask_steps(items: list, starts: list, bound: set, write):
    """-> chains' before_step for items [(session, k)]: before chain step j, write(s, start, [t0, d1..dj]) for
    each session in bound (ids) still drafting (k > j), starts[i] its (start, t0); None when none is bound,
    so the chains may run on the device."""
    if not bound:
        return None

    def before(step: int, drafts: list) -> None:
        for i, (s, k) in enumerate(items):
            if id(s) in bound and k > step:
                p, t0 = starts[i]
                write(s, p, [t0] + drafts[i])

    return before


@contextlib.contextmanager
def unbound(sessions):
    """The sessions' picks ignore their grammar masks meanwhile (SamplingTable.unmasked; stream-ordered): their
    drafts are unconstrained proposals, and no stale mask row of an earlier position can restrict them."""
    for s in sessions:
        s.runner.sampling.unmasked(s.slot, True)
    try:
        yield
    finally:
        for s in sessions:
            s.runner.sampling.unmasked(s.slot, False)


def own_caps(ctl, K: int, sessions: list) -> list[int]:
    """Each session's most drafts at the batch's K, from its own acceptance (baton/engine/draft_cap.py);
    K for every session under a controller without an acceptance estimate (the fixed policy), or with
    BATON_MTP_OWN_CAPS=0."""
    a = getattr(ctl, "acceptance", None)
    if a is None or K <= 0 or os.environ.get(OWN_CAPS_ENV) == "0":
        return [K] * len(sessions)
    return [s.draft_cap.cap(K, a) for s in sessions]


def _round(engine, items: list) -> list[list[int]]:
    """A masked session (structured outputs: DecodeSession.masker) drafts under its grammar: before each chain
    step its Masker writes the mask of the step's pick, the grammar's after t0, d1..dj (Masker.draft_row), so
    the head proposes only tokens the grammar allows (until 2026-12-07 its drafts were unconstrained: 1.08
    tokens a round under json_object on the embedded model). Then its Masker writes each verify row's mask
    (Masker.block: a draft the grammar refuses ends the accept there), so the verify keeps exactly the masked
    AR picks; the caller's Masker.step takes the round's tokens. The chain's first pass also picks after each
    older pending pair, through mask rows of other positions: those picks are not drafts (discarded). A
    masked session whose grammar cannot bind its drafts this round (`binds`: a reasoning part) drafts
    unmasked, and a round with no binding session keeps its chains on the device."""
    masked = {id(s): s for s, k in items if k and s.masker is not None and s.runner.sampling.params[s.slot].constrained}
    starts = [round_start(s) for s, _ in items]  # (position, pending token t0) of each session
    free = os.environ.get(MASKED_DRAFTS_ENV) == "0"  # the A/B: unconstrained drafts, as until 2026-12-07
    bound = (
        set()
        if free
        else {id(s) for (s, k), (p, t0) in zip(items, starts) if id(s) in masked and binds(s.masker, p, t0, k)}
    )

    masks = mask_steps(items, starts, bound, lambda s, p, toks: s.masker.draft_row(p, toks))
    with unbound([s for i, s in masked.items() if i not in bound]):
        drafted = chains(engine, items, masks)
    prep = []
    for (s, _k), drafts, (p, t0) in zip(items, drafted, starts):
        if drafts and id(s) in masked:
            s.masker.block(p, [t0] + drafts)
        prep.append((s, t0, p, drafts))
    by_runner: dict[int, list[int]] = {}
    for i, (s, *_rest) in enumerate(prep):
        by_runner.setdefault(id(s.runner), []).append(i)
    out: list = [None] * len(prep)
    for idx in by_runner.values():
        r = prep[idx[0]][0].runner
        hidden: list[torch.Tensor] = []
        blocks = [(prep[i][0].slot, [prep[i][1]] + (prep[i][3] or [])) for i in idx]
        res = verify_blocks(r, blocks, hidden_out=hidden, ends=[prep[i][0].round_ends for i in idx])
        for i, (m, nxt), h in zip(idx, res, hidden):
            s, t0, p, drafts = prep[i]
            pending_pairs(s, p, [t0] + (drafts or [])[:m] + [nxt], h, kept=drafts is None)
            s.rounds += 1
            s.emitted_in_rounds += m + 1
            out[i] = (drafts or [])[:m] + [nxt]
    return out


def round_cap(s, k_max: int, left: int) -> int:
    """The most drafts session s's next round may take: k_max, its tokens left - 1, and room for the
    round's rows in the window; none for a masked session (structured outputs) without its Masker (_round
    writes a block's row masks with it)."""
    if s.masker is None and s.runner.sampling.params[s.slot].constrained:
        return 0
    room = s.runner.max_len - round_start(s)[0] - 2
    return max(0, min(k_max, left - 1, room))


def decode(engine, s, max_new_tokens: int, ends: set, k_max: int):
    """Fast-mode MTP decode of session s on an engine without batched steps (a fused runner without
    batching; batched engines run decode_worker/mtp_launch.py in their rounds scheduler): rounds (concurrent
    sessions' rounds are one batch, one chain and one verify pass: engine.mtp_rounds, K from the worker's
    controller) until max_new_tokens or a token of `ends`; yields each round's tokens. A round's K is
    capped by round_cap."""
    produced = 0
    with engine._mtp_lock:
        engine._mtp_active += 1
    try:
        while produced < max_new_tokens:
            toks = engine.mtp_rounds.call((s, round_cap(s, k_max, max_new_tokens - produced)))
            toks, ended = cut(toks, max_new_tokens - produced, ends)
            produced += len(toks)
            s.last_used = time.monotonic()
            yield toks
            if ended:
                return
    finally:
        with engine._mtp_lock:
            engine._mtp_active -= 1


def cut(toks: list[int], room: int, ends: set) -> tuple[list[int], bool]:
    """A step's tokens cut to `room` and after the first end token -> (tokens, ended at an end token)."""
    toks = toks[:room]
    for i, t in enumerate(toks):
        if t in ends:
            return toks[: i + 1], True
    return toks, False
