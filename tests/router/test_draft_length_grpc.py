"""Adaptive draft length over real loopback gRPC: a router (draft_length = adaptive), a prefill worker and a
decode worker (bf16, fp8, mtp) in this process on the embedded default model. K changes only speed:
exact mode with the controller moving K from round to round gives exactly `baton complete`'s tokens
(greedy, and seeded T > 0 against the exact engine's seeded decode); the fixed policy sends the request's
K every round."""

from __future__ import annotations

import functools

import pytest
from helpers import wait_serving

import router.exact
from baton.client import Client
from baton.complete import complete
from baton.engine.draft_length import DraftLength, FixedLength
from baton.engine.sampling import Params
from baton.settings import Settings
from router.service import RouterConfig

MAX_LEN, NEW = 256, 40
# router, prefill and decode workers on threads of this process: tiny ops on 2 cores, one torch thread
pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[5, 6, 7, 8], [101, 17, 3], [42] * 9]


@pytest.fixture(scope="module")
def lm():
    from baton.loading import load_model

    return load_model(None, dtype="fp32", device="cpu", mtp=True)


@pytest.fixture(scope="module")
def want(lm):
    """`baton complete`'s greedy tokens for a prompt, computed once per (prompt, n): deterministic, and the
    engine parametrizations ask for the same references."""

    @functools.cache
    def ref(ids, n):
        return tuple(complete(None, list(ids), n, loaded=lm, max_len=MAX_LEN, ignore_eos=True))

    return lambda ids, n=NEW: list(ref(tuple(ids), n))


def _cluster(lm, policy):
    from decode_worker.serve import serve_decode
    from prefill_worker.serve import serve_prefill
    from router.__main__ import serve_router, stop_router

    st = Settings()
    ph, ps = serve_prefill(lm, max_len=MAX_LEN, settings=st)
    dh, _ = serve_decode(lm, engines=("bf16", "fp8", "mtp"), max_len=MAX_LEN, settings=st, default_engine="fp8")
    rh, rs = serve_router(
        prefill=[ph.address], decode=[dh.address], settings=st, config=RouterConfig(draft_length=policy)
    )
    c = Client(rh.address)
    wait_serving(c)

    def close():
        c.close()
        stop_router(rh, rs, 0)
        ph.stop(0)
        dh.stop(0)

    return c, ps, close


@pytest.fixture(scope="module")
def adaptive(lm):
    c, ps, close = _cluster(lm, "adaptive")
    yield c, ps
    close()


@pytest.fixture
def spy(monkeypatch):
    """Every exact session's controller, made restless (a probe every 2nd round, no patience) so that K
    moves within a short request; records the K of every round."""
    made = []

    class Restless(DraftLength):
        def __init__(self, **kw):
            super().__init__(**kw, probe_every=2, patience=1, margin=0.0)
            self.ks = []

        def observe(self, k, accepted, draft_s, verify_s):
            self.ks.append(k)
            return super().observe(k, accepted, draft_s, verify_s)

    class Fixed(FixedLength):
        def __init__(self, k):
            super().__init__(k)
            self.ks = []

        def observe(self, k, accepted, draft_s, verify_s):
            self.ks.append(k)
            return super().observe(k, accepted, draft_s, verify_s)

    def make(policy, k, k_max):
        ctl = Restless(prior_k=k, k_max=max(k_max, k)) if policy == "adaptive" else Fixed(k)
        made.append(ctl)
        return ctl

    monkeypatch.setattr(router.exact, "controller", make)
    return made


def _gen(c, ids, n=NEW, **kw):
    out, last = [], None
    for d in c.generate(token_ids=ids, max_new_tokens=n, mode="exact", ignore_eos=True, timeout=120, **kw):
        out += d.token_ids
        last = d
    return out, last


@pytest.mark.parametrize("engine", ["fp8", "mtp"])
def test_adaptive_k_exact_mode_equals_baton_complete(want, adaptive, spy, engine):
    c, _ = adaptive
    for ids in PROMPTS:
        ref = want(ids)
        got, last = _gen(c, ids, engine=engine, draft_block=3)
        assert got == ref, (engine, ids)
        ks = spy[-1].ks
        assert len(set(ks)) > 1, ks  # K really moved during the request
        assert last.stats["drafted"] == sum(ks)
        assert 0 < last.stats["accepted"] <= last.stats["drafted"]


def test_adaptive_k_seeded_sampling_equals_the_exact_engines_seeded_decode(lm, adaptive, spy):
    from baton.engine.runner import ModelRunner
    from prefill_worker.engine import ExactEngine

    c, _ = adaptive
    ref = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))
    for seed in (3, 4):
        want = ref.generate(PROMPTS[0], 24, sampling=Params(temperature=0.8, seed=seed))
        got, _ = _gen(c, PROMPTS[0], 24, engine="mtp", temperature=0.8, seed=seed)
        assert got == want, seed
        assert len(set(spy[-1].ks)) > 1


def test_rejection_policy_sessions_keep_the_requests_k(adaptive, spy):
    c, _ = adaptive
    _gen(c, PROMPTS[1], 12, engine="fp8", temperature=0.8, seed=5, exact_policy="rejection", draft_block=3)
    assert isinstance(spy[-1], FixedLength) and set(spy[-1].ks[:-1]) == {3}


def test_the_fixed_policy_sends_the_requests_k_every_round(lm, spy):
    c, _, close = _cluster(lm, "fixed")
    try:
        got, last = _gen(c, PROMPTS[2], 30, engine="fp8", draft_block=5)
        assert got == complete(None, PROMPTS[2], 30, loaded=lm, max_len=MAX_LEN, ignore_eos=True)
        ks = spy[-1].ks
        assert ks[:-1] == [5] * (len(ks) - 1) and 1 <= ks[-1] <= 5  # the last block is cut to the budget
        assert last.stats["drafted"] == sum(ks)
    finally:
        close()
