"""The pure tensor code of the sampler (baton/engine/sampling.py has the rules and the per-slot table):

    tok, lp, top_lp, top_ids = sample(logits, slots, positions, table, logprobs=True)

logits [M, V] -> each row's token by its slot's parameters in `table` (a SamplingTable), in chunks of the
table's width W for every torch float op (padded with the scratch slot: kernels see the one-slot shape);
on CUDA the token itself comes from baton/kernels/pick.py (sort-free, row-invariant by construction), on
the CPU from each chunk's live rows sorted. See sampling.py's docstring for the order of the steps and
the invariants."""

from __future__ import annotations

import math

import torch

from baton.engine import rejection
from baton.engine.noise import gumbel
from baton.engine.penalties import penalize

MAX_LOGPROBS = 20


def _tempered(logits, slots, positions, t, penal: bool, penalties: bool = True):
    """Rows' penalized, biased and banned logits x (float32) and tempered z = x / T (T = 0 rows: x), [M, V] each.
    Integer counts, elementwise ops and one add per (row, biased id): a row's values are bitwise the same
    for any row count. penalties=False skips the penalties alone (no row penalized: they leave x as it is)."""
    x = logits.float()
    if penal:  # neutral rows: x bitwise unchanged (penalties.py; the bias pads add -0.0)
        V = logits.shape[-1]
        if penalties:
            x = penalize(
                x, *t.history.counts(slots, positions, V), t.repetition[slots], t.presence[slots], t.frequency[slots]
            )
        x = x.scatter_add(1, t.bias_ids[slots], t.bias_vals[slots])  # distinct ids a row: one add each
        banning = (positions < t.ban_end[slots])[:, None]  # min_tokens: -inf on the banned ids, -0.0 past the end
        x = x.scatter_add(1, t.ban_ids[slots], torch.where(banning, t.ban_vals[slots], -0.0))
        if t.mask_bits.shape[2] * 32 >= V:  # structured outputs: a masked slot's tokens outside its bits get -inf
            words = t.mask_bits[slots, positions % t.mask_bits.shape[1]]  # [M, words]: the row's position's mask
            bits = ((words[:, :, None] >> t.bit_shifts) & 1).flatten(1)[:, :V]
            x = x.masked_fill((bits == 0) & t.masked[slots][:, None], -math.inf)
    T = t.temperature[slots]
    return x, x / torch.where(T > 0, T, 1.0)[:, None]


def _chunk(
    logits, x, z, ordered, slots, positions, t, logprobs, prop=None, judging=None, penal=True, ktok=None, sampled=True
):
    """One chunk of exactly W rows: see the module docstring for the order of the steps. x, z: the rows'
    _tempered values; ordered: (values, indices) of z sorted descending, stable (top-k / top-p), or None
    when no row of the chunk truncates (a host fact: no full-vocab sort); penal=False (no row is
    penalized): x is the logits, and greedy is their argmax. prop [W] bool: rows
    that draft for the rejection policy (their pick is restricted to the cut q', returned as the fifth
    value); judging (draft [W], q' [W, V]): rows that judge a draft (baton/engine/rejection.py).
    ktok [W]: the rows' tokens from the CUDA pick (baton/kernels/pick.py): every row but a proposing one
    takes it (a judging row's draft is then judged), and without rejection rows the torch pick is skipped.
    sampled=False (no row samples, proposes or judges): each token is greedy_tok, no noise drawn."""
    V = logits.shape[-1]
    if ktok is not None and prop is None and judging is None:
        return _logprobs(z, ktok, None) if logprobs else (ktok, None, None, None, None)
    greedy_tok = x.argmax(-1) if penal else logits.argmax(-1)
    if not sampled:  # torch.where(T > 0, ..., greedy_tok) below, for rows that are all T = 0
        return _logprobs(z, greedy_tok, None) if logprobs else (greedy_tok, None, None, None, None)
    T = t.temperature[slots]
    log_min_p = t.log_min_p[slots][:, None]
    if ordered is not None:
        vals, idx = ordered
        rank = torch.arange(V, device=z.device).expand_as(vals)
        new = torch.ones_like(vals, dtype=torch.bool)
        new[:, 1:] = vals[:, 1:] != vals[:, :-1]
        first = torch.cummax(torch.where(new, rank, 0), dim=-1).values  # its tie group's first rank: #{z > it}
        k = t.top_k[slots]
        keep = first < torch.where(k > 0, k, V)[:, None]  # top-k: fewer than k tokens above it
        probs = torch.softmax(vals.masked_fill(~keep, -math.inf), dim=-1)
        above = (torch.cumsum(probs, dim=-1) - probs).gather(1, first)  # the mass of the tokens with z > it
        top_p = t.top_p[slots][:, None]
        keep &= (above < top_p) | (top_p >= 1.0)
        keep &= (vals - vals[:, :1]) >= log_min_p  # min-p: p / p_max >= min_p
        mask = torch.zeros_like(keep).scatter(1, idx, keep)
    else:
        mask = (z - z.max(-1, keepdim=True).values) >= log_min_p
    if prop is not None:
        mask = rejection.cut(z, mask, prop)
    seed_hi, seed_lo = t.seed_hi[slots], t.seed_lo[slots]
    score = (z + gumbel(seed_hi, seed_lo, positions, V)).masked_fill(~mask, -math.inf)
    tok = torch.where(T > 0, score.argmax(-1), greedy_tok)
    if ktok is not None:
        tok = torch.where(prop, tok, ktok) if prop is not None else ktok
    q = torch.softmax(z.masked_fill(~mask, -math.inf), dim=-1) if prop is not None or judging is not None else None
    if judging is not None:  # q here is the verifier's own processed distribution p
        tok = rejection.judge(q, judging[0], judging[1], seed_hi, seed_lo, positions, tok)
    q = q if prop is not None else None
    return _logprobs(z, tok, q) if logprobs else (tok, None, None, None, q)


def _logprobs(z, tok, q):
    """(tok, the chosen logprob [W], top logprobs [W, 20], top ids [W, 20], q) of log_softmax(z)."""
    V = z.shape[-1]
    lp = torch.log_softmax(z, dim=-1)
    top_lp, top_ids = torch.topk(lp, min(MAX_LOGPROBS, V), dim=-1)
    if V < MAX_LOGPROBS:
        pad = MAX_LOGPROBS - V
        top_lp = torch.nn.functional.pad(top_lp, (0, pad), value=-math.inf)
        top_ids = torch.nn.functional.pad(top_ids, (0, pad))
    return tok, lp.gather(-1, tok[:, None])[:, 0], top_lp, top_ids, q


def _cuda_pick(src, slots, positions, table, top_k: bool) -> torch.Tensor:
    """Each row's token on CUDA: baton/kernels/pick.py for sampling rows, argmax of src for greedy ones."""
    from baton.kernels import pick as pick_kernel  # triton: CUDA builds of torch ship it

    sampled = pick_kernel.pick(src, slots, positions, table, top_k=top_k)
    return torch.where(table.temperature[slots] > 0, sampled, src.argmax(-1))


def sample(
    logits: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    table,
    *,
    logprobs: bool = False,
    truncate: bool = True,
    top_k: bool = True,
    width: int | None = None,
    prop: torch.Tensor | None = None,
    judging: tuple[torch.Tensor, torch.Tensor] | None = None,
    with_q: bool = False,
    penal: bool = True,
    sampled: bool = True,
    penalties: bool = True,
):
    """logits [M, V], slots [M] long, positions [M] long -> (tokens [M] long, chosen logprob [M],
    top logprobs [M, 20], top ids [M, 20]) (the last three None unless logprobs). Runs in chunks of
    `width` rows (default table.width), the last one padded with the scratch slot. Pure tensor code.
    truncate=False skips top-k / top-p (only valid when no row uses them; graphs pass True); top_k=False
    skips top-k alone (only valid when no row uses it: the CUDA pick's 8 radix launches); penal=False
    skips the penalties (only valid when no row is penalized).
    prop / judging: the rejection policy's rows ([M] bool; ([M] drafts or -1, [M, V] q')); with_q adds a
    fifth value, the proposing rows' q' [M, V] (None without prop). sampled=False skips the noise, the sort and
    the CUDA pick (only valid when every row is greedy, none proposing or judging: the tokens are the argmax of
    the processed logits, as the sampled path gives such rows); penalties=False skips the penalties alone (only
    valid when no row is penalized: a neutral row's logits are bitwise unchanged by them)."""
    W = width or table.width
    M, V = logits.shape
    cuda = logits.is_cuda  # the token comes from baton/kernels/pick.py (sort-free, per-row programs)
    top_k = truncate and top_k
    sampled = sampled or prop is not None or judging is not None
    if cuda and not penal and not logprobs and prop is None and judging is None:  # the common sampled step
        tok = _cuda_pick(logits, slots, positions, table, top_k)
        return (tok, None, None, None, None) if with_q else (tok, None, None, None)
    outs = []
    for c in range(0, M, W):
        n = min(W, M - c)
        lg, sl, ps = logits[c : c + n], slots[c : c + n], positions[c : c + n]
        # the chunk's live rows only: elementwise / integer steps, and the sort, an exact permutation (stable):
        # each row gets the same values as inside any chunk; a lone row sorts one row, not W
        x, z = _tempered(lg, sl, ps, table, penal, penalties)
        if not sampled and not logprobs:  # an argmax a row (exact: no reduction order), no padding needed
            outs.append(((x if penal else lg).argmax(-1), None, None, None, None))
            continue
        # on CUDA the kernel's token (its own z = x / T); the torch pick below only for rejection-policy rows
        ktok = _cuda_pick(x, sl, ps, table, top_k) if cuda and sampled else None
        rej = prop is not None or judging is not None
        sort = sampled and truncate and (rej or not cuda)
        ordered = tuple(torch.sort(z, dim=-1, descending=True, stable=True)) if sort else None
        pr = prop[c : c + n] if prop is not None else None
        jd = (judging[0][c : c + n], judging[1][c : c + n]) if judging is not None else None
        if n < W:  # pad to the one-slot shape: zero logits of the scratch slot (x = z = 0, sorted: in index order)
            lg = torch.cat([lg, lg.new_zeros(W - n, V)])
            x, z = (torch.cat([t, t.new_zeros(W - n, V)]) for t in (x, z))
            if ordered is not None:
                pad_idx = torch.arange(V, device=logits.device).expand(W - n, V)
                ordered = (torch.cat([ordered[0], z.new_zeros(W - n, V)]), torch.cat([ordered[1], pad_idx]))
            sl = torch.cat([sl, sl.new_full((W - n,), table.scratch)])
            ps = torch.cat([ps, ps.new_zeros(W - n)])
            pr = torch.cat([pr, pr.new_zeros(W - n)]) if pr is not None else None
            ktok = torch.cat([ktok, ktok.new_zeros(W - n)]) if ktok is not None else None
            if jd is not None:
                jd = (
                    torch.cat([jd[0], jd[0].new_full((W - n,), -1)]),
                    torch.cat([jd[1], jd[1].new_zeros(W - n, V)]),
                )
        out = _chunk(lg, x, z, ordered, sl, ps, table, logprobs, pr, jd, penal, ktok, sampled)
        outs.append(tuple(o[:n] if o is not None else None for o in out))
    if len(outs) == 1:
        res = outs[0]
    else:
        res = tuple(torch.cat(parts) if parts[0] is not None else None for parts in zip(*outs))
    return res if with_q else res[:4]
