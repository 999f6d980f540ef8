"""Counter-based noise for sampling (issue 22): the randomness of a row is a pure function of (seed,
position, vocab index), so a seeded request draws the same tokens on any worker, in any batch, after
any migration.

    u = uniform(seed_hi, seed_lo, positions, V)     # [M, V] float32 in (0, 1)
    g = gumbel(seed_hi, seed_lo, positions, V)      # [M, V] Gumbel(0, 1) = -log(-log(u))

Integer-only hashing (lowbias32; every multiply split in 16-bit halves, so no int64 op overflows): u is
bit-identical on CPU and CUDA. No op reduces across rows. Used by the sampler (baton/engine/sampling.py)
and the rejection policy (baton/engine/rejection.py, with its own seed salts).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32): split in 16-bit halves, every product < 2^49."""
    return ((x & 0xFFFF) * c + (((x >> 16) * (c & 0xFFFF)) << 16)) & M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed_hi: torch.Tensor, seed_lo: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M] seeds (two 32-bit halves) and positions -> [M, vocab] float32 in (0, 1), bit-identical on
    every device: u = ((bits >> 9) + 0.5) / 2^23 is exact in float32."""
    key = hash32(hash32(hash32(seed_lo ^ 0x5BD1E995) ^ seed_hi) ^ (positions & M32)) ^ _GOLDEN  # [M]
    v = hash32(torch.arange(vocab, device=positions.device, dtype=torch.int64) * 2 + 1)  # [V]
    bits = hash32(key[:, None] ^ v[None, :])  # [M, V]: one mix per element (key and v are mixed already)
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel(seed_hi, seed_lo, positions, vocab: int) -> torch.Tensor:
    """[M, vocab] float32 Gumbel(0, 1) noise of (seed, position, vocab index)."""
    return -torch.log(-torch.log(uniform(seed_hi, seed_lo, positions, vocab)))
