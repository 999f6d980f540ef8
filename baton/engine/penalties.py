"""Repetition, presence and frequency penalties (issue 22): each slot's token history on the device, and
the penalized logits of every decode-time row.

    hist = History(slots, length, device)      # one per SamplingTable (table.history)
    hist.begin(slot, generated_from)           # a session opens: positions >= generated_from are generated
    hist.load(slot, ids, generated_from)       # a handed-over session: its tokens at positions [0, len(ids))
    hist.forget(slot)                          # the slot's history is unknown (a new state was loaded)
    hist.record(slots, positions, ids)         # device: tokens a pass consumes, at their positions
    counts, seen = hist.counts(slots, positions, V)   # the history each row sees when it picks
    x = penalize(x, counts, seen, repetition, presence, frequency)

Semantics (vLLM's / OpenAI's; docs/CONTRACTS.md, "Sampling"). A row that picks the token at position q
sees the slot's tokens at positions [0, q): the prompt [0, g) and the generated tokens [g, q) (g =
generated_from). With c[v] = how many times v was generated and seen[v] = v occurs in the prompt or the
generated tokens, on the raw logits (float32), before the temperature, top-k, top-p and min-p:
    x[v] = x[v] / r if x[v] > 0 else x[v] * r          for seen v (r = repetition_penalty; 1 = off)
    x[v] = x[v] - presence * (c[v] > 0) - frequency * c[v]
`penalized_reference` is the same in float64 on a list of ids. Neutral values (r = 1, presence =
frequency = +0) leave x bitwise as it was, so a neutral row is unchanged inside a penalized chunk.

The history is a KV-cache-like buffer: `ids[slot, p]` is the token at position p for every p below what
the slot has consumed. Every pass writes the tokens it consumes at their positions before it picks
(prefill pieces, rows / verify blocks, batched AR steps, MTP pairs), so row j of a verify block
[t0, d1..dK] sees t0, d1..dj exactly as the AR step at that position would. Entries at or past the
slot's position are junk (a rejected draft, an undone step) and are never read: a row reads only
positions below the one it picks, and those were rewritten by the pass that consumed them. So rewinds,
snapshot restores and undone steps need no bookkeeping here.

Invariants
- A row's counts depend only on its slot's history, generated_from and its own position: no op reduces
  across rows (two scatter-adds of [W, length] into [W, V], integer: deterministic on any device).
- Fixed size: `ids` [S + 1, length] int32 and `generated_from` [S + 1] int64 are allocated once and never
  replaced (CUDA graphs stay valid); `record` and `counts` have no host sync.
- Memory: 4 * length + 8 bytes per slot (length = the runner's max_len + W: ~16 KB at the default window
  of 4096, whatever the vocabulary), plus, per penalized pass, two transient [W, V] int32 tensors (32 MB
  at W = 16, V = 248K; the sampler's own [W, V] float32 work is of the same size).
- The host mirror `known` says which slots have a history: a session with penalties on a slot without
  one is refused (SamplingTable.set: ValueError naming `history`), never silently penalized wrongly.
"""

from __future__ import annotations

import math

import torch

from baton.transfer import upload


class History:
    def __init__(self, slots: int, length: int, device):
        dev, S = torch.device(device), slots + 1  # row S: the scratch slot of padding rows
        self.length = length
        self.ids = torch.zeros(S, length, dtype=torch.int32, device=dev)  # [S + 1, length] token at position
        self.generated_from = torch.zeros(S, dtype=torch.int64, device=dev)  # [S + 1] first generated position
        self.arange = torch.arange(length, device=dev)  # [length]
        self.known = [False] * S  # host: the slot's history was begun or loaded

    def begin(self, slot: int, generated_from: int) -> None:
        """A session opens on slot (its passes will record every token): positions >= generated_from are
        generated tokens (prefill: len(prompt); a migration's re-prefill: the original prompt's length)."""
        self.generated_from[slot].fill_(int(generated_from))  # a kernel, not a blocking copy (SamplingTable.set)
        self.known[slot] = True

    def load(self, slot: int, ids: list[int], generated_from: int) -> None:
        """A session whose state was handed over: its tokens at positions [0, len(ids))."""
        if not 0 <= generated_from <= len(ids):
            raise ValueError(f"history.generated_from: {generated_from} is out of range [0, {len(ids)}]")
        if len(ids) > self.length:
            raise ValueError(f"history.token_ids: {len(ids)} ids; the window holds {self.length}")
        if ids:
            self.ids[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32, device=self.ids.device)
        self.begin(slot, generated_from)

    def put(self, slot: int, ids: list[int], start: int = 0) -> None:
        """The tokens at positions [start, start + len(ids)) of slot, as its passes would have recorded them (a
        prompt's prefix, or one piece, restored from the prefix cache, baton/engine/prefix_cache.py). Device only."""
        if ids:
            self.ids[slot, start : start + len(ids)].copy_(upload(ids, torch.int32, self.ids.device))

    def forget(self, slot: int) -> None:
        self.known[slot] = False

    def read(self, slot: int, n: int) -> list[int]:
        """Host read of positions [0, n) (tests, diagnostics)."""
        return self.ids[slot, :n].tolist()

    def record(self, slots: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> None:
        """[M] slots, [M] positions, [M] ids: ids[i] is the token at positions[i] of slots[i]. Device only;
        positions are clamped into the buffer (only padding rows can be past it; they are never read)."""
        self.ids.index_put_((slots, positions.clamp(0, self.length - 1)), ids.to(torch.int32))

    def counts(self, slots: torch.Tensor, positions: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[M] slots, [M] picked positions q -> (counts [M, V] int32 of the generated tokens at [g, q),
        seen [M, V] bool: in the tokens at [0, q))."""
        h = self.ids[slots].long()  # [M, length]
        before = self.arange[None, :] < positions[:, None]  # [M, length]
        gen = before & (self.arange[None, :] >= self.generated_from[slots][:, None])
        M = h.shape[0]
        counts = torch.zeros(M, vocab, dtype=torch.int32, device=h.device).scatter_add_(1, h, gen.to(torch.int32))
        seen = torch.zeros(M, vocab, dtype=torch.int32, device=h.device).scatter_add_(1, h, before.to(torch.int32))
        return counts, seen > 0


def penalize(x, counts, seen, repetition, presence, frequency):
    """x [M, V] float32 raw logits, counts [M, V] int (generated occurrences), seen [M, V] bool (prompt or
    generated), the rest [M] -> the penalized logits (see the module docstring)."""
    rep = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - presence[:, None] * (counts > 0).to(x.dtype) - frequency[:, None] * counts.to(x.dtype)


def penalized_reference(logits, ids: list[int], generated_from: int, p) -> torch.Tensor:
    """float64 reference: [V] logits, the tokens at positions [0, q) before the pick, the first generated
    position and a Params -> [V] penalized logits (float64), with the Params' logit_bias added and its
    min_tokens ban (-inf) at a position below its ban_end."""
    x = logits.double().clone()
    r = p.repetition_penalty if p.repetition_penalty > 0 else 1.0
    for v in set(ids):
        x[v] = x[v] / r if x[v] > 0 else x[v] * r
    gen = ids[generated_from:]
    for v in set(gen):
        x[v] -= p.presence_penalty + p.frequency_penalty * gen.count(v)
    for v, b in getattr(p, "logit_bias", ()):  # then the bias (baton/engine/sampling.py: the canonical order)
        x[v] += b
    if len(ids) < getattr(p, "ban_end", 0):  # then min_tokens' ban: the pick is at position len(ids)
        for v in p.banned:
            x[v] = -math.inf
    return x
