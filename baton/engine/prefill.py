"""Prefill passes: one or several sessions' prompt pieces computed together (issue 20, batched prefill).

    pieces(start, n)                  -> [(start, n), ...], the pieces a prompt is always cut into
    run_pass(runner, [Piece, ...])    -> [token or None, ...]; one forward over every piece's rows
    replay_step(runner, [Replay, ...])        one W-row block of each re-prefill's generated tail, as AR rows
    prompt_logprobs_of(runner, piece, h)      -> a piece's prompt tokens' logprobs (Piece.prompt_logprobs)
    cut_check(runner, piece, tokens)  -> the state tensors that cutting at `piece` changes ([]: none)

A prompt of n tokens from position `start` is cut at start + k * PREFILL_CHUNK (the runner's prefill_chunk:
a prefill worker's --prefill-piece, taken only where cut_check finds it changes nothing), whatever else is in
flight, so its state is a function of the prompt alone: the same pieces run alone (`ModelRunner.prefill`,
`baton complete`) or inside any pass (the prefill worker's gathered passes). A pass computes its pieces
as `StepContext.segments` (baton/models/context.py): per-row ops on all rows through row-invariant
kernels, each piece's mixers on its own rows; so a piece's state writes and its first token are bitwise
what the piece computes alone. Equal pieces in one pass (the same tokens before them and the same ids) are
computed once (shared_pieces): the same bits.

Lifecycle of a piece: its slot's KV pages are reserved up to start + n; a first piece (start 0) resets the
slot's GDN state; the pass writes the piece's KV and GDN state; a `last` piece also picks the slot's next
token (by the slot's sampling parameters at position start + n), stores position / next token / hidden
and, when `mtp`, writes the MTP layer's KV for its pairs. A piece that is not last leaves position alone:
the next piece continues from start + n. `on_layer` (the last piece only) is the streaming hand-off's
per-layer mark (baton/handoff/progress.py).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Callable

import torch

from baton.engine.pages import PAGE, pages_for
from baton.models.context import Segment, StepContext, wide_prefill
from baton.transfer import upload

PREFILL_CHUNK = 8192  # tokens: a longer prompt runs as pieces of this size, each its own pass or part of one


def cut_check(runner, piece: int, tokens: int, slot: int = 0, seed: int = 0) -> list[str]:
    """Whether this runner cuts prompts into `piece`-token pieces without changing a bit: a random prompt of
    `tokens` tokens prefilled in PREFILL_CHUNK pieces, then in `piece`-token pieces, both in `slot` -> the names
    of the state tensors that differ (and "first token"); [] when all are bitwise the same. The slot is reset
    and its pages freed after each (before any session: prefill_worker/serve.py runs it at start-up). On the
    2-core CPU page multiples pass (benchmarks/probe_cut_invariance.py); a GPU passes only where its kernels
    are cut-invariant there (gpu_pending.sh cut-probe)."""
    ids = [random.Random(seed).randrange(runner.cfg.vocab_size) for _ in range(tokens)]
    keep, got = runner.prefill_chunk, []
    try:
        for chunk in (PREFILL_CHUNK, piece):
            runner.prefill_chunk = chunk
            try:
                tok = runner.prefill(slot, ids)
                got.append((tok, {t.name: t.materialize().clone() for t in runner.state.export(slot)}))
            finally:
                runner.state.reset_slots([slot])
                runner.state.release_pages(slot)
    finally:
        runner.prefill_chunk = keep
    (ta, a), (tb, b) = got
    return (["first token"] if ta != tb else []) + [k for k in a if not torch.equal(a[k], b[k])]


def pieces(start: int, n: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """[(start, n), ...] covering [start, start + n): cut where (position - start) is a multiple of chunk."""
    return [(start + o, min(chunk, n - o)) for o in range(0, n, chunk)]


@dataclass
class Piece:
    """ids [n] of one slot at positions [start, start + n). last: the prompt's final piece (picks the
    token); mtp: also write the MTP layer's KV; next_id: the token after ids[-1] when not last (the MTP
    pair of the piece's last row); on_layer: the hand-off's per-layer mark (last pieces)."""

    slot: int
    ids: list[int]
    start: int = 0
    last: bool = True
    mtp: bool = True
    prompt_logprobs: int = -1  # >= 0: run_pass sets `logprobs` (prompt_logprobs_of), with this many alternatives
    logprobs: list | None = None  # [(logprob, [(id, logprob)] * N)] of the tokens at start + 1 .. of this piece
    next_id: int | None = None
    on_layer: Callable[[int], None] | None = None
    prefix: tuple[list[bytes], int] | None = None  # (keys, k): cache the state after it (PrefixCache.insert)
    restored: bool = False  # its pass took its end state from the prefix cache instead (ExactEngine._prefill_batch)
    before: bytes | None = None  # start > 0: the prompt's boundary key at start (prefix_cache.boundary_keys);
    # a first piece: its request's cache_salt, encoded (salted prompts share a pass's work only with their salt)


def prefill_pieces(
    runner, slot: int, ids: list[int], start: int = 0, *, on_layer=None, mtp: bool = True
) -> list[Piece]:
    """The prompt ids at [start, start + len(ids)) of `slot` as its Pieces, in order (pieces())."""
    cut = pieces(start, len(ids), runner.prefill_chunk)
    out = []
    for k, (s0, n) in enumerate(cut):
        o = s0 - start
        last = k == len(cut) - 1
        out.append(
            Piece(
                slot,
                list(ids[o : o + n]),
                s0,
                last=last,
                mtp=mtp,
                next_id=None if last else int(ids[o + n]),
                on_layer=on_layer if last else None,
            )
        )
    return out


def _marks(ps: list[Piece], between_layers=None):
    fns = [p.on_layer for p in ps if p.on_layer is not None and p.last]
    if between_layers is not None:
        fns.append(between_layers)
    if not fns:
        return None

    def on_layer(i: int) -> None:
        for f in fns:
            f(i)

    return on_layer


def _context(ps: list[Piece], **kw) -> StepContext:
    """The pass's StepContext: each piece a Segment at its row offset (pieces in row order)."""
    offs = itertools.accumulate((len(p.ids) for p in ps[:-1]), initial=0)
    segs = tuple(Segment(p.slot, p.start, len(p.ids), o) for p, o in zip(ps, offs))
    return StepContext(
        slot=segs[0].slot,
        width=None,
        n=sum(len(p.ids) for p in ps),
        start=segs[0].start,
        segments=segs if len(segs) > 1 else None,
        **kw,
    )


def share_key(p: Piece) -> tuple | None:
    """What makes two pieces' states equal: the ids of a first piece (start 0; with its cache_salt, `before`,
    when salted); past position 0, the tokens before it too (its `before` key: the slots' states at start are
    then equal), else None (a piece there continues its slot's own state). shared_pieces and the prefill
    Gather's budget use it."""
    if p.start == 0:
        return tuple(p.ids) if not p.before else (p.before, tuple(p.ids))
    return (p.before, tuple(p.ids)) if p.before is not None else None


def shared_pieces(ps: list[Piece]) -> dict[int, int]:
    """-> {i: j}: piece i has the share_key of the earlier piece j (a first piece with the same ids, or a later
    one after the same tokens, at the same start). A prompt's state is a function of its ids alone (module
    doc), so run_pass computes j and copies its state into i's slot: the same bits as computing i (an `n` > 1
    request's choices, best-of-n, equal prompts sent together, long ones piece by piece). Each slot still
    picks its own token (its sampling parameters, seed and penalties) from the shared last row, and gets its
    own MTP pairs (they end with its own token)."""
    first: dict[tuple, int] = {}
    out = {}
    for i, p in enumerate(ps):
        if (key := share_key(p)) is not None and (j := first.setdefault(key, i)) != i:
            out[i] = j
    return out


def _copy_prompt_states(st, pairs: list[tuple[int, int, int, int]]) -> None:
    """For each (src, dst, start, n): the main model's state of slot src after its piece of n tokens at start
    (a multiple of PAGE: 0 or a piece boundary) -> slot dst (pages reserved): every GDN layer's conv and
    recurrent state and every attention layer's KV rows [start, start + n). The MTP KV, hidden, position and
    next token are the caller's (they depend on dst's own pick).
    One gather and one scatter a state tensor for all pairs, not 64 small copies a pair at the 9B shape (on
    an H100 8 equal prompts' pass took 42 ms more than one prompt's, 136 against 94 ms, before). KV moves in
    whole pages: both slots' pages were zeroed when their prompts began (HybridState.reset_slots: a first
    piece's pass, or a prefix-cache restore) and hold the same rows [0, start); the pass wrote src's rows
    [start, start + n) only, so a page copy leaves dst's rows past start + n zero, bitwise what a copy of
    those rows leaves."""
    dev = st.device
    src, dst = (upload([p[k] for p in pairs], torch.long, dev) for k in (0, 1))
    span = [(start // PAGE, pages_for(start + n)) for _, _, start, n in pairs]
    pages = [(st.pages.owned(s)[a:b], st.pages.owned(d)[a:b]) for (s, d, _, _), (a, b) in zip(pairs, span)]
    src_pages, dst_pages = (upload([x for pp in pages for x in pp[k]], torch.long, dev) for k in (0, 1))
    for i in range(st.cfg.num_hidden_layers):
        if i in st.conv:
            for t in (st.conv[i], st.recurrent[i]):
                t.index_copy_(0, dst, t.index_select(0, src))
        else:
            for pool in (st.key[i], st.value[i]):
                pool.index_copy_(0, dst_pages, pool.index_select(0, src_pages))


@torch.inference_mode()
def run_pass(runner, ps: list[Piece], between_layers=None) -> list[int | None]:
    """Computes every piece in one pass (slots distinct) -> each last piece's token, None for the others.
    Checks every piece's window and reserves its pages before any state changes (a refused pass changes
    nothing: WindowError / ValueError / PagesExhausted). between_layers(i): called once layer i's state
    writes are enqueued (the worker's compute lock may be given way there: Gather.give_way; work on other
    slots may run in between, never on these). Equal pieces are computed once
    (shared_pieces): the others' states are copied after the pass, and their on_layer marks come then."""
    if not ps:
        return []
    if len({p.slot for p in ps}) != len(ps):
        raise ValueError("prefill pass: one piece per slot")
    for p in ps:
        if not p.ids:
            raise ValueError("prompt: empty")
        runner.check_window(p.start + len(p.ids), 0)
    # pages first (a refused pass changes no state), then zeroed with the fresh prompts' slots in one launch a
    # state tensor for the whole pass (HybridState.reset_slots), not ~70 a piece
    st, dev = runner.state, runner.device
    added: list[int] = []  # every page added; of continuing pieces' slots in `new` (a fresh slot is zeroed whole)
    new: list[int] = []
    try:
        for p in ps:
            got = runner.reserve(p.slot, p.start + len(p.ids), zero=False)
            added += got
            new += got if p.start > 0 else []
    except BaseException:
        st.reset_slots([], added)  # the pages kept by the pieces before the refused one: zeroed, as reserve() does
        raise
    st.reset_slots([p.slot for p in ps if p.start == 0], new)
    dup = shared_pieces(ps)
    run = [p for i, p in enumerate(ps) if i not in dup]  # the pieces computed
    # no host sync until the picks: every index is a PassIndex upload (baton/transfer.py)
    x = upload([t for p in run for t in p.ids], torch.long, dev)
    ctx = _context(run, on_layer=_marks(run, between_layers))
    index = ctx.pass_index(dev)
    # every piece's tokens at their positions, before its pick (penalties)
    runner.sampling.history.record(index.row_slot, index.pos, x)
    with wide_prefill(dev):
        h = runner.model(x, st, ctx)  # [T, hidden]
    computed = dict(zip((i for i in range(len(ps)) if i not in dup), h.split([len(p.ids) for p in run])))
    rows = [computed[dup.get(i, i)] for i in range(len(ps))]  # each piece's hidden rows
    if dup:
        copies = [ps[i] for i in dup]
        dix = _context(copies).pass_index(dev)
        runner.sampling.history.record(
            dix.row_slot, dix.pos, upload([t for p in copies for t in p.ids], torch.long, dev)
        )
        _copy_prompt_states(st, [(ps[j].slot, ps[i].slot, ps[i].start, len(ps[i].ids)) for i, j in dup.items()])
        for i in dup:
            if ps[i].on_layer is not None and ps[i].last:  # its layers are final only now
                for layer in range(runner.cfg.num_hidden_layers):
                    ps[i].on_layer(layer)
    for p, r in zip(ps, rows):
        if p.prompt_logprobs >= 0:
            p.logprobs = prompt_logprobs_of(runner, p, r)
    # each piece's pick from its own last row: the [1, vocab] head call of the piece alone; one host read for all
    picks = [
        runner.sampling.pick_slot(runner.model.logits(r[-1:]), p.slot, p.start + len(p.ids))[:1]
        for p, r in zip(ps, rows)
        if p.last
    ]
    got = iter(torch.cat(picks).tolist() if picks else [])
    toks: list[int | None] = [int(next(got)) if p.last else None for p in ps]
    mp = [i for i, p in enumerate(ps) if p.mtp and runner.has_mtp]
    if mp:  # MTP KV for the pairs (h_t, x_{t+1}), t in each piece's [start, start + n)
        sub = [ps[i] for i in mp]
        nxt = [t for i in mp for t in ps[i].ids[1:] + [int(toks[i] if ps[i].last else ps[i].next_id)]]
        hm = torch.cat([rows[i] for i in mp])
        mctx = _context(sub, rope_offset=1)
        nx = upload(nxt, torch.long, dev)
        with wide_prefill(dev):
            runner.model.mtp(runner.model.model.embed_tokens, hm, nx, mctx.pass_index(dev).pos, st, mctx)
    for p, r, tok in zip(ps, rows, toks):
        if p.last:
            st.position[p.slot].fill_(p.start + len(p.ids))  # kernels, not blocking copies behind the MTP layer
            st.next_token[p.slot].fill_(tok)
            st.hidden[p.slot].copy_(r[-1])
    return toks


@dataclass
class Replay:
    """One session's migration re-prefill (prompt + the tokens generated so far), past its prompt's pieces:
    the generated tokens still to feed as AR rows, W a block (replay_step). Why rows: a prefill piece over
    them is not bitwise the AR decode's state (other kernels, other sums: a token can then differ at a
    rounding edge); W-row blocks are (ModelRunner.rows: row invariance). Costs len / W row passes, shared
    with the other sessions replaying at the same time (each group of a rows_batch pass is bitwise alone)."""

    slot: int
    generated: list[int]
    start: int  # the prompt's length (the slot's position before the first block)
    mtp: bool = False  # write the MTP layer's KV of the replayed pairs too (a prefill's would be there)
    at: int = 0  # tokens fed so far
    token: int | None = None  # the token picked after the last block fed (also the slot's next_token)

    @property
    def done(self) -> bool:
        return self.at >= len(self.generated)


def replay_step(runner, replays: list[Replay]) -> None:
    """One block (up to W tokens) of each replay (distinct slots, none done) in one rows pass: each slot ends
    bitwise in the state the AR decode reached after the block, and picks the token that decode picked next.
    mtp replays also get the MTP layer's KV of their pairs (h_t, x_(t+1)) from the rows' hidden states (the
    prompt's last pair again, with generated[0], before the first block): an mtp session drafts over all of
    it (drafts only: no token depends on it). Raises what batch.rows_batch raises (state untouched then)."""
    from baton.engine.batch import rows_batch
    from baton.transfer import write_slots

    W, has_mtp = runner.width, runner.has_mtp
    blocks = [r.generated[r.at : r.at + W] for r in replays]
    firsts = [
        (r.slot, runner.state.hidden[r.slot : r.slot + 1].clone(), b[:1], r.start - 1)
        for r, b in zip(replays, blocks)
        if r.mtp and has_mtp and r.at == 0
    ]
    hidden: list = []
    toks = rows_batch(runner, [(r.slot, b) for r, b in zip(replays, blocks)], ckpt_unused=True, hidden_out=hidden)
    if firsts:  # (after the rows pass checked the batch: a refused batch leaves every slot untouched)
        runner.mtp_batch(firsts)
    write_slots(runner.state.next_token, [r.slot for r in replays], [t[-1] for t in toks])
    pairs = []
    for r, b, t, h in zip(replays, blocks, toks, hidden):
        end = r.at + len(b)
        if r.mtp and has_mtp:
            pairs.append((r.slot, h, b[1:] + [r.generated[end] if end < len(r.generated) else t[-1]], r.start + r.at))
        r.at, r.token = end, t[-1]
    if pairs:
        runner.mtp_batch(pairs)


LOGPROB_ROWS = 64  # rows of [rows, vocab] logits at a time (64 x 248K: ~64 MB each in fp32, a few such)


@torch.inference_mode()
def prompt_logprobs_of(runner, p: Piece, h: torch.Tensor) -> list:
    """The piece's prompt logprobs from its hidden rows h [n, hidden]: row i (position start + i) scores the
    token after it (ids[i + 1], or next_id past a piece that is not last; a last piece's last row scores the
    generated token, not a prompt one: left out). log_softmax of the raw logits in float32 (no penalty, bias
    or temperature: what the model gives each prompt token), with the p.prompt_logprobs largest alternatives.
    -> [(logprob, [(id, logprob)] * N)] in token order. Costs a [LOGPROB_ROWS, vocab] head call per block."""
    targets = p.ids[1:] + ([] if p.last or p.next_id is None else [p.next_id])
    out = []
    for c in range(0, len(targets), LOGPROB_ROWS):
        want = targets[c : c + LOGPROB_ROWS]
        lp = torch.log_softmax(runner.model.logits(h[c : c + len(want)]).float(), dim=-1)
        chosen = lp.gather(1, upload(want, torch.long, lp.device)[:, None])[:, 0].tolist()
        if p.prompt_logprobs:
            top_v, top_i = lp.topk(p.prompt_logprobs, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
        else:
            tops = [[] for _ in want]
        out += list(zip(chosen, tops))
    return out
