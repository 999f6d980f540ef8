"""Exact mode's Verify on the prefill worker: concurrent sessions' blocks in one batched rows pass.

    verify_batch(runner, [VerifyItem, ...])  -> per item (m, next, position, logprobs, hidden), or the
                                                ValueError / WindowError of that item alone

Runs under ExactEngine._compute, as the Gather of concurrent Verify calls (ExactEngine.verifies). Every
block runs through speculation.verify_blocks: each slot ends bitwise as verify_block alone would leave it,
whatever other blocks share the pass. An item that fails its checks (its t0 is not the pending token,
another Verify of its session in the batch, its window) fails alone, its state untouched.
A structured session (its masker, baton/grammar.py) gets each row's grammar mask before the pass (row j after
t0, d1..dj) and its matcher takes the kept drafts and the new token after it.

Verdict hidden rows (VerifyItem.want_hidden, exact mode with mtp drafts): the pass's final-normed hidden
rows of the kept tokens t0, d1..dm, [m + 1, hidden] on the host, all items' rows in one device read. The
decode worker's MTP head reads them instead of running the kept rows through its own BF16 model
(decode_worker/drafting.py): the same rows, which it would compute bitwise equal (row and batch
invariance), so its drafts are unchanged and the round's second pass of the model is gone.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from baton.engine.parts import PartClock
from baton.engine.speculation import verify_blocks
from baton.transfer import read_slots


class VerifyItem(NamedTuple):
    session: object  # prefill_worker.session.Session
    tokens: list[int]  # [t0, d1..dk]
    dists: list | None  # REJECTION policy: the drafter's q' of d1..dk (rejection.parse)
    want_hidden: bool = False
    round: tuple | None = None  # (id, size) of the Draft batch the drafts came from (VerifyRequest.round)


def verify_batch(runner, items: list[VerifyItem], parts: dict | None = None) -> list:
    """See the module docstring. items: VerifyItem, or plain (session, tokens, dists[, want_hidden]) tuples.
    parts: where the run's time goes (baton/engine/parts.py: "run_checks", then verify_blocks' parts; the
    kept hidden rows and logprobs are read inside "run_pass", before the rewind is queued, so the reply
    does not wait for the rewind's kernels: the next pass on the stream does)."""
    clock = PartClock(parts)
    items = [VerifyItem(*it) for it in items]
    if not items:
        return []
    st, out, ok = runner.state, [None] * len(items), []
    slots = [it.session.slot for it in items]  # each session's pending token and position: one read for all
    pendings, starts = zip(*read_slots(torch.stack((st.next_token, st.position), 1), slots))
    for i, (it, pending, pos) in enumerate(zip(items, pendings, starts)):
        if it.tokens[0] != pending:
            out[i] = ValueError(f"tokens[0]: {it.tokens[0]} is not the last committed token {pending}")
        elif any(it.session.slot == items[j].session.slot for j in ok):
            out[i] = ValueError("tokens: another Verify of this session is in flight")
        else:
            try:
                runner.check_window(pos, len(it.tokens))
                ok.append(i)
            except ValueError as e:
                out[i] = e
    if not ok:
        clock.mark("checks")
        return out
    table = runner.sampling
    for i in list(ok):
        it = items[i]
        masker = getattr(it.session, "masker", None)
        if masker is not None:  # structured outputs: row j's mask after t0, d1..dj (baton/grammar.py)
            try:
                masker.block(starts[i], it.tokens)
            except (ValueError, RuntimeError) as e:
                out[i] = ValueError(str(e))
                ok.remove(i)
                continue
        if it.dists is not None:  # row j of the block picks position pos + j + 1: draft d_{j+1}'s
            table.judge(it.session.slot, starts[i] + 1, it.tokens[1:], it.dists)
    if not ok:
        clock.mark("checks")
        return out
    hidden: list | None = [] if any(items[i].want_hidden for i in ok) else None
    clock.mark("checks")
    read: list = []

    def outputs(res: list) -> None:  # the pass's outputs, read before the rewind is queued: no wait for it
        rows = [(items[i].want_hidden, m, h) for i, (m, _), h in zip(ok, res, hidden or [None] * len(ok))]
        read.extend(zip(_kept_rows(rows), [table.logprobs(items[i].session.slot, m + 1) for i, (m, _) in zip(ok, res)]))

    try:
        blocks = [(items[i].session.slot, items[i].tokens) for i in ok]
        res = verify_blocks(runner, blocks, hidden_out=hidden, clock=clock, outputs=outputs)
    finally:
        for i in ok:
            table.end_judge(items[i].session.slot)
    for i, (m, nxt), (h, lp) in zip(ok, res, read):  # the slot now holds t0, d1..dm: position start + m + 1
        out[i] = (m, nxt, starts[i] + m + 1, lp, h)
        masker = getattr(items[i].session, "masker", None)
        if masker is not None:  # the kept drafts and the new pending token
            masker.commit([*items[i].tokens[1 : m + 1], nxt])
            if masker.c.grammarless and not masker.c.free:  # a thinking budget alone, past its end: no more masks
                slot = items[i].session.slot
                items[i].session.masker = None
                table.set(slot, dataclasses.replace(table.params[slot], structured=b""))
    clock.mark("finish")
    return out


def _kept_rows(rows: list[tuple[bool, int, torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """[(wanted, m, the block's hidden rows [k + 1, hidden])] -> per block its rows 0..m on the host (None
    where not wanted), every wanted block's rows in one device read."""
    want = [h[: m + 1] for w, m, h in rows if w]
    if not want:
        return [None] * len(rows)
    host = torch.cat(want).to("cpu").split([h.shape[0] for h in want])
    it = iter(host)
    return [next(it) if w else None for w, _, _ in rows]
