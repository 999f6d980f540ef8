"""The sampler's float64 reference (tests compare baton/engine/sampling.py's draws to it).

    reference_probs(logits [V], params, history, generated_from) -> [V] float64 probabilities

Penalties over the token history, then temperature, top-k, top-p (the smallest prefix by descending z,
ties by index, whose mass reaches top_p), min-p, renormalised: the distribution a row is drawn from.
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
    order = torch.sort(z, descending=True, stable=True).indices
    keep = torch.zeros(V, dtype=torch.bool)
    k = p.top_k if p.top_k > 0 else V
    keep[order[:k]] = True
    pr = torch.softmax(z.masked_fill(~keep, -math.inf), -1)
    if 0.0 < p.top_p < 1.0:
        cum, kept = 0.0, torch.zeros(V, dtype=torch.bool)
        for i in order[:k].tolist():
            kept[i] = True
            cum += float(pr[i])
            if cum >= p.top_p:
                break
        keep &= kept
    if p.min_p > 0.0:
        keep &= z - z.max() >= math.log(p.min_p)
    return torch.softmax(z.masked_fill(~keep, -math.inf), -1)
