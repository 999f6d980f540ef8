"""A fast-mode decode's per-token sampling upkeep, around DecodeEngine's token generator (decode_worker/engine.py):

    masked(tokens, masker, ends)        structured outputs: each token list accepted by the session's grammar
                                        and the next pick's mask written before the next step is asked for
    unbanning(tokens, session, start)   min_tokens: the ban dropped once every pick left is past its end

Both run in the Decode handler's thread, between the token lists the generator yields: a yield returns only
after the scheduler delivered those tokens, and the session asks for its next step only when the handler
asks the generator again, so a write here lands (stream-ordered) before every step that reads it.
"""

from __future__ import annotations

import dataclasses


def masked(tokens, masker, ends):
    """tokens: the generator of a session that neither runs ahead nor pipelines its own steps (its next step
    waits for this loop). A list ending the request (an end token) needs no next mask."""
    for toks in tokens:
        if not (toks and toks[-1] in ends):
            masker.step(toks)
        yield toks


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
