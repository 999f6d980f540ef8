"""Exact mode's second policy at T > 0: speculative rejection sampling (Leviathan et al. 2023; issue 22).

    drafter (decode worker, Draft):  q' = cut(q), draft x = argmax over supp(q') of z + g(seed, pos)
                                     (the drafter's usual Gumbel-max pick, restricted to q''s support)
                                     -> DraftResponse.draft_probs: q' as (token_ids, probs) per draft
    verifier (exact worker, Verify): p = the exact model's processed distribution at that position;
                                     accept x iff a * q'(x) < p(x), a = uniform(seed ^ ACCEPT, pos)
                                     else y = a draw from norm(max(0, p - q')) with Gumbel g(seed ^ RESIDUAL, pos)
                                     the bonus row (no draft): the exact model's own pick, g(seed, pos)

Each position's token is then distributed exactly as p, whatever q' is (the standard argument: P(y) =
q'(y) min(1, p/q') + (1 - sum min(p, q')) (p - q')+(y) / sum (p - q')+ = p(y)), and the randomness is a
pure function of (seed, position): three independent counter-based streams per position (the draft's
Gumbel noise, the acceptance uniform, the residual's Gumbel noise). A seeded request therefore replays
identically run twice, alone or batched, and after a migration, given the same drafting engine and
draft block K (the tokens depend on which positions were drafts and which bonus rows).

The cut (the wire): q' keeps q's most likely tokens until their mass reaches 1 - CUT_EPS, at most
CUT_MAX of them, renormalised; the drafter samples from q' itself, so exactness holds for q' and the
verifier needs only q''s support: <= CUT_MAX (id, prob) pairs per draft, whatever the vocabulary
(acceptance loses at most the cut mass, TV(q, q') <= CUT_EPS unless CUT_MAX binds).

Everything here is row-local on [W, V] chunks (no cross-row op), as the rest of the sampler.
"""

from __future__ import annotations

import math

import torch

from baton.engine.noise import gumbel, uniform

CUT_EPS = 2.0**-16  # the proposal mass a cut may drop
CUT_MAX = 512  # at most this many tokens in a proposal's support
ACCEPT_SALT = 0x41CC3B7D  # xor-ed into the seed's high half: the acceptance uniform's stream
RESIDUAL_SALT = 0x2F6A91E5  # the residual draw's stream


def cut(z: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """mask [W, V] of the processed support -> the proposal's support: for rows[i] (bool [W]) the most
    likely kept tokens up to mass 1 - CUT_EPS, at most CUT_MAX; other rows unchanged."""
    q = torch.softmax(z.masked_fill(~mask, -math.inf), dim=-1)
    vals, idx = torch.sort(q, dim=-1, descending=True, stable=True)
    rank = torch.arange(q.shape[-1], device=q.device)
    before = torch.cumsum(vals, dim=-1) - vals
    keep = (before < 1.0 - CUT_EPS) & (rank[None, :] < CUT_MAX) & (vals > 0)
    cutmask = torch.zeros_like(keep).scatter(1, idx, keep)
    return torch.where(rows[:, None], mask & cutmask, mask)


def judge(p, draft, q, seed_hi, seed_lo, positions, tok) -> torch.Tensor:
    """p, q [W, V] float32 (the verifier's processed distribution, the drafter's q'), draft [W] long
    (-1: no draft on that row), tok [W] the rows' own picks -> each row's token: the draft if accepted,
    else the residual draw; rows without a draft keep tok."""
    has = draft >= 0
    d = draft.clamp(min=0)[:, None]
    pd, qd = p.gather(1, d)[:, 0], q.gather(1, d)[:, 0]
    a = uniform(seed_hi ^ ACCEPT_SALT, seed_lo, positions, 1)[:, 0]
    accept = a * qd < pd
    res = (p - q).clamp(min=0.0)
    base = torch.where((res.sum(-1) > 0)[:, None], res, p)  # all zero only by rounding: then p itself
    g = gumbel(seed_hi ^ RESIDUAL_SALT, seed_lo, positions, p.shape[-1])
    y = (base.log() + g).argmax(-1)  # log 0 = -inf: never a token outside the residual
    return torch.where(has, torch.where(accept, d[:, 0], y), tok)


def dense(ids: torch.Tensor, probs: torch.Tensor, vocab: int, device) -> torch.Tensor:
    """A proposal (ids, probs) -> its [vocab] float32 row."""
    row = torch.zeros(vocab, dtype=torch.float32, device=device)
    row[ids.to(device)] = probs.to(device=device, dtype=torch.float32)
    return row


def sparse(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [V] proposal row -> (ids int64, probs float32) of its support, on the CPU (the wire's form)."""
    row = row.detach().float().cpu()
    ids = torch.nonzero(row > 0)[:, 0]
    return ids, row[ids]


def parse(msgs, drafts: list[int], vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """VerifyRequest.draft_probs (baton.v1.TokenDistribution, one per draft) -> [(ids, probs)]; ValueError
    naming `draft_probs[i]` (INVALID_ARGUMENT) unless each is a distribution over distinct in-vocabulary
    ids, at most CUT_MAX of them, that gives its draft a probability > 0."""
    if len(msgs) != len(drafts):
        raise ValueError(f"draft_probs: {len(msgs)} distributions for {len(drafts)} drafts")
    out = []
    for i, (m, x) in enumerate(zip(msgs, drafts)):
        f = f"draft_probs[{i}]"
        n = len(m.token_ids)
        if n != len(m.probs) or not 1 <= n <= CUT_MAX:
            raise ValueError(f"{f}: {n} token_ids and {len(m.probs)} probs (1..{CUT_MAX} pairs)")
        ids = torch.tensor(list(m.token_ids), dtype=torch.int64)
        probs = torch.tensor(list(m.probs), dtype=torch.float32)
        if int(ids.max()) >= vocab or ids.unique().numel() != n:
            raise ValueError(f"{f}: token_ids must be distinct ids below the vocabulary size {vocab}")
        total = float(probs.double().sum())
        if not bool(torch.isfinite(probs).all()) or float(probs.min()) <= 0 or abs(total - 1.0) > 1e-3:
            raise ValueError(f"{f}: probs must be finite, > 0 and sum to 1 (sum {total:.6g})")
        hit = (ids == x).nonzero()
        if hit.numel() == 0:
            raise ValueError(f"{f}: the draft {x} is outside the distribution's support")
        out.append((ids, probs))
    return out


def to_protos(props) -> list:
    """[(ids, probs)] -> [baton.v1.TokenDistribution]."""
    from baton.v1 import common_pb2

    return [common_pb2.TokenDistribution(token_ids=i.tolist(), probs=p.tolist()) for i, p in props]


def rows(table, logits, slots, positions, live):
    """SamplingTable.pick's per-row inputs of this policy for one eager pass: (prop [M] bool, (draft [M]
    long, -1 = none, q' [M, V])), each None when no live slot proposes / judges (host lists)."""
    if not any(s in table.proposed or s in table.judging for s in live):
        return None, None
    M, V, dev = logits.shape[0], logits.shape[1], logits.device
    sl, ps = slots.tolist(), positions.tolist()
    flags = [s in table.proposed for s in sl]
    prop = torch.tensor(flags, device=dev) if any(flags) else None
    if not any(s in table.judging for s in live):
        return prop, None
    draft = torch.full((M,), -1, dtype=torch.long)
    q = torch.zeros(M, V, dtype=torch.float32, device=dev)
    for i, (s, pos) in enumerate(zip(sl, ps)):
        j = table.judging.get(s, {}).get(pos)
        if j is not None:
            draft[i] = j[0]
            q[i] = dense(j[1], j[2], V, dev)
    return prop, (draft.to(dev), q)
