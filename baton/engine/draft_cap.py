"""A session's own draft cap inside a batch's speculative round (fast-mode MTP on the decode worker: one
controller, one K for the batch, baton/engine/draft_length.py; issue 21, point 4: K per session, from that
session's recent acceptance). Pure (no torch, no clock).

    cap = SessionCap()                      one per session (DecodeSession.draft_cap), made with it
    k = cap.cap(K, a_batch)                 before a speculative round at the batch's K: 0..K
    cap.observe(k, m)                       after it, where k > 0: k drafted, m kept
    cap.observe_drafts(kept, rejected)      first drafts judged without a round (a plain round's flush)

The rule. The controller picks the batch's K for the pooled acceptance a of the sessions that drafted
(argmax over K of a session's expected tokens a second), so the K-th draft, kept with probability a^K, is
worth its share of the round. A session drafts its j-th token only while that draft is likely enough to
be kept: a_s^j >= min(a^K, FLOOR), a_s its own acceptance. The batch's last draft's worth alone would cut
too much: a capped session's draft costs the round less than the batch's last (its own verify rows only; the
chain's steps run for the others anyway), and at small batches on a GPU verify rows are nearly free. So a
draft is cut only when it is kept less often than FLOOR: where rows are free a cut costs a session under
FLOOR / (1 - a_s) tokens a round (0.3 at a_s = 0.5; not measured on a GPU). A grammar's session (its drafts are
proposals the grammar may refuse: 1.08 tokens a round under json_object against 1.67 unmasked on the
embedded model), or one whose text the head predicts badly, then stops paying for verify rows (and a
grammar's host mask of each: Masker.block) that are rarely kept.

The estimate: a_s = (S + w a) / (S + F + w) with S its kept drafts and F its rounds that rejected one (a
full block is censored: no failure seen), each count decayed by DECAY a round, and w = PRIOR_WEIGHT
pseudo-rounds at the batch's a: a new session drafts as the batch does. A session capped at 0 learns
nothing from its rounds, so every PROBE_EVERY-th round that its acceptance would cap at 0 drafts 1.
K changes speed only: every round is verified, so the tokens are the exact engine's whatever each session's K.
"""

from __future__ import annotations

DECAY = 0.9  # per observed round (a session's text changes: code, prose, a grammar's next field)
PRIOR_WEIGHT = 1.0  # pseudo-rounds at the batch's acceptance
FLOOR = 0.15  # a draft kept less often than this (and than the batch's last) is cut
PROBE_EVERY = 16  # a session capped at 0 by its acceptance drafts 1 every this many such rounds


class SessionCap:
    """One session's acceptance and draft cap (module doc)."""

    def __init__(self) -> None:
        self.s = self.f = 0.0  # decayed kept drafts / rounds that rejected one
        self.idle = 0  # rounds in a row its acceptance capped at 0

    def acceptance(self, a_batch: float) -> float:
        return (self.s + PRIOR_WEIGHT * a_batch) / (self.s + self.f + PRIOR_WEIGHT)

    def cap(self, K: int, a_batch: float) -> int:
        """The most drafts this session takes in a round at the batch's K, whose pooled acceptance is a_batch."""
        if K <= 0:
            return 0
        a, floor = self.acceptance(a_batch), min(a_batch**K, FLOOR)
        k = 0
        while k < K and a ** (k + 1) >= floor:
            k += 1
        if k == 0:
            self.idle += 1
            if self.idle >= PROBE_EVERY:  # learn again: its text may have changed
                self.idle, k = 0, 1
        else:
            self.idle = 0
        return k

    def observe(self, k: int, kept: int) -> None:
        """A round that drafted k > 0 tokens of this session, `kept` of them accepted."""
        if not 0 <= kept <= k or k <= 0:
            raise ValueError(f"kept {kept} of {k} drafts")
        self.s = self.s * DECAY + kept
        self.f = self.f * DECAY + (kept < k)

    def observe_drafts(self, kept: int, rejected: int) -> None:
        """First drafts judged without a round: each a round of K = 1, decayed as one round in all."""
        n = kept + rejected
        if n:
            self.s = self.s * DECAY + kept / n
            self.f = self.f * DECAY + rejected / n
