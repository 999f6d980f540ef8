"""Exact mode for many sessions at once, over real loopback gRPC (router, prefill worker, decode worker
in this process, a tiny random model with an MTP head): 8 concurrent exact requests with fp8, bf16 and
mtp drafts, and 8 concurrent fast mtp requests,
each give exactly the exact engine's own AR tokens (`baton complete`), while the prefill worker verifies
several sessions' blocks in one pass and the decode worker drafts for several sessions in one step."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import make_tiny_dir, wait_serving

from baton.client import Client
from baton.settings import Settings

N, NEW, MAX_LEN = 8, 24, 160
# router, prefill and decode workers on threads of this process: tiny ops on 2 cores, one torch thread
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from baton.engine.runner import ModelRunner
    from baton.loading import load_model
    from decode_worker.serve import serve_decode
    from prefill_worker.engine import ExactEngine
    from prefill_worker.serve import serve_prefill
    from router.__main__ import serve_router, stop_router

    d = make_tiny_dir(tmp_path_factory.mktemp("exb"), seed=6, layers=4, hidden=64, vocab=400)
    lm = load_model(d, dtype="fp32", mtp=True)
    st = Settings()
    ph, ps = serve_prefill(lm, max_len=MAX_LEN, slots=N, settings=st)
    dh, ds = serve_decode(
        lm, engines=("bf16", "fp8", "mtp"), max_len=MAX_LEN, slots=N, settings=st, default_engine="fp8"
    )
    rh, rs = serve_router(prefill=[ph.address], decode=[dh.address], settings=st)
    c = Client(rh.address)
    wait_serving(c)
    ref = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))
    assert hasattr(lm.model, "mtp")
    yield c, ps, ds, ref
    c.close()
    stop_router(rh, rs, 0)
    ph.stop(0)
    dh.stop(0)


def _prompt(i):
    return [(31 * i + 7 * j) % 390 + 5 for j in range(4 + 2 * i)]


def _gen(c, i, engine, mode="exact", **kw):
    out = []
    for d in c.generate(
        token_ids=_prompt(i), max_new_tokens=NEW, mode=mode, engine=engine, ignore_eos=True, timeout=120, **kw
    ):
        out += d.token_ids
    return out


@pytest.mark.parametrize("engine", ["fp8", "bf16", "mtp"])
def test_concurrent_exact_sessions_equal_the_exact_engine_and_batch(cluster, engine):
    c, ps, ds, ref = cluster
    want = [ref.generate(_prompt(i), NEW) for i in range(N)]
    v0, d0 = ps.engine.verifies.max_items, ds.engine.drafts.max_items
    with ThreadPoolExecutor(N) as ex:
        got = list(ex.map(lambda i: _gen(c, i, engine), range(N)))
    assert got == want
    assert ps.engine.verifies.max_items > 1 or v0 > 1  # verify blocks of several sessions in one pass
    assert ds.engine.drafts.max_items > 1 or d0 > 1  # drafts of several sessions in one step


def test_concurrent_fast_mtp_sessions_verify_together_and_equal_bf16(cluster):
    """Fast mode, engine mtp: each session's MTP chain, then one verify pass for every session's block
    (decode_worker/mtp.py rounds); the output equals the exact AR tokens (mtp == bf16 == exact)."""
    c, ps, ds, ref = cluster
    want = [ref.generate(_prompt(i), NEW) for i in range(N)]
    r0 = ds.engine.mtp_round_max
    with ThreadPoolExecutor(N) as ex:
        got = list(ex.map(lambda i: _gen(c, i, "mtp", mode="fast"), range(N)))
    assert got == want
    assert max(r0, ds.engine.mtp_round_max) > 1  # rounds of several sessions (the rounds scheduler)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-penalized"])
def test_verdict_hidden_rows_replace_the_decode_workers_rows_and_change_no_draft(cluster, monkeypatch, sampled):
    """Exact mode, mtp drafts: each Verify returns the kept rows' hidden rows and the next Draft relays them
    (router/exact.py, decode_worker/drafting.py), so the decode worker runs no rows pass for its verdicts.
    The tokens equal the exact engine's, concurrent sessions too, and every draft is bitwise the one the
    decode worker gives running the rows itself (BATON_VERDICT_HIDDEN=0), with seeded sampling and a
    repetition penalty as well (the drafts then read the position and token history that the skipped pass
    no longer advances)."""
    from baton.engine.sampling import Params
    from decode_worker import drafting

    c, _, _, ref = cluster
    kw = dict(temperature=0.8, seed=11, repetition_penalty=1.3) if sampled else {}
    want = [ref.generate(_prompt(i), NEW, sampling=Params(**kw) if sampled else None) for i in range(N)]
    passes, drafts = [], []
    real_rows, real_batch = drafting.rows_batch, drafting.draft_batch
    monkeypatch.setattr(drafting, "rows_batch", lambda *a, **k: passes.append(1) or real_rows(*a, **k))
    monkeypatch.setattr(drafting, "draft_batch", lambda *a: drafts.append(real_batch(*a)) or drafts[-1])
    seen = {}
    for hidden in ("1", "0"):
        monkeypatch.setenv("BATON_VERDICT_HIDDEN", hidden)
        passes.clear()
        with ThreadPoolExecutor(N) as ex:
            got = list(ex.map(lambda i: _gen(c, i, "mtp", **kw), range(N)))
        assert got == want
        assert (len(passes) == 0) == (hidden == "1"), len(passes)  # no verdict rows run with the hidden rows
        drafts.clear()  # one session at a time: its Draft calls in a fixed order, to compare every draft
        assert [_gen(c, i, "mtp", **kw) for i in range(3)] == want[:3]
        seen[hidden] = list(drafts)
    assert seen["1"] == seen["0"]
    assert len({d for batch in seen["1"] for got in batch for d in got}) > 3  # drafts of varied tokens
