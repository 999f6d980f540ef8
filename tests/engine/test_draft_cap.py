"""A session's own draft cap under the batch's K (baton/engine/draft_cap.py), pure: a new session drafts as
the batch does, one whose drafts are rejected stops drafting but for a probe every PROBE_EVERY rounds, one
whose acceptance sits between drafts as far as its drafts are worth the batch's last."""

from __future__ import annotations

import pytest

from baton.engine.draft_cap import FLOOR, PROBE_EVERY, SessionCap


@pytest.mark.parametrize("a", [0.2, 0.5, 0.9, 1.0])
def test_a_new_session_drafts_the_batch_k(a):
    for K in range(0, 9):
        assert SessionCap().cap(K, a) == K


def test_rejected_drafts_stop_it_drafting_but_for_a_probe_every_probe_every_rounds():
    c = SessionCap()
    assert c.cap(4, 0.9) == 4
    warm = []
    while not warm or warm[-1]:  # every draft rejected: its cap falls to 0 within a few rounds
        c.observe(warm[-1] if warm else 4, 0)
        warm.append(c.cap(4, 0.9))
    assert len(warm) <= 8 and warm == sorted(warm, reverse=True), warm
    c.idle = 0
    ks = []
    for _ in range(3 * PROBE_EVERY):
        k = c.cap(4, 0.9)
        ks.append(k)
        if k:
            c.observe(k, 0)
    assert ks.count(1) == 3 and ks.count(0) == 3 * PROBE_EVERY - 3, ks
    assert [i for i, k in enumerate(ks) if k] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]


def test_a_probe_that_is_kept_brings_it_back():
    c = SessionCap()
    for _ in range(10):
        c.observe(4, 0)
    assert c.cap(4, 0.9) == 0
    got = []
    for _ in range(12):  # its text changed: every draft kept
        c.observe(1, 1)
        got.append(c.cap(4, 0.9))
    assert got == sorted(got) and got[0] >= 1 and got[-1] == 4, got


def test_a_middling_session_drafts_while_its_drafts_are_likely_kept():
    c = SessionCap()
    for _ in range(40):  # one kept, the next rejected: a = 0.5
        c.observe(2, 1)
    assert abs(c.acceptance(0.9) - 0.5) < 0.02
    # the batch's 4th draft: kept with 0.9^4 = 0.66; its own 1st, 2nd, 3rd: 0.5, 0.25, 0.125 < FLOOR
    assert FLOOR == 0.15 and c.cap(4, 0.9) == 2
    assert c.cap(1, 0.9) == 1
    assert c.cap(4, 0.4) == 4  # kept as often as the batch's last (0.4^4): it drafts the batch's K
    assert c.cap(8, 0.95) == 2


def test_judged_first_drafts_count_as_one_round():
    c, d = SessionCap(), SessionCap()
    c.observe_drafts(3, 6)
    d.observe(1, 0)  # one rejected K = 1 round: a in both below the prior
    assert c.acceptance(0.5) < 0.5 and d.acceptance(0.5) < 0.5
    assert c.s + c.f == pytest.approx(1.0)
    c.observe_drafts(0, 0)  # nothing judged: nothing learned, nothing decayed
    assert c.s + c.f == pytest.approx(1.0)


@pytest.mark.parametrize("k, kept", [(0, 0), (2, 3), (2, -1)])
def test_a_block_out_of_range_is_refused(k, kept):
    with pytest.raises(ValueError):
        SessionCap().observe(k, kept)
