"""baton/engine/draft_length.py: the adaptive draft-length controller, driven by a simulated session (geometric
acceptance, round costs linear in K with noise): small K when acceptance is low, large K when it is high,
K_max and the floor respected, hysteresis (no flapping between near-equal Ks), the prior for a new
session, the cost fit, and the fixed policy."""

from __future__ import annotations

import random

import pytest

from baton.engine.draft_length import DraftLength, FixedLength, controller, expected_tokens

# a CPU-like worker pair: Draft = rpc + K row steps, Verify = rpc + one pass (K+1 rows, nearly flat)
RPC, STEP, PASS = 0.5e-3, 3e-3, 4e-3


def draft_s(k):
    return RPC + k * STEP


def verify_s(k):
    return RPC + PASS + 1e-4 * (k + 1)


def simulate(ctl, p, rounds=200, seed=0, noise=0.1, step=STEP):
    """-> the K of every round; the controller sees each round's acceptance and (noisy) costs."""
    rng, ks = random.Random(seed), []
    for _ in range(rounds):
        k = ctl.next_k()
        m = 0
        while m < k and rng.random() < p:
            m += 1
        d = (RPC + k * step) * (1 + noise * rng.uniform(-1, 1))
        v = verify_s(k) * (1 + noise * rng.uniform(-1, 1))
        ctl.observe(k, m, d, v)
        ks.append(k)
    return ks


def best_k(p, k_min=1, k_max=8, step=STEP):
    return max(range(k_min, k_max + 1), key=lambda k: expected_tokens(k, p) / (RPC + k * step + verify_s(k)))


def test_expected_tokens_is_the_geometric_sum():
    for a in (0.0, 0.3, 0.9):
        for k in range(6):
            assert expected_tokens(k, a) == pytest.approx(sum(a**i for i in range(k + 1)))
    assert expected_tokens(4, 1.0) == 5


@pytest.mark.parametrize("seed", range(3))
def test_low_acceptance_gives_the_floor(seed):
    ks = simulate(DraftLength(prior_k=4, k_max=8), p=0.2, seed=seed)
    assert best_k(0.2) == 1
    assert ks[0] == 4  # the prior first
    assert ks[-100:].count(1) >= 90  # then the floor, but for rare probes


@pytest.mark.parametrize("seed", range(3))
def test_high_acceptance_gives_a_large_k_capped_at_k_max(seed):
    # drafting cheap next to a verify pass (a GPU-like pair): at p = 0.99 K_max pays most
    ks = simulate(DraftLength(prior_k=4, k_max=8), p=0.99, seed=seed, step=0.3e-3)
    assert best_k(0.99, step=0.3e-3) == 8
    assert max(ks) == 8
    assert sum(ks[-100:]) / 100 >= 7.0
    ks = simulate(DraftLength(prior_k=4, k_max=6), p=0.99, seed=seed, step=0.3e-3)
    assert max(ks) == 6 and ks[-1] == 6


def test_the_floor_is_respected_and_k0_needs_a_measured_ar_cost():
    ks = simulate(DraftLength(prior_k=4, k_max=8, k_min=2), p=0.0)
    assert min(ks) == 2 and ks[-50:].count(2) >= 45
    # k_min = 0 (fast-mode MTP): K = 0, plain AR, is probed like any K; it is chosen when its rounds are
    # measured to beat every speculative round (p = 0: no draft is ever accepted) ...
    ks = simulate(DraftLength(prior_k=2, k_max=4, k_min=0), p=0.0, rounds=120)
    assert ks[-40:].count(0) >= 36, ks[-40:]
    # ... and not when speculation pays (high acceptance)
    c = DraftLength(prior_k=2, k_max=4, k_min=0)
    ks = simulate(c, p=0.95, rounds=120)
    assert best_k(0.95, k_max=4) == 4  # K = 2 and 3 within 3% of it: any of them
    assert ks[-40:].count(0) <= 4 and c.k >= 2, ks[-40:]
    # without a measured AR cost K = 0 has no rate, so it is never settled on from a prior alone
    c = DraftLength(prior_k=2, k_max=4, k_min=0)
    assert c.rate(0) is None
    c.observe(0, 0, 0.0, RPC + PASS)
    assert c.rate(0) == pytest.approx(1 / (RPC + PASS))


def test_hysteresis_holds_k_between_near_equal_choices():
    """Rates within the margin never move K, and a better K must win `patience` rounds in a row."""
    c = DraftLength(prior_k=3, k_max=8, margin=0.05, patience=2, probe_every=0)
    # costs that make K = 3 and K = 4 equal to 2% at a = 0.8: K must stay
    a = 0.8
    cost = {k: expected_tokens(k, a) for k in range(1, 9)}
    cost[4] *= 1 / 1.02
    c.s, c.f, c.prior_weight = 800.0, 200.0, 0.0
    for k in (3, 4):
        c.observe(k, 1, cost[k] / 2, cost[k] / 2)
    for _ in range(20):
        c.observe(3, 2, cost[3] / 2, cost[3] / 2)
        assert c.k == 3
    # a clear win must repeat: one round of it is not enough
    c2 = DraftLength(prior_k=4, k_max=8, patience=3, probe_every=0)
    c2.observe(4, 4, draft_s(4), verify_s(4))
    c2.observe(5, 5, draft_s(5), verify_s(5))
    before = c2.k
    c2.s, c2.f, c2.prior_weight = 0.0, 100.0, 0.0  # acceptance drops to 0: K = 1 is better
    c2.observe(4, 0, draft_s(4), verify_s(4))
    assert c2.k == before
    c2.observe(4, 0, draft_s(4), verify_s(4))
    assert c2.k == before
    c2.observe(4, 0, draft_s(4), verify_s(4))
    assert c2.k == before - 2  # after 3 rounds, by at most max_step = 2


def test_no_flapping_at_a_stable_acceptance():
    ks = simulate(DraftLength(prior_k=4, k_max=8), p=0.8, rounds=300, seed=1)
    settled = ks[100:]
    changes = sum(1 for x, y in zip(settled, settled[1:]) if x != y)
    assert changes <= 2 * (200 // 16) + 4  # probes (out and back) and a few moves, not every round


def test_the_prior_then_a_probe_gives_the_cost_slope():
    c = DraftLength(prior_k=5, k_max=8)
    assert c.next_k() == 5 and c.cost(5) is None
    c.observe(5, 5, draft_s(5), verify_s(5))
    assert c.cost(6) is None  # one K: no slope yet
    assert c.next_k() == 6  # probe up (acceptance seen high)
    c.observe(6, 6, draft_s(6), verify_s(6))
    assert c.cost(8) == pytest.approx(draft_s(8) + verify_s(8), rel=1e-6)  # the line through both
    c = DraftLength(prior_k=5, k_max=8)
    c.observe(5, 0, draft_s(5), verify_s(5))
    assert c.next_k() == 4  # acceptance seen low: probe down


def test_prior_is_clamped_and_inputs_checked():
    assert DraftLength(prior_k=12, k_max=8).next_k() == 8
    assert DraftLength(prior_k=1, k_max=8, k_min=2).next_k() == 2
    with pytest.raises(ValueError):
        DraftLength(prior_k=4, k_max=3, k_min=4)
    with pytest.raises(ValueError):
        DraftLength(prior_k=4).observe(2, 3, 0.1, 0.1)


def test_fixed_policy_and_the_factory():
    f = controller("fixed", 5, 8)
    assert isinstance(f, FixedLength)
    assert simulate(f, p=0.1, rounds=20) == [5] * 20
    a = controller("adaptive", 10, 8)  # a request's larger K raises the ceiling
    assert isinstance(a, DraftLength) and a.k_max == 10 and a.next_k() == 10
    with pytest.raises(ValueError):
        controller("sometimes", 4, 8)


def test_forget_costs_after_a_migration_keeps_acceptance():
    c = DraftLength(prior_k=4, k_max=8)
    simulate(c, p=0.9, rounds=30)
    a = c.acceptance
    c.forget_costs()
    assert c.costs == {} and c.acceptance == a
    assert c.next_k() == c.k


def _batch_rounds(c, rounds, p, cost, rng, sessions=16, noise=0.05, named=False):
    """-> the K of each of `rounds` rounds of a batch of `sessions` under one controller (observe_round):
    each draft accepted with probability p, cost(k) the round's seconds (times 1 +- noise). named: the
    caller names the round's batch to next_k (fast-mode mtp's launch does)."""
    ks = []
    for _ in range(rounds):
        k = c.next_k(batch=sessions) if named else c.next_k()
        acc = []
        for _ in range(sessions):
            m = 0
            while m < k and rng.random() < p:
                m += 1
            acc.append(m)
        c.observe_round(k, acc, 0.0, cost(k) * (1 + noise * rng.uniform(-1, 1)) if noise else cost(k))
        ks.append(k)
    return ks


@pytest.mark.parametrize("p, low", [(0.0, True), (0.9, False)])
def test_one_controller_for_a_batch_pools_its_sessions(p, low):
    """observe_round (fast-mode mtp: one K for all the worker's sessions, whose rounds are one batch):
    the acceptance pooled over the round's sessions, the cost the round's: K = 0 when no draft is
    accepted, the best K when most are."""
    c = DraftLength(prior_k=2, k_max=6, k_min=0)
    ks = _batch_rounds(c, 150, p, lambda k: RPC + k * STEP + verify_s(k), random.Random(4), sessions=8, noise=0.0)
    with pytest.raises(ValueError):
        c.observe_round(2, [0, 3], 0.0, 1.0)
    tail = ks[-40:]
    if low:
        assert tail.count(0) >= 36, tail
    else:  # the best K of this cost model (drafting is dear: K = 2 at p = 0.9); K = 0 only as its probe
        assert tail.count(0) <= 3 and sorted(tail)[20] == best_k(p) == 2, tail
        assert c.k == 2


def heavy(k):  # a large batch on the H200 (2026-12-02): a plain step ~7 ms, a speculative round ~60 ms + 6 ms/K
    return 7e-3 if k == 0 else 60e-3 + 6e-3 * k


def light(k):  # a small batch: a plain step 5 ms, speculation nearly free
    return 5e-3 if k == 0 else 9e-3 + 1e-3 * k


def test_plain_steps_win_a_heavy_batch_from_a_speculative_prior():
    """K = 0 is priced by its own probe, not by the cost line of the speculative Ks: from K = 4 at high
    acceptance, a batch whose speculative rounds cost 8x a plain step settles on K = 0 (0.62x of fast
    bf16 on the H200 before this probe: K stayed 4), in one move."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(7)
    assert 4.1 / heavy(4) < 1 / heavy(0)  # the model: plain steps win at p = 0.9
    ks = _batch_rounds(c, 200, 0.9, heavy, rng)
    first = ks.index(0)
    assert first <= 12, ks[:20]
    assert ks[-100:].count(0) >= 90, ks[-100:]
    # probes of the speculative side are rare when dear: at most ~5% of the time
    spent = sum(heavy(k) for k in ks[-100:])
    assert sum(heavy(k) for k in ks[-100:] if k) <= 0.1 * spent, ks[-100:]


def test_speculation_comes_back_when_the_batch_lightens():
    # no judged drafts here (fast mtp's flush keeps the acceptance current at K = 0): it comes back through
    # the cheap probe alone, whose share these recovery tests set at 5% (the default 2% takes 2.5x the rounds)
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0, probe_share=0.05), random.Random(8)
    _batch_rounds(c, 150, 0.9, heavy, rng)
    assert c.k == 0
    ks = _batch_rounds(c, 600, 0.9, light, rng)
    assert c.k >= 3, ks[-40:]
    assert ks[-40:].count(0) <= 4, ks[-40:]


def test_a_light_batch_keeps_speculating():
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(9)
    ks = _batch_rounds(c, 200, 0.9, light, rng)
    assert c.k >= 3 and ks[-100:].count(0) <= 8, ks[-100:]


def test_a_jump_in_the_batch_reprices_at_once():
    """Costs are of a batch size: a figure measured at a batch more than 2x off the current one prices
    nothing. A controller settled on speculation at one session, then given 16 sessions whose speculative
    rounds cost 8x a plain step, falls back to K = 0 within a few rounds (priced by the old figures, this
    simulation ran 9-10 speculative rounds of ~100 ms first); and back when the batch is one session again."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0, probe_share=0.05), random.Random(5)  # (as above)
    ks = _batch_rounds(c, 120, 0.9, light, rng, sessions=1)
    assert c.k >= 3, ks[-20:]
    ks = _batch_rounds(c, 40, 0.9, heavy, rng, sessions=16)
    assert ks.index(0) <= 4 and c.k == 0, ks
    assert sum(1 for k in ks[:12] if k) <= 5, ks
    ks = _batch_rounds(c, 40, 0.9, light, rng, sessions=1)
    first = next(i for i, k in enumerate(ks) if k)
    assert first <= 4 and c.k >= 3, ks


def _waves(b):
    """Costs at a batch of b sessions (the H200's shape of them): a plain step grows slowly with the batch, a
    speculative round with its b (K + 1) verify rows."""
    return lambda k: 4e-3 + 1e-4 * b if k == 0 else 10e-3 + 5e-4 * b * (k + 1) + 1e-3 * k


def test_a_growing_batch_does_not_reprobe_speculation_that_lost_at_a_smaller_one():
    """Sessions land in waves (11, 22, then 33 of them): speculation lost to plain rounds at 11, and each
    larger batch makes it lose more, so the batch outgrowing its figure (> 2x) is not a reason to probe it
    at once (a K = 4 round there costs ~9 plain steps); a batch that shrinks below where it lost is."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(11)
    assert 4.1 / _waves(11)(4) < 1 / _waves(11)(0)  # the model: at 11 sessions plain rounds win
    _batch_rounds(c, 30, 0.9, _waves(11), rng, sessions=11)
    assert c.k == 0
    _batch_rounds(c, 20, 0.9, _waves(22), rng, sessions=22)
    ks = _batch_rounds(c, 150, 0.9, _waves(33), rng, sessions=33)
    assert sum(1 for k in ks[:30] if k) == 0, ks[:30]  # no probe because the batch outgrew the figure
    spent = sum(_waves(33)(k) for k in ks)
    assert sum(_waves(33)(k) for k in ks if k) <= 0.06 * spent, ks  # later ones only as dear probes
    ks = _batch_rounds(c, 40, 0.9, light, rng, sessions=1)  # fewer sessions than where it lost: it wins
    first = next(i for i, k in enumerate(ks) if k)
    assert first <= 2 and c.k > 0, ks


@pytest.mark.parametrize("named", [False, True])
def test_a_wave_joining_a_batch_that_speculates_starts_plain(named):
    """The H200's 32-stream point after its warm-up (2026-12-03): speculation lost at 11 sessions, won again
    at 1 (the 1-stream point), then sessions joined in waves of 4, 12 and 33. Told each round's batch before
    it runs, the controller drops to K = 0 before the first round past 11 sessions, where it lost: no
    speculative round of the whole wave (a K = 4 round of 33 costs ~9 plain steps). Told only after (the
    batch of the last round observed), it runs such rounds first."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(12)
    _batch_rounds(c, 30, 0.9, _waves(11), rng, sessions=11, named=named)
    assert c.k == 0
    _batch_rounds(c, 60, 0.9, light, rng, sessions=1, named=named)
    assert c.k > 0  # speculation wins alone: the batch where it lost is kept
    _batch_rounds(c, 3, 0.9, light, rng, sessions=4, named=named)
    ks = _batch_rounds(c, 12, 0.9, _waves(12), rng, sessions=12, named=named)
    ks += _batch_rounds(c, 60, 0.9, _waves(33), rng, sessions=33, named=named)
    if named:
        assert sum(1 for k in ks[:40] if k) == 0, ks[:40]
        assert c.k == 0
    else:
        assert ks[0] > 0, ks[:5]  # the old way: the wave's first round speculates


def test_speculation_winning_where_it_lost_clears_the_mark():
    """The batch where speculation lost is forgotten only when it wins at as many sessions or more (the
    acceptance rose): the batch may grow again without a forced fall to K = 0."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0, probe_share=0.05), random.Random(13)  # (as above)
    _batch_rounds(c, 30, 0.9, _waves(11), rng, sessions=11, named=True)
    assert c.k == 0
    ks = _batch_rounds(c, 400, 0.9, light, rng, sessions=11, named=True)  # cheaper speculation at 11
    assert c.k > 0 and ks[-20:].count(0) <= 2, ks[-20:]
    ks = _batch_rounds(c, 5, 0.9, light, rng, sessions=16, named=True)
    assert all(ks), ks


def test_first_drafts_judged_at_k0_keep_the_acceptance_current():
    """At K = 0 no round drafts, so nothing updated the acceptance: after an unlucky start it stayed low
    and speculation came back only through a dear probe. observe_drafts (plain rounds' flush: the MTP
    head's own picks judged against the verified tokens) feeds it: the estimate follows, and with it the
    switch probe's plausibility."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(3)
    _batch_rounds(c, 60, 0.0, light, rng, sessions=1)  # nothing accepted: plain rounds win
    assert c.k == 0 and c.acceptance < 0.2
    before = c.acceptance
    for _ in range(10):
        c.observe_drafts(9, 1)  # a flush of 10 pairs: 9 of the head's picks were the next token
    assert c.acceptance > 0.8 > before
    with pytest.raises(ValueError):
        c.observe_drafts(-1, 0)
    ks = _batch_rounds(c, 20, 0.9, light, rng, sessions=1)
    assert any(ks[:4]) and c.k > 0, ks  # speculation is probed and kept at once


def test_a_large_flush_weighs_a_bounded_number_of_rounds():
    """A flush of a large batch judges hundreds of first drafts at once: it weighs at most JUDGED_WEIGHT
    rounds, so the rounds after it still move the estimate."""
    c = DraftLength(prior_k=2, k_max=8, k_min=0)
    c.observe_drafts(900, 100)
    assert c.acceptance > 0.8
    for _ in range(20):
        c.observe_round(2, [0], 0.0, 1.0)  # nothing accepted any more
    assert c.acceptance < 0.5, c.acceptance


def test_plain_rounds_slowed_for_a_moment_do_not_switch_to_speculation_on_an_old_figure():
    """At K = 0 under a heavy batch, a prefill pass beside the steps slows a few plain rounds 3x. Their price
    is a median of the last rounds (not an average a few slow rounds move), and a speculative K may be
    switched to only on a figure of its own measured within probe_every rounds at about this batch or more:
    no speculative round runs for a moment's load, and the dear probes stay within their share."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(21)
    cost = _waves(20)
    _batch_rounds(c, 40, 0.9, cost, rng, sessions=20, named=True)
    assert c.k == 0
    ks = []
    for r in range(600):
        slow = 3.0 if r % 40 < 4 else 1.0  # every 40 rounds, 4 plain rounds beside a prefill pass
        ks += _batch_rounds(c, 1, 0.9, lambda k, s=slow: cost(k) * (s if k == 0 else 1.0), rng, sessions=20, named=True)
    spec = [i for i, k in enumerate(ks) if k]
    assert len(spec) <= 3, spec
    spent = sum(cost(k) for k in ks)
    assert sum(cost(k) for k in ks if k) <= 0.02 * spent, spec


def test_a_switch_probe_that_loses_marks_its_batch_so_the_next_wave_runs_plain():
    """A closed loop's waves (stop 52's H100 at 32 streams: 15 speculative rounds of 58-131 ms beside 915 plain
    ones): speculation lost at 32; a wave ends and the batch drops to 12, where the switch probe tries K = 4
    at once (its figure from 32 prices nothing there) and loses again; the batch falls to 2, where speculation
    wins; then the next wave joins, 20 sessions. The probe's loss at 12 marks 12 as where speculation lost,
    so the wave's first round is plain, and so are its others (a dear probe at most). Before, only a switch
    from K > 0 to 0 marked a batch: the wave's batch was below the mark (32), and it probed K = 8 twice."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(21)
    _batch_rounds(c, 30, 0.9, _waves(32), rng, sessions=32, named=True)
    assert c.k == 0
    ks = _batch_rounds(c, 1, 0.9, _waves(12), rng, sessions=12, named=True)
    assert ks == [4] and c.k == 0  # the switch probe at the smaller batch, lost
    assert 4.1 / _waves(12)(4) < 1 / _waves(12)(0)  # (the model: plain rounds win at 12)
    _batch_rounds(c, 40, 0.9, light, rng, sessions=2, named=True)
    assert c.k > 0  # speculation wins at 2
    ks = _batch_rounds(c, 60, 0.9, _waves(20), rng, sessions=20, named=True)
    assert ks[0] == 0 and sum(1 for k in ks if k) <= 1, ks


def test_a_probe_that_only_just_loses_marks_nothing():
    """A switch probe at a near tie (K = 1 at 2 sessions, 2% under plain rounds' rate) is no sign that
    speculation lost at that batch: a K = 8 round there wins. Marking 2 would have the next win
    at 2 clear every mark (the one from 6 sessions too), and a wave growing past 6 would speculate again."""
    c = DraftLength(prior_k=4, k_max=8, k_min=0)
    for _ in range(20):  # speculation lost at 6 sessions (a K = 4 round of 6 ~ 30 ms, a plain one ~7.5)
        k = c.next_k(batch=6)
        c.observe_round(k, [min(k, 3)] * 6, 0.0, 7.5e-3 if k == 0 else 10e-3 + 4e-3 * k)
    assert c.k == 0 and c._lost_at == 6
    c._spec_k = 1
    for _ in range(3):  # plain rounds at 2 sessions, then the switch probe: K = 1 only just loses
        c.observe_round(0, [0, 0], 0.0, 7.2e-3)
    a = c.acceptance
    c.observe_round(1, [1, 1], 0.0, expected_tokens(1, a) * 7.2e-3 * 1.02)  # 2% under plain rounds' rate
    assert abs(c.acceptance - a) < 0.02 and c.rate(1) < c.rate(0) < 1.03 * c.rate(1)
    assert c.k == 0 and c._lost_at == 6  # not 2
    c.observe_round(1, [0, 0], 0.0, expected_tokens(1, c.acceptance) * 7.2e-3 * 1.5)  # a clear loss marks 2
    assert c.k == 0 and c._lost_at == 2


def test_the_speculative_rounds_are_logged_with_their_batch_cost_and_whether_a_probe_asked():
    """DraftLength.spec_log (WorkerStats.mtp_spec_rounds): every round with K > 0 and only those, in order,
    each with its round number, K, batch, seconds and whether next_k returned it as a probe; the prior's K is
    settled, not a probe, and once plain rounds have won, the speculative rounds are the switch's probes."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(7)

    def dear(k):  # plain rounds win at p = 0.5 (1.5 tokens / 26 ms at K = 1), yet a probe is due now and then
        return 7e-3 if k == 0 else 20e-3 + 6e-3 * k

    ks = _batch_rounds(c, 1000, 0.5, dear, rng, named=True)
    log = list(c.spec_log)
    assert [n for n, *_ in log] == [i + 1 for i, k in enumerate(ks) if k]  # round numbers count every round
    assert [k for _, k, *_ in log] == [k for k in ks if k] and all(b == 16 for _, _, b, _, _ in log)
    assert all(0.95 * dear(k) <= secs <= 1.05 * dear(k) for _, k, _, secs, _ in log)
    assert log[0][1:3] == (4, 16) and not log[0][4]  # the prior's K, settled
    settled = max(i for i in range(20) if ks[i])  # the last speculative round of the start: K settles at 0
    later = [e for e in log if e[0] > settled + 1]
    assert len(later) >= 2 and all(probe for *_, probe in later), log
    assert sum(n for n, _ in c.by_k.values()) == 1000


def test_a_wave_joining_a_batch_that_speculates_reenters_from_k2():
    """The 2-core VM's 16-stream point (2026-12-07, spec-log-cpu-mtp16): K climbed to 8 while one or two
    sessions ran, then a wave of 16 joined and ran two K = 8 rounds at ~13x a plain round's cost. Told the
    batch before each round, the controller now drops the settled K and probes K = 2 first (a cheaper round
    that still wins where speculation pays), and no K > 2 with all of them; where speculation pays at the new
    batch it climbs back."""
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(14)
    _batch_rounds(c, 60, 0.9, light, rng, sessions=2, named=True)
    assert c.k >= 4  # speculation wins with two sessions
    ks = _batch_rounds(c, 60, 0.9, heavy, rng, sessions=16, named=True)
    assert ks[0] == 2 and 0 in ks[1:4], ks[:6]  # the K = 2 probe, then plain rounds
    assert max(ks) <= 2 and c.k == 0, ks
    c, rng = DraftLength(prior_k=4, k_max=8, k_min=0), random.Random(15)
    _batch_rounds(c, 60, 0.9, light, rng, sessions=2, named=True)
    ks = _batch_rounds(c, 200, 0.9, light, rng, sessions=16, named=True)  # speculation still pays at 16
    assert ks[0] == 2 and c.k >= 3 and ks[-40:].count(0) <= 4, ks
