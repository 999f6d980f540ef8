"""Adaptive draft length for exact mode (issue 21, point 4): K per session, from that session's recent
acceptance and the measured cost of its rounds. Pure (no gRPC, no clock): the caller times the calls.

    ctl = DraftLength(prior_k=4, k_max=8)       one per session; prior_k: the request's (or server's) K
    k = ctl.next_k()                            before each round (the caller may cut it to the budget)
    ctl.observe(k, m, draft_s, verify_s)        after it: k drafted, m accepted, the two calls' seconds

The model. Each draft is accepted with probability a, independently (geometric), so a block of K drafts
yields m + 1 tokens with
    E(K, a)  = sum_{i=0..K} a^i = (1 - a^(K+1)) / (1 - a)       tokens per round (correction or bonus included)
    cost(K)  = draft(K) + verify(K+1)                            seconds per round
    rate(K)  = E(K, a) / cost(K)                                 the session's expected tokens/s
and the controller runs argmax rate(K) over [k_min, k_max]. draft(K) and verify(K+1) are the router's
wall-clock times of the Draft and Verify calls: each includes its gRPC round trip (the responses carry no
worker-side timing, so the rpc term is part of each intercept) and the Draft also applies the last verdict.
Estimates:
  a        S / (S + F) over the session's rounds, each count decayed by `decay` per round: S = accepted
           drafts, F = rounds that rejected a draft (a full block, m = K, is censored: no failure seen),
           plus `prior_weight` pseudo-rounds at `prior_a` (the MLE of a censored geometric). First drafts
           judged without a round (`observe_drafts`: fast-mode mtp's plain rounds) count as K = 1 rounds.
  costs    per K, an EWMA (`alpha`) of each part's seconds at that K (a figure older than 2 `probe_every`
           rounds, or measured at a batch of sessions more than 2x off the current one, is replaced by
           the next measurement, not blended, and prices nothing meanwhile: with one controller for a
           batch, a round of 32 sessions costs several times one of 1); a K never run is priced by the
           weighted least-squares line through the Ks run (a draft is K row steps, a verify one pass of
           K+1 rows: both near linear in K; slope >= 0), each K weighted by its (decayed) count. With a
           single K run there is no slope: the next round probes a neighbour (up if a >= 0.5). Every
           `probe_every` rounds a neighbour whose figure is stale is probed again (the load changes),
           if its predicted rate is within `probe_band` of the current K's (it could win).
Hysteresis: K moves only when rate(best) > (1 + margin) rate(K) for `patience` rounds in a row, and by
at most `max_step` at a time. K = 0 (plain AR) is a candidate only when k_min = 0; its cost is then what
`observe(0, 0, 0, seconds)` reports (E(0) = 1). The cost line never prices it: a plain round has no chain
and no block to cut, a different cost from any speculative K. So the switch between plain and speculative
rounds has its own probe: at K > 0 it probes K = 0, at K = 0 the last speculative K. It runs once the other
side's figure is stale (`probe_every` rounds old), not in a neighbour-probe round, and only if that side
could win (within `probe_band`) or its probe is cheap: its predicted seconds at most `probe_share` of the
seconds run since it was measured, so a dear probe (a K = 4 round under a heavy batch) comes rarely and
costs the batch at most ~2% (5% until 2026-12-06: the whole of issue 21's tolerance). Plain rounds are
priced by the median of their last PLAIN_WINDOW seconds, and from K = 0 a speculative K is switched to
only on a figure of its own, measured within `probe_every` rounds at about this batch or a larger one
(_fresh): a few plain rounds slowed by a prefill pass beside them no longer switch the batch to speculative
rounds on an old figure (tests/engine/test_draft_length.py simulates it: before, one speculative round each
time). A switch to or from K = 0 is one move, not `max_step`s. A speculative figure measured at another
batch size prices nothing, so it is probed again at once, except when the batch has
grown past the one where speculation lost to plain rounds: speculation pays less the larger the batch (its
K + 1 verify rows a session stop being free), so there it is probed only as a dear probe, priced at its
old figure scaled by the batch's growth, and no neighbour K is probed from K = 0 then. That batch is the
smallest where speculation lost, by a switch to K = 0 or by a switch probe from K = 0 that lost by more
than `margin` (priced against plain rounds measured at as many sessions or more, when none were at about
this batch: a wave's end drops the batch and probes at once; until 2026-12-07 such a loss marked nothing,
and the next wave probed again above it; a near tie marks nothing, as a K = 1 probe that only just lost at
2 sessions would make the next win there clear every mark): a win at fewer sessions keeps it, a win at as
many or more clears it. A caller that names the round's batch (next_k(batch): fast-mode mtp's launch) has a
speculative K fall to K = 0 before a round at a batch past it: a wave of sessions joining a batch that
speculates (learned while it was small) does not start with a speculative round of all of them, computed at
once; nor, where speculation never lost, does a wave that more than doubles it to JUMP_BATCH or more
(_jumped). On the H200 the sessions of a 32-stream point land in waves, and each wave's batch re-probed K = 4
at ~84 ms a round: the likely cause of most of fast mtp's 0.92x against bf16 there (not profiled). (At 32
streams on the H200 a K = 4 round cost ~84 ms for ~4 tokens a session against ~7 ms for a plain step, but
K = 0 was never measured, so K stayed 4: fast mtp ran at 0.62x fast bf16.) Exact mode cannot run K = 0
today (Draft and Verify refuse a block of 0 drafts), so its floor is k_min = 1 (docs/CONTRACTS.md, "Draft length"); fast-mode
MTP on the decode worker runs it (a batched AR step: decode_worker/mtp_launch.py), with k_min = 0 and one
controller for all the worker's mtp sessions, whose rounds are one batch (`observe_round`: the pooled
acceptance, the round's seconds): when speculation costs the batch more than it yields (large batches,
low acceptance) every session falls back to plain steps together; a session's own acceptance cuts its K
(baton/engine/draft_cap.py). K changes speed only: every round is verified, the tokens are the exact engine's.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

DEFAULT_K_MAX = 8  # CUDA graphs of the verify / draft rows exist up to K = 8 (decode_worker/serve.py)
POLICIES = ("adaptive", "fixed")
JUDGED_WEIGHT = 16.0  # the most rounds one observe_drafts call weighs (DraftLength.observe_drafts)
SPEC_LOG = 256  # speculative rounds DraftLength.spec_log keeps (WorkerStats.mtp_spec_rounds)
REENTER_K = 2  # a wave joining a batch that speculates: the K its switch probe tries first (DraftLength._jumped)
JUMP_BATCH = 8  # ... a wave of at least this many sessions (below, verify rows are nearly free: keep the K)


def expected_tokens(k: int, a: float) -> float:
    """E[tokens of one round | K = k, acceptance a] = sum_{i=0..k} a^i."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


PLAIN_WINDOW = 16  # plain rounds (K = 0) priced by the median of the last this many (DraftLength.cost)


@dataclass
class _Entry:
    draft_s: float
    verify_s: float
    weight: float  # decayed count of rounds at this K
    age: int = 0  # rounds since last observed
    batch: int = 1  # sessions in the round that measured it (observe_round: a batch's rounds)
    recent: list[float] | None = None  # K = 0: the last PLAIN_WINDOW rounds' seconds, oldest first

    def seconds(self) -> float:
        """The round's price: plain rounds the median of their recent seconds (a moment's load, a prefill
        pass beside a few steps, does not price them), else the EWMA of its parts."""
        if self.recent and len(self.recent) >= 3:
            return sorted(self.recent)[len(self.recent) // 2]
        return self.draft_s + self.verify_s


class DraftLength:
    """The per-session controller (module doc)."""

    def __init__(
        self,
        prior_k: int,
        k_max: int = DEFAULT_K_MAX,
        k_min: int = 1,
        *,
        prior_a: float = 0.5,
        prior_weight: float = 1.0,
        decay: float = 0.95,
        alpha: float = 0.3,
        margin: float = 0.05,
        patience: int = 2,
        max_step: int = 2,
        probe_every: int = 16,
        probe_band: float = 0.15,
        probe_share: float = 0.02,
    ):
        if not 0 <= k_min <= k_max:
            raise ValueError(f"k_min {k_min} and k_max {k_max}: need 0 <= k_min <= k_max")
        self.k_min, self.k_max = k_min, k_max
        self.k = min(max(prior_k, k_min), k_max)
        self.prior_a, self.prior_weight, self.decay, self.alpha = prior_a, prior_weight, decay, alpha
        self.margin, self.patience, self.max_step, self.probe_every = margin, patience, max_step, probe_every
        self.probe_band, self.probe_share = probe_band, probe_share
        self._spec_k = max(1, self.k)  # the speculative K a switch probe from K = 0 tries
        self._batch = 1  # sessions in the last round observed
        self._lost_at: int | None = None  # the smallest batch where speculation lost to plain rounds (K -> 0)
        self.costs: dict[int, _Entry] = {}
        self.s = self.f = 0.0  # decayed accepted drafts / rejecting rounds
        self.rounds = 0
        self._want: int | None = None  # the switch hysteresis is counting for
        self._streak = 0
        self._probe: int | None = None  # K of the round asked for by a probe (not the settled K)
        self.by_k: dict[int, tuple[int, float]] = {}  # K -> (rounds, their seconds) observed: WorkerStats
        # the last speculative rounds (round, K, batch, seconds, probe): WorkerStats.mtp_spec_rounds, read by copy
        self.spec_log: collections.deque[tuple[int, int, int, float, bool]] = collections.deque(maxlen=SPEC_LOG)

    # ---- estimates -------------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        return (self.s + self.prior_a * self.prior_weight) / (self.s + self.f + self.prior_weight)

    def cost(self, k: int) -> float | None:
        """Predicted seconds of a round at K = k; None when nothing is known."""
        e = self.costs.get(k)
        if e is not None and self._matched(e):
            return e.seconds()
        if k == 0:
            return None  # plain AR is priced only by measuring it
        pts = [(j, e.seconds(), e.weight) for j, e in self.costs.items() if j > 0 and self._matched(e)]
        if len({j for j, *_ in pts}) < 2:
            return None
        w = sum(p[2] for p in pts)
        mk = sum(j * wt for j, _, wt in pts) / w
        mc = sum(c * wt for _, c, wt in pts) / w
        var = sum(wt * (j - mk) ** 2 for j, _, wt in pts)
        slope = max(0.0, sum(wt * (j - mk) * (c - mc) for j, c, wt in pts) / var)
        return max(1e-9, mc + slope * (k - mk))

    def rate(self, k: int) -> float | None:
        c = self.cost(k)
        return None if c is None else expected_tokens(k, self.acceptance) / c

    # ---- the loop --------------------------------------------------------------------------------
    def next_k(self, batch: int | None = None) -> int:
        """K for the next round: the settled K, or a probe of a neighbour (module doc). batch: the sessions
        the round will run (observe_round's callers know it before the round; None: the last round's). A
        speculative K facing a batch larger than the one where speculation lost to plain rounds falls to
        K = 0 before the round, not after a dear round at the new batch (a wave of sessions joining)."""
        self._probe = None
        if batch is not None:
            self._batch = max(1, batch)
            out, jumped = self._outgrown(), self.k_min == 0 and self._jumped()  # (a loss implies k_min = 0)
            if self.k > 0 and (out or jumped):  # a wave joined: K = 0, the switch probe re-enters (_jumped)
                self._spec_k, self.k = self.k if out else min(self.k, REENTER_K), 0
                self._want, self._streak = None, 0
        if not self.costs:
            return self.k
        runs = [j for j in self.costs if j > 0]
        up, down = self.k + 1, self.k - 1
        lo = self.k_min  # K = 0 (k_min = 0): probed like any K, priced by what its rounds measured
        if (j := self._switch_probe(len(runs))) is not None:
            self._probe = j
            return j
        if self.k == 0 and self._outgrown():  # speculation lost at fewer sessions: the switch probe's gate only
            return self.k
        if len(runs) < 2 or (self.probe_every and self.rounds % self.probe_every == 0):
            want_up = self.acceptance >= 0.5
            order = (up, down) if want_up else (down, up)
            for j in order:
                if lo <= j <= self.k_max and (len(runs) < 2 or (self._stale(j) and self._plausible(j))):
                    self._probe = j
                    return j
        return self.k

    def _switch_probe(self, runs: int) -> int | None:
        """The plain <-> speculative probe (k_min = 0; module doc) due this round, or None: K = 0 from a
        speculative K once the cost line exists (two Ks run), the last speculative K from K = 0."""
        if self.k_min != 0 or not self.probe_every or self.rounds % self.probe_every == 0:
            return None
        if self.k > 0 and runs < 2:
            return None
        j = 0 if self.k > 0 else self._spec_k
        e = self.costs.get(j)
        if e is None:
            return j
        if not self._matched(e):  # measured at another batch size: its figure prices nothing now
            if j == 0 or not self._outgrown():
                return j  # probe it now: it could win here
            # more sessions than where speculation lost: it pays less the larger the batch (its verify
            # rows stop being free), so only a dear probe, its old figure scaled by the batch's growth
            cur = self.cost(self.k)
            est = e.seconds() * self._batch / e.batch
            cheap = cur is not None and est <= self.probe_share * e.age * cur
            return j if e.age >= self.probe_every and cheap else None
        if e.age < self.probe_every:
            return None
        cost, cur = self.cost(j), self.cost(self.k)
        cheap = cost is not None and cur is not None and cost <= self.probe_share * e.age * cur
        return j if cheap or self._plausible(j) else None

    def _jumped(self) -> bool:
        """A wave joined a batch that speculates: the named batch is over twice the settled K's figure's (on 2
        cores two K = 8 rounds of 16 then took ~545 ms each, ~42 ms plain: spec-log-cpu-mtp16). The switch
        probe tries K = min(K, REENTER_K): cheaper, still a win where speculation pays (K = 1 may tie)."""
        e = self.costs.get(self.k)
        return e is not None and self._batch > 2 * e.batch and self._batch >= JUMP_BATCH

    def _outgrown(self) -> bool:
        """The batch is larger than the one where speculation last lost to plain rounds (module doc)."""
        return self._lost_at is not None and self._batch > self._lost_at

    def _plausible(self, k: int) -> bool:
        """A refresh probe is worth a round only if K = k could win (within probe_band of the current)."""
        r, cur = self.rate(k), self.rate(self.k)
        return r is None or cur is None or r >= (1.0 - self.probe_band) * cur

    def _stale(self, k: int) -> bool:
        e = self.costs.get(k)
        return e is None or e.age >= self.probe_every or not self._matched(e)

    def _matched(self, e: _Entry) -> bool:
        """Measured at about the current batch (within 2x): a round of 32 sessions costs several times
        one of 1, so a figure from another batch size prices nothing now (module doc)."""
        return e.batch <= 2 * self._batch and self._batch <= 2 * e.batch

    def observe(self, k: int, accepted: int, draft_s: float, verify_s: float) -> int:
        """One finished round: k drafted (0 = a plain AR step), `accepted` of them kept, the seconds of its
        Draft and Verify calls. Returns the settled K."""
        return self.observe_round(k, [accepted], draft_s, verify_s)

    def observe_round(self, k: int, accepted: list[int], draft_s: float, verify_s: float) -> int:
        """A round that several sessions ran together at K = k (one controller for a batch: fast-mode
        mtp): accepted[i] drafts kept by session i (pooled into the acceptance), the round's seconds (so
        rate(K) is each session's tokens/s, and the batch's over B). Returns the settled K."""
        if any(not 0 <= m <= k for m in accepted):
            raise ValueError(f"accepted {accepted} out of range 0..{k}")
        self.rounds += 1
        n, secs = self.by_k.get(k, (0, 0.0))
        self.by_k[k] = (n + 1, secs + draft_s + verify_s)
        if k > 0:
            self.s = self.s * self.decay + sum(accepted)
            self.f = self.f * self.decay + sum(1.0 for m in accepted if m < k)
        for e in self.costs.values():
            e.weight *= self.decay
            e.age += 1
        self._batch = max(1, len(accepted))
        if k > 0:
            self.spec_log.append((self.rounds, k, self._batch, draft_s + verify_s, k == self._probe))
        e = self.costs.get(k)
        if e is None or (self.probe_every and e.age > 2 * self.probe_every) or not self._matched(e):
            e = self.costs[k] = _Entry(draft_s, verify_s, 1.0, batch=self._batch)  # new, or of another load
        else:
            e.draft_s += self.alpha * (draft_s - e.draft_s)
            e.verify_s += self.alpha * (verify_s - e.verify_s)
            e.weight, e.age = e.weight + 1.0, 0
        if k == 0:
            e.recent = (e.recent or [])[-(PLAIN_WINDOW - 1) :] + [draft_s + verify_s]
        self._decide()
        if k > 0 and self.k == 0:
            self._lost_probe(k)
        return self.k

    def _lost_probe(self, k: int) -> None:
        """A switch probe at K = k that lost by more than `margin`: this batch is one where speculation lost,
        as a switch to K = 0 records it (_decide): growth past it stops all but dear probes (_outgrown)."""
        spec, plain = self.rate(k), self.rate(0)
        e = self.costs.get(0)
        if plain is None and e is not None and e.batch >= self._batch:  # plain rounds cost more the larger
            plain = 1.0 / e.seconds()
        if spec is not None and plain is not None and spec * (1.0 + self.margin) < plain:  # lost clearly
            self._mark_lost()

    def _mark_lost(self) -> None:
        """This batch is one where speculation lost; the smallest such is kept (_outgrown)."""
        self._lost_at = self._batch if self._lost_at is None else min(self._lost_at, self._batch)

    def observe_drafts(self, accepted: int, rejected: int) -> None:
        """First drafts judged without a round (fast-mode mtp's plain rounds: decode_worker/mtp_launch.py):
        `accepted` would have been kept, `rejected` not. Each is a round of K = 1 to the acceptance
        estimate, so at K = 0 the acceptance stays current and the switch probe's `_plausible` sees it.
        One call (a flush: ~9 pairs a session of the batch) decays the counts as a round does and weighs
        at most JUDGED_WEIGHT rounds, so hundreds of judged drafts do not freeze the estimate."""
        if accepted < 0 or rejected < 0:
            raise ValueError(f"accepted {accepted}, rejected {rejected}: need >= 0")
        n = accepted + rejected
        w = min(1.0, JUDGED_WEIGHT / n) if n else 0.0
        self.s = self.s * self.decay + accepted * w
        self.f = self.f * self.decay + rejected * w

    def forget_costs(self) -> None:
        """The session moved to another worker (migration): its costs are someone else's now."""
        self.costs.clear()
        self._want, self._streak = None, 0

    def _fresh(self, j: int) -> bool:
        """From K = 0, a speculative K may be switched to only on a figure of its own, measured within
        `probe_every` rounds at about this batch or a larger one (within 1.25x): a plain round's figure is
        refreshed every round, so an old figure, or one from fewer sessions (a speculative round's cost
        grows with the batch, a plain step's barely), would win against plain rounds slowed by a moment's
        load (a prefill pass beside them) and cost the batch dear rounds until they are measured again.
        Such a K is measured by the switch probe instead (_switch_probe), and wins from that."""
        if self.k != 0 or j == 0:
            return True
        e = self.costs.get(j)
        return e is not None and e.age < self.probe_every and 1.25 * e.batch >= self._batch

    def _decide(self) -> None:
        cur = self.rate(self.k)
        cands = [
            (r, j) for j in range(self.k_min, self.k_max + 1) if self._fresh(j) and (r := self.rate(j)) is not None
        ]
        if cur is None or not cands:
            return
        best_rate, best = max(cands)
        if best == self.k or best_rate <= cur * (1.0 + self.margin):
            self._want, self._streak = None, 0
            return
        if best == self._want:
            self._streak += 1
        else:
            self._want, self._streak = best, 1
        if self._streak >= self.patience:
            if best == 0 or self.k == 0:  # plain AR <-> speculation: one move (module doc)
                if best == 0:  # the smallest batch where speculation lost is kept
                    self._spec_k = self.k
                    self._mark_lost()
                elif self._lost_at is not None and self._batch >= self._lost_at:
                    self._lost_at = None  # it wins where it lost: the load changed (a win below it says nothing)
                self.k = best
            else:
                self.k += max(-self.max_step, min(self.max_step, best - self.k))
            self._want, self._streak = None, 0


class FixedLength:
    """K as the request (or the server's default) says, every round: today's behaviour."""

    def __init__(self, k: int):
        self.k = k
        self.by_k: dict[int, tuple[int, float]] = {}  # as DraftLength's

    def next_k(self, batch: int | None = None) -> int:
        return self.k

    def observe(self, k: int, accepted: int, draft_s: float, verify_s: float) -> int:
        return self.k

    def observe_round(self, k: int, accepted: list[int], draft_s: float, verify_s: float) -> int:
        n, secs = self.by_k.get(k, (0, 0.0))
        self.by_k[k] = (n + 1, secs + draft_s + verify_s)
        return self.k

    def observe_drafts(self, accepted: int, rejected: int) -> None:
        pass

    def forget_costs(self) -> None:
        pass


def controller(policy: str, k: int, k_max: int, k_min: int = 1):
    """The draft-length controller of one session: `policy` in POLICIES; k: the request's K (the
    adaptive prior); k_max: the adaptive ceiling (at most the worker's W - 2); k_min: 0 where plain AR
    rounds exist (fast-mode MTP), else 1 (exact mode)."""
    if policy == "fixed":
        return FixedLength(k)
    if policy == "adaptive":
        return DraftLength(prior_k=k, k_max=max(k_max, k, 1), k_min=k_min)
    raise ValueError(f"draft length policy {policy!r}: one of {', '.join(POLICIES)}")
