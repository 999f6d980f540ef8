"""MTP speculation on the decode worker: the MTP head drafts, the BF16 model verifies (fast mode, engine
mtp), for one session or for many at once.

    chain(engine, s, k)              finalise the session's pending MTP pairs, draft k tokens (per session)
    pending_pairs(s, p, ids, h)      after a verify that kept rows 0..m from position p: the pairs the
                                     next chain finalises, (h_{p-1}, ids[0]) .. (h_{p+m}, next)
    rounds(engine, [(s, k), ...])    one round for each session: chains one after another, then one
                                     verify pass over every session's block (speculation.verify_blocks)

Each session's round is bitwise the one it runs alone: the chain is its own, and verify_blocks leaves
each slot as verify_block alone would (row and batch invariance), with the same hidden rows.
Runs under the engine's compute lock (DecodeEngine.mtp, a Gather of concurrent rounds).
"""

from __future__ import annotations

import torch

from baton.engine.speculation import verify_blocks


def chain(engine, s, k: int) -> list[int]:
    """Finalises pending MTP pairs and drafts k tokens. Pending pairs: (h_{P-1}, x_P) ... ."""
    r = s.runner
    n = len(s.mtp_pairs_ids)
    r.mtp_h.zero_()
    r.mtp_h[:n].copy_(s.mtp_pairs_h)
    r.mtp_ids.zero_()
    r.mtp_ids[:n] = torch.tensor(s.mtp_pairs_ids, device=r.device)
    r.mtp_start.fill_(s.mtp_start)
    r.replay_mtp(s.slot, n)
    drafts = [engine.drafter.propose(s, 0, int(r.mtp_tok[n - 1]))]
    h = r.mtp_out[n - 1].clone()  # chained: the MTP output row is the next step's hidden
    idx = s.mtp_start + n  # KV index of the next pair
    for i in range(1, k):
        r.mtp_h[0].copy_(h)
        r.mtp_ids[0] = drafts[-1]
        r.mtp_start.fill_(idx)
        r.replay_mtp(s.slot, 1)
        drafts.append(engine.drafter.propose(s, i, int(r.mtp_tok[0])))
        h = r.mtp_out[0].clone()
        idx += 1
    return drafts


def pending_pairs(s, p: int, ids: list[int], h_rows: torch.Tensor) -> None:
    """After m+1 accepted rows from position p (ids = [t0, d1..dm, next]; h_rows [>= m+1, hidden] the
    final-normed hidden rows of the accepting rows pass): pairs (h_{p-1}, ids[0]) .. (h_{p+m}, next) at
    KV index p-1 onward."""
    h_prev = s.mtp_pairs_h[-1:].clone()  # h_{p-1}
    s.mtp_pairs_h = torch.cat([h_prev, h_rows[: len(ids) - 1]])
    s.mtp_pairs_ids = ids
    s.mtp_start = p - 1


def rounds(engine, items: list) -> list[list[int]]:
    """items [(session, k)] of distinct sessions -> each session's emitted tokens d1..dm, next."""
    prep = []
    for s, k in items:
        st = s.runner.state
        t0, p = int(st.next_token[s.slot]), int(st.position[s.slot])
        prep.append((s, t0, p, chain(engine, s, k)))
    by_runner: dict[int, list[int]] = {}
    for i, (s, *_rest) in enumerate(prep):
        by_runner.setdefault(id(s.runner), []).append(i)
    out: list = [None] * len(prep)
    for idx in by_runner.values():
        r = prep[idx[0]][0].runner
        hidden: list[torch.Tensor] = []
        res = verify_blocks(r, [(prep[i][0].slot, [prep[i][1]] + prep[i][3]) for i in idx], hidden_out=hidden)
        for i, (m, nxt), h in zip(idx, res, hidden):
            s, t0, p, drafts = prep[i]
            pending_pairs(s, p, [t0] + drafts[:m] + [nxt], h)
            s.rounds += 1
            s.emitted_in_rounds += m + 1
            out[i] = drafts[:m] + [nxt]
    return out
