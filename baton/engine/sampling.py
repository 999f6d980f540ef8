"""Sampling on the device: per-slot parameters and the token pick of every decode-time row (issue 22).

    table = SamplingTable(slots, device, width, max_len)   # one per ModelRunner (runner.sampling)
    table.set(slot, Params(temperature=0.8, top_p=0.9, seed=7, logprobs=5))   # when a session opens
    table.clear(slot)                               # when it is released (greedy again)
    tok = table.pick(logits, slots, rows, positions, live)   # [M] long; the eager entry point
    toks, lp, top_lp, top_ids = sample(logits, slots, positions, table, logprobs=True)   # pure tensors
    table.logprobs(slot, n)                         # host: [(chosen logprob, [(id, logprob) x N])] x n

Shapes: logits [M, V] (any float dtype), slots [M] long (index into the table; the scratch slot S for
padding rows), rows [M] long (the row's index inside its slot's block), positions [M] long: the
sequence position of the token being picked (a row that consumes the token at position p picks the
token at p + 1; prefill's first token is at len(prompt)). Per-slot parameters are [S + 1] device
tensors (row S: the scratch slot, always greedy).

What one row's token is (canonical order; baton/engine/sampling_reference.py is the same in float64):
    x = penalize(logits)      repetition / presence / frequency over the slot's token history
                              (baton/engine/penalties.py; neutral = x unchanged, bitwise)
    z = x / T                                        (T = 0: greedy, exactly x.argmax(-1))
    keep K = the tokens that pass three cuts, each a set of the largest z (whole tie groups, no order
    among equal values): top-k keeps i iff fewer than k tokens have z > z_i (0 = off); top-p iff the
    top-k-renormalised mass of the tokens with z > z_i is below top_p (0 or 1 = off); min-p iff
    z_i - max(z) >= log(min_p) (0 = off); token = argmax over K of z + g (ties: the lowest index)
    g = Gumbel noise = -log(-log(u)), u = uniform from a hash of (seed, position, vocab index)
On CUDA the token comes from baton/kernels/pick.py, which finds it without sorting the vocabulary (one
program per row; ~2 passes over the row); on the CPU from the sorted z below (`_chunk`). The two never mix
(workers do not mix devices); each is batch-invariant.
Gumbel-max makes the token a draw from softmax(z) restricted to the kept set, renormalised.
Exact mode's REJECTION policy (baton/engine/rejection.py) rides on `pick`: a proposing slot (the drafter,
`set(proposing=True)`) draws from its cut q' and records it by position (`proposals`); a judging slot
(the verifier, `judge`) has the rows at its drafts' positions accept or resample them.
Penalties (vLLM / OpenAI semantics): presence and frequency count the generated tokens, repetition the
prompt's and the generated ones; logprobs and rejection's q are of the penalized, tempered logits. The
token history is `table.history` (penalties.History, [S + 1, max_len + W] int32; each pass records).

Invariants
- The randomness is a pure function of (seed, position, vocab index): same seed -> same tokens on
  any worker, in any batch, after a migration (fast-mode re-prefill and exact-mode export keep
  positions). The hash is integer-only (a 32-bit mix, every multiply split in 16-bit halves so no
  int64 op can overflow), so u is bit-identical on CPU and CUDA; the float steps after it (log, the
  logits) match within one device type, which is all exactness needs (workers never mix devices).
- Greedy rows (T = 0) are exactly `logits.argmax(-1)` (today's token); with a penalty, `x.argmax(-1)`.
- Batch invariance: a row's token, logprob and top-N depend only on its own logits row, its slot's
  parameters, its position and its slot's history. No op reduces across rows; every float reduction
  runs on chunks of exactly `width` rows (padded), so kernels see the one-slot shape [W, V] whatever M
  (tests/engine/test_sampling.py, test_penalties.py: alone vs inside batches, torch.equal). Only
  elementwise and integer steps (the penalties, the temperature) and the top-k / top-p sort, an exact
  permutation (stable: ties by index), run on a chunk's live rows before its padding: the sort of one
  live row is one row's, not W's.
- CUDA-graph capturable: `sample` has no host sync and static shapes (on CUDA no sort at all, but for
  the rejection policy's eager rows; on the CPU one full-vocab stable sort of each chunk's live rows). `pick` adds host-side shortcuts (every live slot greedy, unpenalized, no logprobs -> argmax;
  no slot penalized -> no history counts); it always takes the full path while a CUDA graph is being
  captured, since the graph outlives the table's contents.
- Logprobs: log_softmax(z) (after the penalties and the temperature, before top-k / top-p / min-p: not
  truncated), float32; chosen = the picked token's, top = the MAX_LOGPROBS largest (N <= 20 asked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from baton.engine import rejection
from baton.engine.noise import M32, gumbel
from baton.engine.penalties import History, penalize

MAX_LOGPROBS = 20
COUPLING, REJECTION = 1, 2  # baton.v1.ExactPolicy


@dataclass(frozen=True)
class Params:
    """One session's sampling parameters (host side). Neutral values are off."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 0 or 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int = 0  # uint64
    repetition_penalty: float = 1.0  # 0 or 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int = 0  # top-N alternatives (<= MAX_LOGPROBS); > 0 also returns the chosen logprob
    exact_policy: int = 0  # baton.v1.ExactPolicy: 0 / COUPLING = 1, REJECTION = 2 (baton/engine/rejection.py)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:  # any penalty on: the slot's token history is read (penalties.History)
        return self.repetition_penalty not in (0.0, 1.0) or bool(self.presence_penalty or self.frequency_penalty)

    @property
    def rejection(self) -> bool:
        """Exact mode judges this session's drafts by rejection sampling (T > 0 only)."""
        return not self.greedy and self.exact_policy == REJECTION

    @classmethod
    def from_proto(cls, m) -> "Params":
        """baton.v1.SamplingParams (validated by the router) -> Params; None / unset = greedy."""
        if m is None:
            return GREEDY
        return cls(
            temperature=float(m.temperature),
            top_p=float(m.top_p),
            top_k=int(m.top_k),
            min_p=float(m.min_p),
            seed=int(m.seed),
            repetition_penalty=float(m.repetition_penalty),
            presence_penalty=float(m.presence_penalty),
            frequency_penalty=float(m.frequency_penalty),
            logprobs=int(m.logprobs),
            exact_policy=int(m.exact_policy),
        )


GREEDY = Params()


# ---- the table -----------------------------------------------------------------------------------
class SamplingTable:
    """Per-slot sampling parameters on the device, [S + 1] each (row S: the scratch slot of padding
    rows, always greedy), plus each slot's logprob outputs of its last pass, [S + 1, W(, 20)], and its
    token history (`history`, [S + 1, max_len + W], for the penalties). Set when a session is loaded
    (`set`), cleared when it is released (`clear`); a host mirror `params` serves the eager shortcut
    and `logprobs`."""

    def __init__(self, slots: int, device, width: int, max_len: int = 4096):
        dev, S = torch.device(device), slots + 1
        self.slots, self.width, self.device = slots, width, dev
        f = lambda v: torch.full((S,), v, dtype=torch.float32, device=dev)  # noqa: E731
        i = lambda v: torch.full((S,), v, dtype=torch.int64, device=dev)  # noqa: E731
        self.temperature, self.top_p, self.top_k, self.log_min_p = f(0.0), f(1.0), i(0), f(-math.inf)
        self.seed_hi, self.seed_lo, self.n_logprobs = i(0), i(0), i(0)
        self.repetition, self.presence, self.frequency = f(1.0), f(0.0), f(0.0)
        self.lp_out = torch.zeros(S, width, dtype=torch.float32, device=dev)  # chosen token's logprob
        self.top_lp = torch.zeros(S, width, MAX_LOGPROBS, dtype=torch.float32, device=dev)
        self.top_ids = torch.zeros(S, width, MAX_LOGPROBS, dtype=torch.int64, device=dev)
        self.slot_rows = torch.arange(S, device=dev)[:, None].expand(S, width).contiguous()  # [S+1, W]
        self.row_ids = torch.arange(width, device=dev)  # [W]
        self.params: list[Params] = [GREEDY] * S
        self.history = History(slots, max_len + width, dev)  # each slot's tokens by position (penalties)
        # rejection policy (baton/engine/rejection.py): drafting slots record each pick's proposal q'
        # by position; a verifying slot's rows judge the drafts set for their positions
        self.proposed: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.judging: dict[int, dict[int, tuple[int, torch.Tensor, torch.Tensor]]] = {}

    @property
    def scratch(self) -> int:
        return self.slots

    def set(self, slot: int, p: Params | None, *, proposing: bool = False) -> None:
        """Writes slot's parameters (host -> device scalars; not inside a captured region). proposing: the
        slot drafts for a rejection-policy Verify: its picks draw from the cut q' and record it."""
        p = p or GREEDY
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range [0, {self.slots})")
        if not 0 <= p.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: {p.logprobs} is over {MAX_LOGPROBS}")
        if p.penalized and not self.history.known[slot]:
            raise ValueError("history: a session with penalties needs its token history (none was given for it)")
        self.proposed.pop(slot, None)  # a refused set (above) leaves the slot as it was
        self.judging.pop(slot, None)
        if proposing and p.rejection:
            self.proposed[slot] = {}
        top_p = p.top_p if 0.0 < p.top_p < 1.0 else 1.0
        # + 0.0: a -0.0 penalty is +0.0, so a neutral row's logits stay bitwise (x - (-0.0) turns -0.0 to +0.0)
        for t, v in (
            (self.temperature, max(0.0, p.temperature)),
            (self.top_p, top_p),
            (self.top_k, max(0, p.top_k)),
            (self.log_min_p, math.log(p.min_p) if 0.0 < p.min_p <= 1.0 else -math.inf),
            (self.seed_hi, (p.seed >> 32) & M32),
            (self.seed_lo, p.seed & M32),
            (self.repetition, p.repetition_penalty if p.repetition_penalty > 0 else 1.0),
            (self.presence, p.presence_penalty + 0.0),
            (self.frequency, p.frequency_penalty + 0.0),
            (self.n_logprobs, p.logprobs),
        ):
            # fill_: a kernel on the current stream (every reader's: the workers' passes and graph replays run
            # on it), not `t[slot] = v`, a blocking H2D copy that waited for every pass already queued (a
            # prefill worker's gRPC threads made ~20 of them per session while the passes ran)
            t[slot].fill_(v)
        self.params[slot] = p

    def clear(self, slot: int) -> None:
        self.set(slot, GREEDY)
        self.history.forget(slot)

    def plain(self, slot: int) -> bool:
        """Greedy, no penalties, no logprobs: the token is exactly argmax (what the captured graphs compute)."""
        p = self.params[slot]
        return p.greedy and p.logprobs <= 0 and not p.penalized

    def lite(self, slot: int) -> bool:
        """No penalties and no logprobs: a sampled step of such slots replays the lite sampled graph (the
        pick alone: the sort-free kernel on CUDA), not the full one (penalty counts, logprobs)."""
        p = self.params[slot]
        return p.logprobs <= 0 and not p.penalized

    def in_graph(self, slot: int) -> bool:
        """The slot's pick is pure device code (a captured sampled graph computes it): it neither drafts
        nor judges for the rejection policy, whose picks keep host-side records."""
        return slot not in self.proposed and slot not in self.judging

    def proposals(self, slot: int, first: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The q' (ids, probs) of the picks at positions first .. first + k - 1 of a proposing slot; the
        records of positions before `first` (earlier rounds: positions only advance) are dropped."""
        rec = self.proposed.get(slot, {})
        for old in [q for q in rec if q < first]:  # rounds before this one: never asked for again
            del rec[old]
        if any(first + i not in rec for i in range(k)):
            raise RuntimeError(f"slot {slot}: no proposal recorded for positions {first}..{first + k - 1}")
        return [rec[first + i] for i in range(k)]

    def judge(self, slot: int, first: int, drafts: list[int], dists) -> None:
        """The next pass's rows of slot picking positions first + i judge drafts[i] against q' dists[i]."""
        self.judging[slot] = {first + i: (d, *q) for i, (d, q) in enumerate(zip(drafts, dists))}

    def end_judge(self, slot: int) -> None:
        self.judging.pop(slot, None)

    def wants_logprobs(self, slot: int) -> bool:
        return self.params[slot].logprobs > 0

    def pick(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        live: Sequence[int],
        *,
        full: bool = False,
        lite: bool = False,
    ) -> torch.Tensor:
        """The eager entry point: logits [M, V] -> tokens [M] long; stores each row's logprobs at
        (slots[i], rows[i]) when any live slot asked. live = the slots these rows belong to (host).
        full: the path a captured graph takes, whatever the table holds (a sampled graph's warm-up runs
        its kernels eagerly first); it keeps no rejection-policy records. lite (with full): the path of the lite
        sampled graph, for tables whose live slots all are `lite`: no penalties, no logprobs."""
        capturing = full or (logits.is_cuda and torch.cuda.is_current_stream_capturing())
        ps = [self.params[s] for s in live]
        want_lp = (capturing and not lite) or any(p.logprobs > 0 for p in ps)
        penal = (capturing and not lite) or any(p.penalized for p in ps)
        if not capturing and not want_lp and not penal and all(p.greedy for p in ps):
            return logits.argmax(-1)
        truncate = capturing or any(p.top_k > 0 or 0.0 < p.top_p < 1.0 for p in ps)
        prop, judging = (None, None) if capturing else rejection.rows(self, logits, slots, positions, live)
        tok, lp, top_lp, top_ids, q = sample(
            logits, slots, positions, self, logprobs=want_lp, truncate=truncate, width=self.width,
            prop=prop, judging=judging, with_q=True, penal=penal,
        )  # fmt: skip
        if q is not None:  # record each proposing row's q' by the position it picks
            for i in prop.nonzero()[:, 0].tolist():
                self.proposed[int(slots[i])][int(positions[i])] = rejection.sparse(q[i])
        if want_lp:
            self.lp_out.index_put_((slots, rows), lp)
            self.top_lp.index_put_((slots, rows), top_lp)
            self.top_ids.index_put_((slots, rows), top_ids)
        return tok

    def pick_slot(self, logits: torch.Tensor, slot: int, first_position) -> torch.Tensor:
        """pick for rows 0..M-1 of one slot, row i at first_position + i (an int or a device scalar)."""
        M = logits.shape[0]
        pos = first_position + self.row_ids[:M]
        return self.pick(logits, self.slot_rows[slot, :M], self.row_ids[:M], pos, (slot,))

    def logprobs(self, slot: int, n: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """Host read of the slot's last pass, rows 0..n-1: (chosen logprob, top-N [(id, logprob)])."""
        k = self.params[slot].logprobs
        if k <= 0:
            return []
        lp = self.lp_out[slot, :n].tolist()
        ids, vals = self.top_ids[slot, :n, :k].tolist(), self.top_lp[slot, :n, :k].tolist()
        return [(lp[i], list(zip(ids[i], vals[i]))) for i in range(n)]


# ---- the pure tensor code ------------------------------------------------------------------------
def _tempered(logits, slots, positions, t: SamplingTable, penal: bool):
    """Rows' penalized logits x (float32) and tempered z = x / T (T = 0 rows: x), [M, V] each. Integer
    counts and elementwise ops only: a row's values are bitwise the same for any row count."""
    x = logits.float()
    if penal:  # neutral rows: x bitwise unchanged (penalties.py)
        V = logits.shape[-1]
        x = penalize(
            x, *t.history.counts(slots, positions, V), t.repetition[slots], t.presence[slots], t.frequency[slots]
        )
    T = t.temperature[slots]
    return x, x / torch.where(T > 0, T, 1.0)[:, None]


def _chunk(
    logits, x, z, ordered, slots, positions, t: SamplingTable, logprobs, prop=None, judging=None, penal=True, ktok=None
):
    """One chunk of exactly W rows: see the module docstring for the order of the steps. x, z: the rows'
    _tempered values; ordered: (values, indices) of z sorted descending, stable (top-k / top-p), or None
    when no row of the chunk truncates (a host fact: no full-vocab sort); penal=False (no row is
    penalized): x is the logits, and greedy is their argmax. prop [W] bool: rows
    that draft for the rejection policy (their pick is restricted to the cut q', returned as the fifth
    value); judging (draft [W], q' [W, V]): rows that judge a draft (baton/engine/rejection.py).
    ktok [W]: the rows' tokens from the CUDA pick (baton/kernels/pick.py): every row but a proposing one
    takes it (a judging row's draft is then judged), and without rejection rows the torch pick is skipped."""
    V = logits.shape[-1]
    if ktok is not None and prop is None and judging is None:
        return _logprobs(z, ktok, None) if logprobs else (ktok, None, None, None, None)
    greedy_tok = x.argmax(-1) if penal else logits.argmax(-1)
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


def sample(
    logits: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTable,
    *,
    logprobs: bool = False,
    truncate: bool = True,
    width: int | None = None,
    prop: torch.Tensor | None = None,
    judging: tuple[torch.Tensor, torch.Tensor] | None = None,
    with_q: bool = False,
    penal: bool = True,
):
    """logits [M, V], slots [M] long, positions [M] long -> (tokens [M] long, chosen logprob [M],
    top logprobs [M, 20], top ids [M, 20]) (the last three None unless logprobs). Runs in chunks of
    `width` rows (default table.width), the last one padded with the scratch slot. Pure tensor code.
    truncate=False skips top-k / top-p (only valid when no row uses them; graphs pass True); penal=False
    skips the penalties (only valid when no row is penalized).
    prop / judging: the rejection policy's rows ([M] bool; ([M] drafts or -1, [M, V] q')); with_q adds a
    fifth value, the proposing rows' q' [M, V] (None without prop)."""
    W = width or table.width
    M, V = logits.shape
    cuda = logits.is_cuda  # the token comes from baton/kernels/pick.py (sort-free, per-row programs)
    if cuda:
        from baton.kernels import pick as pick_kernel  # triton: CUDA builds of torch ship it
    if cuda and not penal and not logprobs and prop is None and judging is None:  # the common sampled step
        tok = torch.where(table.temperature[slots] > 0, pick_kernel.pick(logits, slots, positions, table),
                          logits.argmax(-1))  # fmt: skip
        return (tok, None, None, None, None) if with_q else (tok, None, None, None)
    outs = []
    for c in range(0, M, W):
        n = min(W, M - c)
        lg, sl, ps = logits[c : c + n], slots[c : c + n], positions[c : c + n]
        # the chunk's live rows only: elementwise / integer steps, and the sort, an exact permutation (stable):
        # each row gets the same values as inside any chunk; a lone row sorts one row, not W
        x, z = _tempered(lg, sl, ps, table, penal)
        ktok = None
        if cuda:  # the kernel's token (its own z = x / T); the torch pick below only for rejection-policy rows
            ktok = torch.where(table.temperature[sl] > 0, pick_kernel.pick(x, sl, ps, table), x.argmax(-1))
        rej = prop is not None or judging is not None
        ordered = tuple(torch.sort(z, dim=-1, descending=True, stable=True)) if truncate and (rej or not cuda) else None
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
        out = _chunk(lg, x, z, ordered, sl, ps, table, logprobs, pr, jd, penal, ktok)
        outs.append(tuple(o[:n] if o is not None else None for o in out))
    if len(outs) == 1:
        res = outs[0]
    else:
        res = tuple(torch.cat(parts) if parts[0] is not None else None for parts in zip(*outs))
    return res if with_q else res[:4]
