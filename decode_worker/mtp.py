"""MTP speculation on the decode worker: the MTP head drafts, the BF16 model verifies (fast mode, engine
mtp), for one session or for many at once.

    chains(engine, [(s, k), ...])    finalise each session's pending MTP pairs and draft k tokens, every
                                     session's chain step in one pass (ModelRunner.mtp_batch)
    pending_pairs(s, p, ids, h)      after a verify that kept rows 0..m from position p: the pairs the
                                     next chain finalises, (h_{p-1}, ids[0]) .. (h_{p+m}, next)
    rounds(engine, [(s, k), ...])    one round for each session: the chains together, then one verify
                                     pass over every session's block (speculation.verify_blocks)

Each session's round is bitwise the one it runs alone: each group of an MTP pass is its chain step
alone (batch invariance of the fused MTP pass, baton/engine/fused_blocks.py; one group at a time on the
eager path), and verify_blocks leaves each slot as verify_block alone would, with the same hidden rows.
Runs under the engine's compute lock (DecodeEngine.mtp, a Gather of concurrent rounds).
"""

from __future__ import annotations

import torch

from baton.engine.speculation import verify_blocks


def chains(engine, items: list) -> list[list[int]]:
    """items [(session, k)] of distinct sessions -> each session's k drafts: finalises its pending MTP
    pairs (h_{P-1}, x_P) ... and drafts k tokens, the MTP output row chained as the next step's hidden.
    Every session's chain step runs together (ModelRunner.mtp_batch per runner: the catch-up pass over
    each session's pending pairs, then k - 1 one-pair steps), each bitwise its chain alone."""
    drafts: list[list[int]] = [[] for _ in items]
    h: list = [None] * len(items)
    idx = [0] * len(items)  # KV index of each session's next pair
    for step in range(max((k for _, k in items), default=0)):
        by_runner: dict[int, list[int]] = {}
        for i, (s, k) in enumerate(items):
            if k > step:
                by_runner.setdefault(id(s.runner), []).append(i)
        for live in by_runner.values():
            r, groups = items[live[0]][0].runner, []
            for i in live:
                s = items[i][0]
                if step == 0:
                    groups.append((s.slot, s.mtp_pairs_h, s.mtp_pairs_ids, s.mtp_start))
                    idx[i] = s.mtp_start + len(s.mtp_pairs_ids)
                else:
                    groups.append((s.slot, h[i][None], [drafts[i][-1]], idx[i]))
                    idx[i] += 1
            toks, outs = r.mtp_batch(groups)
            for i, t, o in zip(live, toks, outs):
                drafts[i].append(engine.drafter.propose(items[i][0], step, t[-1]))
                h[i] = o[-1]  # chained: the MTP output row is the next step's hidden
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
    for (s, _k), drafts in zip(items, chains(engine, items)):
        st = s.runner.state
        prep.append((s, int(st.next_token[s.slot]), int(st.position[s.slot]), drafts))
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
