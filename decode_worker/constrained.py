"""A fast-mode decode's per-token sampling upkeep, around DecodeEngine's token generator (decode_worker/engine.py):

    structured(engine, sid, n, ...)     structured outputs (DecodeEngine.decode's masker): reasoning, then masked
    masked(tokens, masker, ends)        structured outputs: each token list accepted by the session's grammar
                                        and the next pick's mask written before the next step is asked for
    reasoning(engine, sid, n, ...)      structured outputs after a token (StructuredOutput.after_token): until
                                        it, the session decodes unconstrained, as a plain one; with a thinking
                                        budget (after_budget) at most that many tokens, then it is forced
    unbanning(tokens, session, start)   min_tokens: the ban dropped once every pick left is past its end

Both run in the Decode handler's thread, between the token lists the generator yields: a yield returns only
after the scheduler delivered those tokens, and the session asks for its next step only when the handler
asks the generator again, so a write here lands (stream-ordered) before every step that reads it.
"""

from __future__ import annotations

import dataclasses


def structured(engine, session_id: str, n: int, stop_ids, eos_ids, k: int, masker, run_ahead: bool = False):
    """A structured session's decode (bf16, fp8, mtp): reasoning() while its grammar has not begun (its
    budget's forced after_token one masked step), then masked() over the engine's plain decode (no run-ahead,
    no pipelined one-session loop; on mtp speculative rounds too, whose verify rows the session's Masker
    masks: DecodeSession.masker, mtp._round), or, for a thinking budget alone (any_text), the engine's
    unconstrained decode (run_ahead as decode's)."""
    s = engine.get(session_id)
    s.masker = masker  # a fast mtp round writes its verify rows' masks with it (mtp._round)
    try:
        yield from _structured(engine, session_id, n, stop_ids, eos_ids, k, masker, run_ahead)
    finally:
        s.masker = None


def _structured(engine, session_id: str, n: int, stop_ids, eos_ids, k: int, masker, run_ahead: bool):
    ends, c = set(stop_ids) | set(eos_ids), masker.c
    if c.free:  # reasoning first (StructuredOutput.after_token): unconstrained until its token
        left = yield from reasoning(engine, session_id, n, ends, masker, k)
        if left is None:
            return
        n = left
    if c.free:  # the budget spent (after_budget): the next pick is the after_token, the only one its mask allows
        for toks in masked(engine._decode(session_id, 1, stop_ids, eos_ids, k, False, plain=True), masker, ends):
            n -= len(toks)
            yield toks
            if not n or (toks and toks[-1] in ends):
                return
    if c.grammarless:  # any_text: nothing is masked after the after_token
        s = engine.get(session_id)
        p = s.runner.sampling.params[s.slot]
        s.runner.sampling.set(s.slot, dataclasses.replace(p, structured=b""))
        yield from engine.decode(session_id, n, stop_ids=stop_ids, eos_ids=eos_ids, k=k, run_ahead=run_ahead)
        return
    yield from masked(engine._decode(session_id, n, stop_ids, eos_ids, k, False, plain=True), masker, ends)


def masked(tokens, masker, ends):
    """tokens: the generator of a session that neither runs ahead nor pipelines its own steps (its next step
    waits for this loop). A list ending the request (an end token) needs no next mask."""
    for toks in tokens:
        if not (toks and toks[-1] in ends):
            masker.step(toks)
        yield toks


def reasoning(engine, session_id: str, n: int, ends: set, masker, k: int):
    """A structured session before its grammar's after_token (a reasoning model's </think>), every token allowed:
    its parameters lose the structure meanwhile, so its steps take the plain / lite graphs as any unconstrained
    session's (all mask bits set is the unconstrained pick, bitwise: the same tokens) instead of the full sampled
    graph for the whole batch, and the after_token is one more end (no run-ahead: a step past it is undone).
    With a thinking budget (after_budget) it decodes at most the budget's tokens left. Each token list goes to
    the matcher (masker.commit); at the after_token, or at the budget's end, the structure is set again and the
    next pick's mask written (the grammar's, or the budget's: the after_token alone). Yields the token lists;
    -> the tokens still allowed after, or None when the request ended first (an end token, n tokens). The
    parameters are restored however it ends."""
    s = engine.get(session_id)
    table, slot = s.runner.sampling, s.slot
    p = table.params[slot]
    free = dataclasses.replace(p, structured=b"")
    left = masker.c.budget_left
    steps = n if left is None else min(n, left)
    produced = 0
    if steps:
        table.set(slot, free)
    try:
        for toks in engine._decode(session_id, steps, tuple(ends | {masker.c.after}), (), k, False) if steps else ():
            masker.commit(toks)
            produced += len(toks)
            if toks and toks[-1] in ends:  # the request's own end (the after_token may be one too)
                yield toks
                return None
            if toks and toks[-1] == masker.c.after and not masker.c.free:
                table.set(slot, p)
                masker.step()  # the first constrained pick's mask, before the next step is asked for
                yield toks
                return n - produced if produced < n else None
            yield toks
        if produced < n:  # the budget's end (spent): the after_token's mask, before the next step is asked for
            table.set(slot, p)
            masker.step()
            return n - produced
    finally:
        if table.params[slot] is free:
            table.set(slot, p)
    return None


def unbanning(tokens, s, start: int):
    """s: the DecodeSession, start: its state's position when the decode began (the pending token's; the first
    step picks start + 1). Once the next pick is at or past the ban's end, the slot's parameters lose the ban,
    so its steps may take the plain / lite graphs again: past its end the ban adds -0.0, the same bits."""
    table = s.runner.sampling
    p, produced = table.params[s.slot], 0
    for toks in tokens:
        produced += len(toks)
        if p is not None and start + produced + 1 >= p.ban_end:
            if table.params[s.slot] is p:  # (unless the caller set others since)
                table.set(s.slot, dataclasses.replace(p, ban_end=0, banned=()))
            p = None
        yield toks
