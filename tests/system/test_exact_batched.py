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


def _run(c, i, engine, mode="exact", **kw):
    """-> (the tokens of prompt i, the last delta: its stats)."""
    out, last = [], None
    for d in c.generate(
        token_ids=_prompt(i), max_new_tokens=NEW, mode=mode, engine=engine, ignore_eos=True, timeout=120, **kw
    ):
        out += d.token_ids
        last = d
    return out, last


def _gen(c, i, engine, mode="exact", **kw):
    return _run(c, i, engine, mode, **kw)[0]


@pytest.mark.parametrize("engine", ["fp8", "bf16", "mtp"])
def test_concurrent_exact_sessions_equal_the_exact_engine_and_batch(cluster, engine):
    c, ps, ds, ref = cluster
    want = [ref.generate(_prompt(i), NEW) for i in range(N)]
    v0, d0 = ps.engine.verifies.max_items, ds.engine.drafts.max_items
    rpcs0 = [(s.batched_rpcs, s.batched_items) for s in (ps, ds)]
    with ThreadPoolExecutor(N) as ex:
        got = list(ex.map(lambda i: _gen(c, i, engine), range(N)))
    assert got == want
    for s, (r0, i0) in zip((ps, ds), rpcs0):  # the router sent the rounds' calls as VerifyMany / DraftMany
        rpcs, items = s.batched_rpcs - r0, s.batched_items - i0
        assert rpcs > 0 and items > rpcs, (type(s).__name__, rpcs, items)
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


@pytest.fixture
def loads(monkeypatch):
    """The decode worker's LoadStates: loads(n) -> [(bytes, draft_only)] of the session whose first load was
    at position n (its prompt's length: each _prompt's is its own), one a load, in order; loads.clear()."""
    import decode_worker.service as svc

    by_session, real = {}, svc.receive_state

    def spy(*a, **k):
        state = real(*a, **k)
        by_session.setdefault(state.session_id, []).append((state.position, state.stats.total_bytes, state.draft_only))
        return state

    def of(n: int) -> list:
        return [(b, d) for got in by_session.values() if got[0][0] == n for _, b, d in got]

    monkeypatch.setattr(svc, "receive_state", spy)
    of.clear = by_session.clear
    return of


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-penalized"])
def test_draft_only_handoffs_load_a_fraction_of_the_state_and_change_no_token(cluster, monkeypatch, loads, sampled):
    """Exact mode, mtp drafts relaying verdict hidden rows: each session's hand-off is draft-only (the
    prompt's hidden row and MTP KV rows; Stats.draft_only_handoffs), so the decode worker loads a small
    fraction of the whole state's bytes for the same prompt, and 8 concurrent sessions' tokens equal the
    exact engine's, greedy and seeded with a penalty. BATON_SLIM_HANDOFF=0 (the A/B knob) hands off the whole
    state, with the same tokens."""
    from baton.engine.sampling import Params

    c, _, _, ref = cluster
    kw = dict(temperature=0.8, seed=12, repetition_penalty=1.3) if sampled else {}
    want = [ref.generate(_prompt(i), NEW, sampling=Params(**kw) if sampled else None) for i in range(N)]
    cfg = ref.runner.cfg
    row = cfg.num_key_value_heads * cfg.head_dim * 4  # one position's MTP key (or value) row, fp32
    seen = {}
    for slim in ("1", "0"):
        monkeypatch.setenv("BATON_SLIM_HANDOFF", slim)
        loads.clear()
        with ThreadPoolExecutor(N) as ex:
            got = list(ex.map(lambda i: _run(c, i, "mtp", **kw), range(N)))
        assert [toks for toks, _ in got] == want
        for i, (_, last) in enumerate(got):
            n, st = len(_prompt(i)), last.stats
            assert (st["handoffs"], st["draft_only_handoffs"], st["migrations"]) == (1, int(slim == "1"), 0)
            assert loads(n) == [(st["bridge_bytes"], slim == "1")], i  # what the decode worker loaded
            seen[slim, i] = st["bridge_bytes"]
    for i in range(N):
        n = len(_prompt(i))
        assert seen["1", i] == cfg.hidden_size * 4 + 2 * n * row  # the hidden row and the MTP KV rows alone
        assert seen["1", i] * 4 < seen["0", i], (i, seen["1", i], seen["0", i])


def test_a_verdict_without_hidden_rows_for_a_draft_only_session_reexports_the_whole_state(cluster, monkeypatch, loads):
    """An exact worker that sends no hidden rows (an older one) behind a router that asked for draft-only
    hand-offs: a session's first verdict comes back without them, which its decode worker, holding the
    hidden row and MTP KV alone, cannot apply. The router hands the whole exact state to it again
    (ExportState) and the session drafts on from there, running its verdict rows itself: the tokens equal
    the exact engine's, with one draft-only and one whole hand-off a request and no migration."""
    import types

    monkeypatch.setattr("prefill_worker.verify_calls.hidden_rows", types.SimpleNamespace(encode=lambda h: None))
    c, _, _, ref = cluster
    want = [ref.generate(_prompt(i), NEW) for i in range(3)]
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda i: _run(c, i, "mtp"), range(3)))
    assert [toks for toks, _ in got] == want
    for i, (_, last) in enumerate(got):
        st, n = last.stats, len(_prompt(i))
        assert (st["handoffs"], st["draft_only_handoffs"], st["migrations"]) == (2, 1, 0), st
        (slim, marked), (whole, unmarked) = loads(n)
        assert marked and not unmarked and slim * 4 < whole
        assert st["bridge_bytes"] == slim + whole
