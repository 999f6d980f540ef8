"""Exact-mode drafting on the decode worker: concurrent sessions' Draft calls run as one batch.

    draft_batch(engine, [(session, k, verdict), ...])  -> per item its k drafts (a Drafted list, tagged with
                                                          the batch's round), or the error of that item

Runs under DecodeEngine._compute (DecodeEngine.drafts, a baton/engine/gather.py Gather). Lifecycle of one
item, every phase over the whole batch before the next:
    1. checks: one Draft in flight a session, the window and KV pages for the pending rows and k + 2
       more, the verdict (m, next) against the drafts outstanding. A refused item fails alone, its
       session untouched (retryable).
    2. the verdict on the last round's drafts. bf16 / fp8 drafting consumed t0, d1..d(k-1), so a session
       that did not accept them all is restored from the round's snapshot and the accepted rows replayed
       (rows_to_replay). mtp drafting consumed nothing on the BF16 state: the accepted rows t0, d1..dm
       run now, and their hidden rows become the session's pending MTP pairs (mtp.pending_pairs). The
       rows of every session of a runner run as one pass (baton/engine/batch.py rows_batch: ragged
       groups, each bitwise as alone; on CUDA one fused BatchedRows pass). Before, each session was its
       own pass of the 9B: at 8 sessions the verdicts alone were most of a round.
       An mtp verdict with the exact worker's hidden rows of t0, d1..dm (DraftRequest.verdict_hidden, the
       router's default) runs no rows at all: the pairs take those rows, bitwise the ones the pass would
       give, and only the position and the pending token advance. The BF16 state's GDN, KV and hidden row
       then stay behind, unread: an mtp session drafts from its MTP
       pairs alone. So the session is draft_only from then on, and a later verdict without hidden rows
       is refused (the rows it would run start from a stale state). This took the round's second pass of
       the 9B away: ~30% of a round's device time at 1 to 32 sessions on the H100
       (benchmarks/results/gpu-h100-2026-12-05-night.md, "verdict rows").
    3. k drafts from next_token t0: mtp sessions' chains together (mtp.chains); bf16 / fp8 sessions
       snapshot their slot and draft position by position, one ar_batch per runner for all of them
       (Drafter.propose: the proposal is what the state consumes next). After: bf16 / fp8 state has
       consumed t0, d1..d(k-1), next_token is t0 again until the verdict.
A structured session with a draft Masker (DecodeSession.draft_masker, decode_worker/draft_calls.py) drafts
under its grammar: phase 2 advances the Masker over the verdict's kept tokens (_grammar_verdicts), and before
each draft's pick in phase 3 the Masker writes that pick's mask, the grammar's after t0, d1..dj
(Masker.draft_row). Such a batch's MTP chains run step by step and its bf16 / fp8 drafts unpipelined (each
step's mask needs the picks before it on the host), but only while the grammar binds its drafts (mtp.binds):
a session in its reasoning part (before a grammar's after_token, with budget to spare) drafts unmasked.
"""

from __future__ import annotations

import random

import torch

from baton.engine.batch import rows_batch
from baton.engine.parts import PartClock
from baton.engine.slots import SessionLimit
from baton.engine.speculation import check_verdict, known_ahead, rows_to_replay
from baton.transfer import read_slots, to_device, write_slots
from decode_worker import mtp


class Drafted(list):
    """A session's drafts, and `round`: (this batch's random id, how many of its sessions drafted), which the
    router relays with the Verify so that the exact worker verifies the batch's sessions in one pass
    (DraftResponse.round; baton/engine/gather.py, "Round groups")."""

    round: tuple[int, int] = (0, 0)


def draft_batch(engine, items: list, parts: dict | None = None) -> list:
    """See the module docstring. items [(session, k, verdict or None)] -> per item list of k drafts, or the
    ValueError / SessionLimit of that item alone. parts: where the run's time goes (baton/engine/parts.py):
    "run_checks", "run_verdicts" (the last round's verdicts applied), "run_snapshot" (the pending tokens read,
    the bf16 / fp8 slots snapshotted), "run_chains" (mtp), "run_ar" (bf16 / fp8 drafts)."""
    clock = PartClock(parts)
    out: list = [None] * len(items)
    ok: list[int] = []
    seen: set[str] = set()
    # each session's position: host-known (loaded_position: as loaded, or as its last mtp Draft batch left it),
    # else one read a runner; cleared until this batch ends (a failure leaves it to be read again)
    pos = {i: s.loaded_position for i, (s, _, _) in enumerate(items) if s.loaded_position is not None}
    pos |= _per_slot(items, [i for i in range(len(items)) if i not in pos], lambda st: st.position)
    for s, _, _ in items:
        s.loaded_position = None
    for i, (s, k, verdict) in enumerate(items):  # 1. checks, before anything is consumed
        r = s.runner
        try:
            if verdict is not None and len(verdict) > 2 and verdict[2] is not None and s.engine != "mtp":
                raise ValueError(f"verdict_hidden: only for mtp drafts, not {s.engine}")
            if s.id in seen:
                raise ValueError("session: another Draft of this session is in flight")
            seen.add(s.id)
            pending = len(s.drafts) + 1 if verdict is not None else 0
            r.check_window(pos[i] + pending, k + 2)
            r.reserve(s.slot, pos[i] + pending + k + 2)  # pages grown at the round boundary
            if verdict is not None:
                if not s.drafts:
                    raise ValueError("has_verdict: no drafts outstanding for this session")
                check_verdict(verdict[0], len(s.drafts))
            ok.append(i)
        except (ValueError, SessionLimit) as e:  # SessionLimit: KV pages exhausted
            out[i] = e
    clock.mark("checks")
    known: dict[int, tuple[int, int]] = {}  # item -> (pending token, position) its verdict left, host-known
    judged = [i for i in ok if items[i][2] is not None]
    kept = {i: [items[i][0].draft_t0] + items[i][0].drafts[: items[i][2][0]] for i in judged}
    _verdicts(items, judged, out, pos, known)  # 2.
    _grammar_verdicts(items, [i for i in judged if out[i] is None], kept)
    clock.mark("verdicts")
    chained, ar = [], []
    live = [i for i in ok if out[i] is None]
    unknown = [i for i in live if i not in known]  # one read a runner, of these alone (none in steady mtp rounds)
    pending = {**_per_slot(items, unknown, lambda st: torch.stack((st.next_token, st.position), 1)), **known}
    for i in live:
        s = items[i][0]
        s.draft_t0, s.draft_at = pending[i]
        if s.engine == "mtp":
            chained.append(i)
        else:
            s.drafts = []
            ar.append(i)
    for st, _, slots in _by_runner(items, ar):  # one snapshot a runner, a few kernels for all its slots
        st.snapshot_slots(slots)
    clock.mark("snapshot")
    bound, free = _binding(items, live)  # sessions whose grammar masks their drafts, and the rest of the masked
    steps = [(items[i][0], items[i][1]) for i in chained]
    with mtp.unbound(free):
        rows = mtp.mask_steps(
            steps, [(s.draft_at, s.draft_t0) for s, _ in steps], bound, lambda s, _p, t: _draft_row(s, t)
        )
        for i, drafts in zip(chained, mtp.chains(engine, steps, rows)):  # 3.
            items[i][0].drafts, out[i] = drafts, list(drafts)
        clock.mark("chains")
        _ar_drafts(engine, items, ar, out, bound)
    clock.mark("ar")
    done = [i for i in range(len(items)) if isinstance(out[i], list)]
    tag = (random.getrandbits(63) or 1, len(done))
    for i in done:
        out[i] = Drafted(out[i])
        out[i].round = tag
        if items[i][0].engine == "mtp":  # MTP drafting leaves the BF16 position at the pending token's
            items[i][0].loaded_position = items[i][0].draft_at
    return out


def _by_runner(items: list, idx) -> list[tuple[object, list[int], list[int]]]:
    """[(runner's state, item indexes, their slots)] of items idx, one entry per runner, in order."""
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(id(items[i][0].runner), []).append(i)
    return [(items[g[0]][0].runner.state, g, [items[i][0].slot for i in g]) for g in groups.values()]


def _per_slot(items: list, idx, field) -> dict[int, int]:
    """{i: field(state)[slot of items[i]]} for i in idx (a number; a list for an [S, n] field), one host read
    per runner (transfer.read_slots)."""
    return {i: v for st, g, slots in _by_runner(items, idx) for i, v in zip(g, read_slots(field(st), slots))}


def _set_next(items: list, pairs: list[tuple[int, int]]) -> None:
    """next_token[slot of items[i]] = v for (i, v) in pairs, one copy per runner (transfer.write_slots)."""
    value = dict(pairs)
    for st, g, slots in _by_runner(items, value):
        write_slots(st.next_token, slots, [value[i] for i in g])


def _verdicts(items: list, idx: list[int], out: list, pos: dict[int, int], known: dict) -> None:
    """Phase 2 for items idx (checked, each with a verdict; pos: each item's position, read in phase 1): per runner one rows pass over every session's
    rows to run (bf16 / fp8: the replay after its restore; mtp: t0, d1..dm); a pass that raises fails
    its items. known: gets _given's host-known (pending token, position) of its items."""
    by_runner: dict[int, list[tuple[int, list[int]]]] = {}
    nexts: list[tuple[int, int]] = []  # (item, its next token): written once a runner, at the end
    rewound: list[int] = []  # bf16 / fp8 items restored from the round's snapshot
    given: list[tuple[int, list[int], torch.Tensor]] = []  # mtp items whose verdict brought the rows' hidden
    for i in idx:
        s, _, (m, nxt, *h) = items[i]
        if s.engine == "mtp":
            rows = [s.draft_t0] + s.drafts[:m]  # MTP drafting consumed nothing on the BF16 state
            if h and h[0] is not None:
                given.append((i, rows, h[0]))
                continue
            if s.draft_only:
                out[i] = ValueError(
                    "verdict_hidden: required for this session: its earlier verdicts came with the exact"
                    " worker's hidden rows, so its BF16 state did not advance"
                )
                continue
        else:
            restore, rows = rows_to_replay(s.drafts, s.draft_t0, m)
            if restore:
                rewound.append(i)
        if rows:
            by_runner.setdefault(id(s.runner), []).append((i, rows))
        else:
            nexts.append((i, nxt))
            s.drafts = []
    for st, _, slots in _by_runner(items, rewound):  # before any rows pass; one restore a runner
        st.restore_slots(slots)
    for group in by_runner.values():
        r = items[group[0][0]][0].runner
        starts = read_slots(r.state.position, [items[i][0].slot for i, _ in group])
        hidden: list = []
        try:  # no row checkpoint is read after: drafting goes on from the state, the pairs from the hidden rows
            rows_batch(r, [(items[i][0].slot, rows) for i, rows in group], ckpt_unused=True, hidden_out=hidden)
        except (ValueError, SessionLimit) as e:
            for i, _ in group:
                out[i] = e
            continue
        for (i, rows), p, h in zip(group, starts, hidden):
            s, _, (_, nxt, *_) = items[i]
            if s.engine == "mtp":
                mtp.pending_pairs(s, p, rows + [nxt], h)
            nexts.append((i, nxt))
            s.drafts = []
    nexts += _given(items, given, pos, known)
    _set_next(items, nexts)


def _given(
    items: list, given: list[tuple[int, list[int], torch.Tensor]], pos: dict[int, int], known: dict
) -> list[tuple[int, int]]:
    """The mtp verdicts that came with their kept rows' hidden rows (host [m + 1, hidden]): per runner one
    upload of them all, the pairs from them, and the position past the kept rows (what drafting reads of
    what rows_batch would have left: the MTP pass records each pair's token in the token history itself,
    runner.mtp_batch). -> (item, next token) of each; known[item] = (next token, position): what the slot
    holds once these writes ran, so drafting need not read them back."""
    nexts = []
    for st, g, slots in _by_runner(items, dict.fromkeys(i for i, _, _ in given)):
        in_g = set(g)
        mine = [x for x in given if x[0] in in_g]
        starts = [pos[i] for i, _, _ in mine]  # read by the checks (phase 1): mtp slots have not moved since
        h = to_device(torch.cat([x[2] for x in mine]), st.position.device).split([len(x[1]) for x in mine])
        for (i, kept, _), p, hs in zip(mine, starts, h):
            s, _, (_, nxt, _) = items[i]
            mtp.pending_pairs(s, p, kept + [nxt], hs)
            nexts.append((i, nxt))
            known[i] = (nxt, p + len(kept))
            s.drafts, s.draft_only = [], True
        write_slots(st.position, slots, [p + len(x[1]) for p, x in zip(starts, mine)])
    return nexts


def _grammar_verdicts(items: list, idx: list[int], kept: dict) -> None:
    """Phase 2's end for the items idx (their verdict applied) whose session has a draft Masker: it accepts
    the committed tokens kept[i] = t0, d1..dm (t0 at the last round's draft_at) that it has not seen (t0 is
    seen once a draft row was written). A refusal (the Verify keeps only what the grammar allows: not
    expected) drops the Masker and unmasks the slot, so the session's drafts go on unconstrained."""
    for i in idx:
        s = items[i][0]
        mk = s.draft_masker
        if mk is None:
            continue
        try:
            seen = mk.next - s.draft_at
            if seen not in (0, 1):
                raise ValueError(f"the Masker is at {mk.next}, the round's t0 at {s.draft_at}")
            mk.commit(kept[i][seen:])
        except ValueError:
            _unmask(s)


def _unmask(s) -> None:
    """Drops session s's draft Masker: its drafts go on unconstrained (the next Draft sets its row without the
    grammar; until then the slot's picks ignore its masks)."""
    s.draft_masker = None
    s.runner.sampling.unmasked(s.slot, True)


def _draft_row(s, tokens: list[int]) -> None:
    """Session s's mask of the pick after tokens = [t0, d1..dj] (Masker.draft_row); a Masker out of step (not
    expected) is dropped, failing no draft."""
    if s.draft_masker is None:
        return
    try:
        s.draft_masker.draft_row(s.draft_at, tokens)
    except (RuntimeError, ValueError):
        _unmask(s)


def _binding(items: list, live: list[int]) -> tuple[set[int], list]:
    """Of the live items' sessions with a draft Masker: (ids of those whose grammar may refuse one of their k
    drafts: mtp.binds, the sessions with Masker out of step dropped; the others' sessions, to draft unmasked)."""
    bound, free = set(), []
    for i in live:
        s, k, _ = items[i]
        if s.draft_masker is None:
            continue
        try:
            if mtp.binds(s.draft_masker, s.draft_at, s.draft_t0, k):
                bound.add(id(s))
            else:
                free.append(s)
        except (RuntimeError, ValueError):  # out of step (not expected): its drafts go on unconstrained
            _unmask(s)
    return bound, free


def _ar_drafts(engine, items: list, ar: list[int], out: list, bound: frozenset | set = frozenset()) -> None:
    """Phase 3 for bf16 / fp8 sessions: position by position, one ar_batch per runner (pipelined on a
    fused runner with batching when the drafter knows its drafts ahead: _ar_pipelined; a binding session,
    whose id is in `bound`, never: its pick masks are written before each step, from the drafts before it)."""
    left = [i for i in ar if id(items[i][0]) in bound]
    for _, g, _ in _by_runner(items, [i for i in ar if id(items[i][0]) not in bound]):
        if not _ar_pipelined(engine, items, g):
            left += g
    cur = {i: items[i][0].draft_t0 for i in left}  # the token each session feeds next
    for step in range(max((items[i][1] for i in left), default=0)):
        by_runner: dict[int, list[int]] = {}
        for i in left:
            if items[i][1] > step:
                by_runner.setdefault(id(items[i][0].runner), []).append(i)
                if id(items[i][0]) in bound:
                    _draft_row(items[i][0], [items[i][0].draft_t0] + items[i][0].drafts)
        for idx in by_runner.values():
            r = items[idx[0]][0].runner
            write_slots(r.state.next_token, [items[i][0].slot for i in idx], [cur[i] for i in idx])
            owns = r.ar_batch([items[i][0].slot for i in idx])
            for i, own in zip(idx, owns):
                s = items[i][0]
                cur[i] = engine.drafter.propose(s, step, own)  # the proposal is what the state consumes next
                s.drafts.append(cur[i])
    _set_next(items, [(i, items[i][0].draft_t0) for i in ar])
    for i in ar:
        out[i] = list(items[i][0].drafts)


def _ar_pipelined(engine, items: list, idx: list[int]) -> bool:
    """Phase 3 for the bf16 / fp8 items idx of one runner, its steps launched ahead of their reads: on a
    fused runner with batching, whose batched step consumes and sets next_token on the device, when the
    drafter knows its drafts ahead or takes the model's own (Drafter.ahead). Step j runs the sessions still
    drafting (k > j), as the step-by-step loop does; a draft known ahead is written into next_token (a
    non-blocking copy) before the step that consumes it, a model's own pick is already there. Up to the
    runner's free phases of steps are in flight (the fast-mode scheduler's step may hold one), so the
    host reads step j while step j + 1 runs, and no position read a step (ar_batch's reserve_next: the
    pages were reserved in phase 1). -> False (nothing done) when it does not apply."""
    r = items[idx[0]][0].runner
    b = getattr(r, "batched", None)
    if b is None or len(idx) > b.max_rows or getattr(r, "fast", None) is None:
        return False
    known = known_ahead(engine.drafter, [items[i][:2] for i in idx])
    if known is None:
        return False
    forced = dict(zip(idx, known))
    st, own, flight = r.state, {}, []
    room = max(1, b.free_phases())
    write_slots(st.next_token, [items[i][0].slot for i in idx], [items[i][0].draft_t0 for i in idx])
    for step in range(max(items[i][1] for i in idx)):
        live = [i for i in idx if items[i][1] > step]
        feed = [(i, forced[i][step - 1]) for i in live if step and forced[i][step - 1] is not None]
        if feed:
            write_slots(st.next_token, [items[i][0].slot for i, _ in feed], [v for _, v in feed])
        if len(flight) >= room:
            _collected(flight.pop(0), own)
        flight.append((step, live, r.ar_batch_launch([items[i][0].slot for i in live])))
    for f in flight:
        _collected(f, own)
    for i in idx:
        k, f = items[i][1], forced[i]
        items[i][0].drafts = [f[j] if f[j] is not None else own[i, j] for j in range(k)]
    return True


def _collected(launched, own: dict) -> None:
    step, live, collect = launched
    for i, t in zip(live, collect()):
        own[i, step] = t
