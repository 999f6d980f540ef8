"""The sampler's float64 reference (tests compare baton/engine/sampling.py's draws to it).

    reference_probs(logits [V], params, history, generated_from) -> [V] float64 probabilities

Penalties over the token history, then temperature, top-k, top-p, min-p, renormalised: the distribution a
row is drawn from. Each cut is a set of the largest z, whole tie groups: top-k keeps a token iff fewer than
k tokens have a larger z, top-p iff the (top-k renormalised) mass of the tokens with a larger z is below
top_p, min-p iff z - max(z) >= log(min_p).
"""

from __future__ import annotations

import math

import torch

from baton.engine.penalties import penalized_reference
from baton.engine.sampling import Params


def reference_probs(logits, p: Params, history=(), generated_from: int = 0) -> torch.Tensor:
    """float64 reference of the distribution a row is drawn from: [V] logits -> [V] probabilities
    (penalties over `history`, the tokens at positions [0, q) of which [generated_from, q) were
    generated; then temperature, top-k, top-p, min-p, renormalised). Tests compare the sampler to it."""
    z = penalized_reference(logits, list(history), generated_from, p) / p.temperature
    V = z.shape[0]
    zs, order = torch.sort(z, descending=True, stable=True)
    new = torch.ones(V, dtype=torch.bool)
    new[1:] = zs[1:] != zs[:-1]
    first = torch.cummax(torch.where(new, torch.arange(V), 0), 0).values  # each sorted entry's tie group start

    def above(w):  # [V]: w summed over the tokens with a larger z
        ws = w[order]
        out = torch.empty(V, dtype=torch.float64)
        out[order] = (torch.cumsum(ws, 0) - ws)[first]
        return out

    keep = torch.ones(V, dtype=torch.bool)
    if 0 < p.top_k < V:
        keep = above(torch.ones(V, dtype=torch.float64)) < p.top_k
    if 0.0 < p.top_p < 1.0:
        pr = torch.softmax(z.masked_fill(~keep, -math.inf), -1)
        keep &= above(pr) < p.top_p
    if p.min_p > 0.0:
        keep &= z - z.max() >= math.log(p.min_p)
    return torch.softmax(z.masked_fill(~keep, -math.inf), -1)
