"""Sampling on the device: per-slot parameters and the token pick of every decode-time row (issue 22).

    table = SamplingTable(slots, device, width, max_len, vocab_size)   # one per ModelRunner (runner.sampling)
    table.set(slot, Params(temperature=0.8, top_p=0.9, seed=7, logprobs=5))   # when a session opens
    table.allow(slot, position, bits)               # a constrained slot's masks from that position (structured outputs)
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
    x = x + bias              logit_bias: the slot's ids get their values added (one scatter-add per row
                              of distinct ids, padded with id 0 and -0.0, the additive identity: an
                              unbiased row stays bitwise)
    x = x + ban               min_tokens: at a position below the slot's ban_end, its banned ids (EOS and
                              stop ids) get -inf (the same scatter-add, -0.0 elsewhere): never picked, by
                              greedy or sampled rows, and a logprob of -inf
    z = x / T                                        (T = 0: greedy, exactly x.argmax(-1))
    keep K = the tokens that pass three cuts, each a set of the largest z (whole tie groups, no order
    among equal values): top-k keeps i iff fewer than k tokens have z > z_i (0 = off); top-p iff the
    top-k-renormalised mass of the tokens with z > z_i is below top_p (0 or 1 = off); min-p iff
    z_i - max(z) >= log(min_p) (0 = off); token = argmax over K of z + g (ties: the lowest index)
    g = Gumbel noise = -log(-log(u)), u = uniform from a hash of (seed, position, vocab index)
On CUDA the token comes from baton/kernels/pick.py, which finds it without sorting the vocabulary (each
row cut into fixed chunks, one program each; ~2 passes over the row); on the CPU from the sorted z
(baton/engine/sample_rows.py, `_chunk`). The two never mix (workers do not mix devices); each is
batch-invariant.
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
from baton.engine.noise import M32
from baton.engine.penalties import History
from baton.engine.sample_rows import MAX_LOGPROBS, sample
from baton.sampling_rules import MAX_BAN_TOKENS, MAX_BIAS_TOKENS

COUPLING, REJECTION = 1, 2  # baton.v1.ExactPolicy
MAX_BIAS = MAX_BIAS_TOKENS  # logit_bias ids a slot holds: the rules' limit
MAX_BAN = MAX_BAN_TOKENS  # min_tokens' banned ids a slot holds


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
    logit_bias: tuple = ()  # ((token id, value), ...) by id, distinct: added after the penalties
    ban_end: int = 0  # min_tokens: the ids in `banned` cannot be picked at positions below ban_end
    banned: tuple = ()  # (token id, ...) distinct, sorted: the stop token ids and EOS (sampling_rules.ban_until)
    structured: bytes = b""  # a StructuredOutput, serialized: its tokens masked per step (baton/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:  # any penalty on: the slot's token history is read (penalties.History)
        return self.repetition_penalty not in (0.0, 1.0) or bool(self.presence_penalty or self.frequency_penalty)

    @property
    def banning(self) -> bool:  # min_tokens holds some ids back at some positions
        return self.ban_end > 0 and bool(self.banned)

    @property
    def constrained(self) -> bool:  # structured outputs: the slot's mask (SamplingTable.allow) holds each pick
        return bool(self.structured)

    @property
    def processed(self) -> bool:  # the logits are changed before the pick (penalties, a bias, a ban, a grammar)
        return self.penalized or bool(self.logit_bias) or self.banning or self.constrained

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
            logit_bias=tuple(sorted((int(t), float(v)) for t, v in m.logit_bias.items())),
            ban_end=int(m.min_tokens_end),  # (`banning` needs both this and `banned`)
            banned=tuple(sorted(set(int(t) for t in m.min_tokens_ids))),
            structured=m.structured.SerializeToString(deterministic=True) if m.HasField("structured") else b"",
        )


GREEDY = Params()


# ---- the table -----------------------------------------------------------------------------------
class SamplingTable:
    """Per-slot sampling parameters on the device, [S + 1] each (row S: the scratch slot of padding
    rows, always greedy), plus each slot's logprob outputs of its last pass, [S + 1, W(, 20)], and its
    token history (`history`, [S + 1, max_len + W], for the penalties). Set when a session is loaded
    (`set`), cleared when it is released (`clear`); a host mirror `params` serves the eager shortcut
    and `logprobs`."""

    def __init__(self, slots: int, device, width: int, max_len: int = 4096, vocab_size: int = 0):
        dev, S = torch.device(device), slots + 1
        self.slots, self.width, self.device = slots, width, dev
        f = lambda v: torch.full((S,), v, dtype=torch.float32, device=dev)  # noqa: E731
        i = lambda v: torch.full((S,), v, dtype=torch.int64, device=dev)  # noqa: E731
        self.temperature, self.top_p, self.top_k, self.log_min_p = f(0.0), f(1.0), i(0), f(-math.inf)
        self.seed_hi, self.seed_lo, self.n_logprobs = i(0), i(0), i(0)
        self.repetition, self.presence, self.frequency = f(1.0), f(0.0), f(0.0)
        # logit_bias: [S + 1, MAX_BIAS] distinct ids and their values; padding: id 0 with -0.0 (x + -0.0 == x)
        self.bias_ids = torch.zeros(S, MAX_BIAS, dtype=torch.int64, device=dev)
        self.bias_vals = torch.full((S, MAX_BIAS), -0.0, dtype=torch.float32, device=dev)
        # min_tokens: [S + 1, MAX_BAN] ids with -inf (padding: id 0 with -0.0), added at positions < ban_end [S + 1]
        self.ban_ids = torch.zeros(S, MAX_BAN, dtype=torch.int64, device=dev)
        self.ban_vals = torch.full((S, MAX_BAN), -0.0, dtype=torch.float32, device=dev)
        self.ban_end = i(0)
        # structured outputs: [S + 1, W, words(V)] int32, the mask of the pick at position q in row q % W (a
        # verify block's rows pick W consecutive positions at most), bit t % 32 of word t // 32 = token t
        # allowed, read where `masked` [S + 1] (a constrained slot: its masks are written before its picks, `allow`)
        self.vocab_size = vocab_size
        self.mask_bits = torch.full((S, width, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=dev)
        self.masked = torch.zeros(S, dtype=torch.bool, device=dev)
        self.bit_shifts = torch.arange(32, dtype=torch.int32, device=dev)
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
        if p.constrained and self.mask_bits.shape[2] == 0:
            raise ValueError("sampling.structured: this table has no token masks (vocab_size 0)")
        if len(p.banned) > MAX_BAN:
            raise ValueError(f"min_tokens: {len(p.banned)} token ids to ban, at most {MAX_BAN}")
        if p.penalized and not self.history.known[slot]:
            raise ValueError("history: a session with penalties needs its token history (none was given for it)")
        self.proposed.pop(slot, None)  # a refused set (above) leaves the slot as it was
        self.judging.pop(slot, None)
        if proposing and p.rejection:
            self.proposed[slot] = {}
        if p == self.params[slot]:  # the device already holds them (exact mode's Draft sets them every round)
            return
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
            (self.ban_end, p.ban_end if p.banning else 0),
            (self.masked, p.constrained),
        ):
            # fill_: a kernel on the current stream (every reader's: the workers' passes and graph replays run
            # on it), not `t[slot] = v`, a blocking H2D copy that waited for every pass already queued (a
            # prefill worker's gRPC threads made ~20 of them per session while the passes ran)
            t[slot].fill_(v)
        if p.logit_bias or self.params[slot].logit_bias:
            if len(p.logit_bias) > MAX_BIAS:
                raise ValueError(f"logit_bias: {len(p.logit_bias)} token ids, at most {MAX_BIAS}")
            ids = [t for t, _ in p.logit_bias] + [0] * (MAX_BIAS - len(p.logit_bias))
            vals = [v + 0.0 for _, v in p.logit_bias] + [-0.0] * (MAX_BIAS - len(p.logit_bias))
            self.bias_ids[slot].copy_(torch.tensor(ids, dtype=torch.int64))  # once a biased session opens
            self.bias_vals[slot].copy_(torch.tensor(vals, dtype=torch.float32))
        if p.banned != self.params[slot].banned:
            pad = MAX_BAN - len(p.banned)
            self.ban_ids[slot].copy_(torch.tensor(list(p.banned) + [0] * pad, dtype=torch.int64))
            self.ban_vals[slot].copy_(torch.tensor([-math.inf] * len(p.banned) + [-0.0] * pad))
        self.params[slot] = p

    def allow(self, slot: int, position: int, bits: torch.Tensor) -> None:
        """A constrained slot's picks at positions position .. position + n - 1 may take only the tokens set in
        bits ([n, words] int32, n <= W, CPU; pinned for an asynchronous copy): written on the current stream,
        so passes launched after this call read them. The caller keeps `bits` unchanged until a later pass
        has read them (it reuses them after collecting one)."""
        n, W = bits.shape[0], self.width
        rows = [(position + j) % W for j in range(n)]
        if rows == list(range(rows[0], rows[0] + n)):  # one copy (no wrap past row W - 1)
            self.mask_bits[slot, rows[0] : rows[0] + n].copy_(bits, non_blocking=bits.is_pinned())
        else:
            k = W - rows[0]
            self.mask_bits[slot, rows[0] :].copy_(bits[:k], non_blocking=bits.is_pinned())
            self.mask_bits[slot, : n - k].copy_(bits[k:], non_blocking=bits.is_pinned())

    def unmasked(self, slot: int, on: bool) -> None:
        """A constrained slot's picks without its masks (on) or with them again (off), its parameters kept:
        a fast mtp round's unconstrained drafts, with BATON_MTP_MASKED_DRAFTS=0 (decode_worker/mtp.py _round,
        the A/B of masked drafts). Stream-ordered (the flag is read by the passes launched after this call)."""
        self.masked[slot].fill_(self.params[slot].constrained and not on)

    def clear(self, slot: int) -> None:
        self.set(slot, GREEDY)
        self.history.forget(slot)

    def plain(self, slot: int) -> bool:
        """Greedy, no penalties or bias, no logprobs: the token is exactly argmax (what the captured graphs compute)."""
        p = self.params[slot]
        return p.greedy and p.logprobs <= 0 and not p.processed

    def lite(self, slot: int) -> bool:
        """No penalties or bias and no logprobs: a sampled step of such slots replays the lite sampled graph
        (the pick alone: the sort-free kernel on CUDA), not the full one (penalty counts, bias, logprobs)."""
        p = self.params[slot]
        return p.logprobs <= 0 and not p.processed

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
        penal = (capturing and not lite) or any(p.processed for p in ps)
        if not capturing and not want_lp and not penal and all(p.greedy for p in ps):
            return logits.argmax(-1)
        truncate = capturing or any(p.top_k > 0 or 0.0 < p.top_p < 1.0 for p in ps)
        top_k = capturing or any(p.top_k > 0 for p in ps)
        prop, judging = (None, None) if capturing else rejection.rows(self, logits, slots, positions, live)
        sampled = capturing or not all(p.greedy for p in ps)  # (greedy rows: no noise, no sort)
        penalties = (capturing and not lite) or any(p.penalized for p in ps)
        tok, lp, top_lp, top_ids, q = sample(
            logits, slots, positions, self, logprobs=want_lp, truncate=truncate, top_k=top_k, width=self.width,
            prop=prop, judging=judging, with_q=True, penal=penal, sampled=sampled, penalties=penalties,
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
