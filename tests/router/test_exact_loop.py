"""router.exact.ExactLoop: the draft/verify loop of exact mode, against loopback fake workers
(tests/fakes.py via the `fake_pool` fixture). The decode fake drafts with a controlled acceptance:
in round r its first plan[r] drafts are the exact tokens and the next one is wrong, so the exact fake
accepts exactly min(plan[r], k) of them. Only verified tokens may come out: drafts[:m] + [next]."""

from __future__ import annotations

import time

import fakes
import grpc
import pytest
from fakes import EOS, SAY_EOS, exact_next, reference

from baton.rpc import StatusError
from baton.v1 import common_pb2, decode_pb2, prefill_pb2
from router import exact
from router.exact import ExactLoop
from router.session import Budget, RunStats, start_session

C = grpc.StatusCode
IDS = [5, 6, 7]


def _wrong(t: int) -> int:
    return t % 97 + 1


class Controlled(fakes.FakeDecode):
    """Draft: the first plan[r] drafts of round r are exact, the rest wrong (all exact once the plan is
    spent). Records each round's drafts in `sent`."""

    def __init__(self, settings, plan=(), **kw):
        super().__init__(settings, **kw)
        self.plan, self.sent = list(plan), []

    def Draft(self, request, context):
        self._enter("Draft", request, context)
        s = self._session(request.session_id, context)
        if request.has_verdict:
            s["ctx"] += [s["pending"]] + s["drafts"][: request.accepted]
            s["pending"] = request.next_token
        good = self.plan.pop(0) if self.plan else request.k
        c, drafts = s["ctx"] + [s["pending"]], []
        for i in range(request.k):
            t = exact_next(c)
            drafts.append(t if i < good else _wrong(t))
            c.append(drafts[-1])
        s["drafts"] = drafts
        self.sent.append(drafts)
        return decode_pb2.DraftResponse(draft_tokens=drafts, position=len(s["ctx"]))


class OverAccepting(fakes.FakePrefill):
    """An exact worker with a bug: it accepts one more draft than it was sent."""

    def Verify(self, request, context):
        resp = super().Verify(request, context)
        return prefill_pb2.VerifyResponse(accepted=len(request.tokens), next_token=resp.next_token)


class ShortDrafts(Controlled):
    def Draft(self, request, context):
        resp = super().Draft(request, context)
        return decode_pb2.DraftResponse(draft_tokens=list(resp.draft_tokens)[:-1])


class LosesEverySession(Controlled):
    def Draft(self, request, context):
        self.calls.append(("Draft", request))
        context.abort(C.NOT_FOUND, f"session_id: unknown session {request.session_id!r}")


def _setup(pool, *, n=20, stop=(), ignore_eos=False, ids=IDS, k=4, engine=0, prefill=None, decodes=None, **loop_kw):
    """-> (loop, handoff, budget, stats, calls, prefill fake, [decode fakes]); the first token taken."""
    pf, _ = pool.add("prefill", prefill)
    dfs = [pool.add("decode", d)[0] for d in (decodes or [Controlled(pool.settings)])]
    calls = pool.calls(timeout=10.0, call_timeout=2.0)
    h = start_session(calls, ids, mode=common_pb2.EXACT, engine=engine, engine_name=None)
    assert h.decode.address == dfs[0].address  # the hand-off went to the first decode worker
    budget = Budget(n, stop, (EOS,), ignore_eos)
    stats = RunStats()
    assert budget.take([h.first_token]) == ([h.first_token], None)
    loop = ExactLoop(
        calls,
        h,
        budget,
        stats,
        k=k,
        engine=engine,
        engine_name=None,
        migrate_wait_s=loop_kw.pop("migrate_wait_s", 0.3),
        **loop_kw,
    )
    return loop, h, budget, stats, calls, pf, dfs


def _run(loop, h):
    batches = [(toks, finish) for toks, finish, _lps in loop.run(h.first_token)]
    return [h.first_token] + [t for toks, _ in batches for t in toks], batches


def _reqs(fake, method):
    return [r for m, r in fake.servicer.calls if m == method]


def test_workers_without_batched_rpcs_get_unary_calls(fake_pool):
    """These fakes are workers of an older build: their DraftMany / VerifyMany answer UNIMPLEMENTED. The
    router's first batched call to each falls back to unary Draft / Verify, and every later one goes unary
    at once (router/batcher.py); the tokens are the same."""
    loop, h, _budget, stats, _, pf, (df,) = _setup(fake_pool, n=20, k=4, decodes=[Controlled(fake_pool.settings)])
    out, batches = _run(loop, h)
    assert out == reference(IDS, 20)
    assert h.decode.batchers["Draft"].unsupported and h.prefill.batchers["Verify"].unsupported
    assert h.decode.batchers["Draft"].batches == h.prefill.batchers["Verify"].batches == 1  # only the first try
    assert len(_reqs(df, "Draft")) == len(_reqs(pf, "Verify")) == stats.rounds == len(batches)


@pytest.mark.parametrize("plan", [[0, 0, 0, 0], [4, 4, 4], [1, 3, 0, 2, 4, 1], [2] * 10])
def test_yields_exactly_the_verified_tokens(fake_pool, plan):
    K, N = 4, 20
    loop, h, _budget, stats, _, pf, (df,) = _setup(fake_pool, n=N, k=K, decodes=[Controlled(fake_pool.settings, plan)])
    out, batches = _run(loop, h)
    assert out == reference(IDS, N)
    drafts, verifies = df.servicer.sent, _reqs(pf, "Verify")
    assert len(batches) == len(drafts) == len(verifies)
    emitted, pending = 1, h.first_token
    for r, ((toks, finish), d, v) in enumerate(zip(batches, drafts, verifies)):
        m = min(plan[r], len(d)) if r < len(plan) else len(d)
        assert list(v.tokens) == [pending, *d]  # Verify gets [pending, d1..dk]
        block = d[:m] + [reference(IDS, emitted + m + 1)[-1]]  # drafts[:m] + [next]
        assert toks == block[: N - emitted]
        assert finish == (common_pb2.LENGTH if emitted + len(toks) == N else None)
        emitted += len(toks)
        pending = block[-1]
    assert emitted == N and batches[-1][1] == common_pb2.LENGTH
    assert stats.drafted == sum(len(d) for d in drafts)
    assert stats.accepted == sum(min(plan[r], len(d)) if r < len(plan) else len(d) for r, d in enumerate(drafts))


def test_each_draft_carries_the_previous_verdict(fake_pool):
    loop, h, _, _, _, _pf, (df,) = _setup(fake_pool, n=15, decodes=[Controlled(fake_pool.settings, [1, 0, 3, 4])])
    _run(loop, h)
    drafts = _reqs(df, "Draft")
    assert drafts[0].has_verdict is False
    ctx = list(IDS) + [h.first_token]
    for req, sent in zip(drafts[1:], df.servicer.sent):  # Draft r + 1 carries round r's verdict
        m = 0
        while m < len(sent) and sent[m] == exact_next(ctx + sent[:m]):
            m += 1
        nxt = exact_next(ctx + sent[:m])
        assert req.has_verdict and (req.accepted, req.next_token) == (m, nxt)
        ctx += sent[:m] + [nxt]
    assert [m for m in (1, 0, 3, 4)] == [r.accepted for r in drafts[1:5]]


@pytest.mark.parametrize("K, N", [(4, 20), (14, 9), (14, 4), (3, 2), (1, 6)])
def test_k_never_exceeds_remaining_minus_one(fake_pool, K, N):
    loop, h, _, _, _, _, (df,) = _setup(fake_pool, n=N, k=K)  # every draft accepted: blocks of k + 1
    out, batches = _run(loop, h)
    assert out == reference(IDS, N)
    emitted = 1
    for (toks, _), req in zip(batches, _reqs(df, "Draft")):
        remaining = N - emitted
        assert req.k == max(1, min(K, remaining - 1))
        assert len(toks) == min(req.k + 1, remaining)  # a block overshoots only when 1 token is left
        emitted += len(toks)
    assert emitted == N


def test_stops_at_a_stop_id_inclusive(fake_pool):
    ref = reference(IDS, 30)
    stop = ref[11]
    want = ref[: ref.index(stop) + 1]
    loop, h, _, _, _, pf, (df,) = _setup(
        fake_pool, n=30, stop=[stop], decodes=[Controlled(fake_pool.settings, [2, 0, 4, 1, 3] * 4)]
    )
    out, batches = _run(loop, h)
    assert out == want and batches[-1][1] == common_pb2.STOP
    assert all(f is None for _, f in batches[:-1])
    assert len(_reqs(df, "Draft")) == len(_reqs(pf, "Verify")) == len(batches)  # nothing after the stop


def test_stops_at_eos_unless_ignored(fake_pool):
    ids = [SAY_EOS, 3, 4]
    ref = reference(ids, 30)
    assert EOS in ref
    loop, h, _, _, _, _, _ = _setup(fake_pool, n=30, ids=ids, decodes=[Controlled(fake_pool.settings, [1, 2, 0])])
    out, batches = _run(loop, h)
    assert out == ref and out[-1] == EOS and batches[-1][1] == common_pb2.EOS


def test_ignore_eos_runs_to_max_tokens(fake_pool):
    ids = [SAY_EOS, 3, 4]
    loop, h, _, _, _, _, _ = _setup(
        fake_pool, n=25, ids=ids, ignore_eos=True, decodes=[Controlled(fake_pool.settings, [1, 2, 0])]
    )
    out, batches = _run(loop, h)
    assert out == reference(ids, 25, eos=False) and EOS in out[:-1] and batches[-1][1] == common_pb2.LENGTH


def test_migrates_when_the_decode_worker_dies(fake_pool):
    d1 = Controlled(fake_pool.settings, [1, 4, 0, 2, 3, 1, 0, 4])
    d2 = Controlled(fake_pool.settings, [3, 0, 1])
    bridges, migrated = [], []
    loop, h, _, stats, _, pf, (f1, f2) = _setup(
        fake_pool,
        n=30,
        engine=common_pb2.FP8,
        decodes=[d1, d2],
        on_bridge=bridges.append,
        on_migrate=lambda: migrated.append(1),
    )
    d1.die_on["Draft"] = 3  # the third Draft: the worker dies mid-call
    out, _ = _run(loop, h)
    assert out == reference(IDS, 30)  # the output is unchanged by the migration
    # run() lands the first hand-off (bridges[0]), then the migration's ExportState (bridges[1])
    assert stats.migrations == 1 and migrated == [1] and len(bridges) == 2 and bridges[1].total_bytes > 0
    (exp,) = _reqs(pf, "ExportState")
    assert exp.decode_target == f2.address and exp.session_id == exp.target_session_id == h.session_id
    d2_drafts = _reqs(f2, "Draft")
    assert d2_drafts and d2_drafts[0].has_verdict is False
    assert all(r.engine == common_pb2.FP8 for r in _reqs(f1, "Draft"))
    assert all(r.engine == common_pb2.ENGINE_UNSPECIFIED for r in d2_drafts)  # "as loaded" after it
    assert loop.decode.address == f2.address and stats.bridge_bytes == sum(b.total_bytes for b in bridges)
    assert stats.decode == f2.address  # the request's log line names the decode worker that finished it


def test_a_decode_worker_that_lost_the_session_may_take_it_back(fake_pool):
    d = Controlled(fake_pool.settings, [2, 1, 0, 3])
    loop, h, _, stats, _, pf, (f,) = _setup(fake_pool, n=20, decodes=[d])
    d.fail["Draft"] = (C.NOT_FOUND, "session_id: unknown session")  # its next Draft
    out, _ = _run(loop, h)
    assert out == reference(IDS, 20) and stats.migrations == 1
    (exp,) = _reqs(pf, "ExportState")
    assert exp.decode_target == f.address  # the only decode worker, and it is not dead


def test_a_failed_migration_target_is_skipped(fake_pool):
    d1 = Controlled(fake_pool.settings, [2, 2])
    loop, h, _, stats, _, pf, (_f1, f2, f3) = _setup(
        fake_pool, n=20, decodes=[d1, Controlled(fake_pool.settings), Controlled(fake_pool.settings)]
    )
    f2.stop()  # still "up" in the registry: ExportState to it fails
    d1.die_on["Draft"] = 2
    out, _ = _run(loop, h)
    assert out == reference(IDS, 20) and stats.migrations == 1
    assert [r.decode_target for r in _reqs(pf, "ExportState")] == [f2.address, f3.address]
    assert loop.decode.address == f3.address


def test_no_decode_worker_to_migrate_to_is_unavailable(fake_pool):
    d = Controlled(fake_pool.settings, [1, 1])
    loop, h, _, _, _, _, _ = _setup(fake_pool, n=20, decodes=[d])
    d.die_on["Draft"] = 2
    got = []
    with pytest.raises(StatusError) as ei:
        for toks, _, _ in loop.run(h.first_token):
            got += toks
    assert ei.value.code == C.UNAVAILABLE and "cannot migrate" in ei.value.message
    assert [h.first_token] + got == reference(IDS, 1 + len(got))  # what was sent was verified


def test_migrations_are_bounded(fake_pool):
    loop, h, _, stats, _, pf, _ = _setup(
        fake_pool, n=20, decodes=[LosesEverySession(fake_pool.settings)], max_migrations=2
    )
    with pytest.raises(StatusError) as ei:
        list(loop.run(h.first_token))
    assert ei.value.code == C.UNAVAILABLE and "failed 2 times" in ei.value.message
    assert stats.migrations == 2 and len(_reqs(pf, "ExportState")) == 2


def test_an_exact_worker_that_accepts_more_than_k_is_internal(fake_pool):
    loop, h, _, _, _, _, _ = _setup(fake_pool, n=20, prefill=OverAccepting(fake_pool.settings))
    with pytest.raises(StatusError) as ei:
        next(loop.run(h.first_token))
    assert ei.value.code == C.INTERNAL and "accepted 5 of 4" in ei.value.message


def test_a_decode_worker_returning_the_wrong_number_of_drafts_is_internal(fake_pool):
    loop, h, _, _, _, pf, _ = _setup(fake_pool, n=20, decodes=[ShortDrafts(fake_pool.settings)])
    with pytest.raises(StatusError) as ei:
        next(loop.run(h.first_token))
    assert ei.value.code == C.INTERNAL and "3 drafts for k=4" in ei.value.message
    assert _reqs(pf, "Verify") == []  # never verified, never sent


@pytest.mark.parametrize("how", ["fails", "dies"])
def test_an_exact_worker_lost_is_unavailable(fake_pool, how):
    loop, h, _, _, _, pf, (_df,) = _setup(fake_pool, n=20, decodes=[Controlled(fake_pool.settings, [1, 2, 3])])
    it = loop.run(h.first_token)
    first_block, _, _ = next(it)
    if how == "fails":
        pf.servicer.fail["Verify"] = C.UNAVAILABLE
    else:
        pf.stop()
    with pytest.raises(StatusError) as ei:
        next(it)
    assert ei.value.code == C.UNAVAILABLE and "exact worker lost the session" in ei.value.message
    assert _reqs(pf, "ExportState") == []  # no migration: the reference state is gone
    assert [h.first_token] + first_block == reference(IDS, 1 + len(first_block))


def test_a_migration_goes_to_a_worker_that_offers_the_kept_engine(fake_pool):
    """No engine in the request: the Prefill names D's default (mtp here) and the exact worker keeps it
    for ExportState, so the new decode worker must offer mtp; a bf16-only worker is passed over."""
    d1 = Controlled(fake_pool.settings, [1, 2, 0, 3], engines=("mtp", "bf16"))
    d2 = Controlled(fake_pool.settings, engines=("bf16",))
    d3 = Controlled(fake_pool.settings, engines=("mtp",))
    loop, h, _, stats, _, pf, (_f1, f2, f3) = _setup(fake_pool, n=20, decodes=[d1, d2, d3])
    assert h.engine == common_pb2.MTP
    d1.die_on["Draft"] = 2
    out, _ = _run(loop, h)
    assert out == reference(IDS, 20) and stats.migrations == 1
    (exp,) = _reqs(pf, "ExportState")
    assert exp.decode_target == f3.address and loop.decode.address == f3.address
    assert _reqs(f2, "Draft") == []


@pytest.mark.parametrize("ahead", [True, False])
def test_the_next_draft_goes_before_the_round_s_tokens_are_yielded(fake_pool, monkeypatch, ahead):
    """router/exact.py: with BATON_DRAFT_PREFETCH on (the default) the next round's Draft, carrying this
    round's verdict, reaches D while the caller still holds the round's tokens (it runs while they are sent);
    off, only once the caller asks for more. A caller that stops reading abandons it: the loop sends nothing
    more, and the tokens are the same either way."""
    monkeypatch.setenv(exact.PREFETCH_ENV, "1" if ahead else "0")
    loop, h, _, _, calls, pf, (df,) = _setup(fake_pool, n=40, k=2, decodes=[Controlled(fake_pool.settings, [1, 2])])
    rounds = loop.run(h.first_token)
    toks, finish, _ = next(rounds)
    assert finish is None and toks == reference(IDS, 3)[1:]  # 1 draft accepted + next
    end = time.monotonic() + 1.0
    while ahead and len(_reqs(df, "Draft")) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    drafts = _reqs(df, "Draft")
    assert len(drafts) == (2 if ahead else 1) and len(_reqs(pf, "Verify")) == 1
    if ahead:
        assert drafts[1].has_verdict and (drafts[1].accepted, drafts[1].next_token) == (1, toks[-1])
    toks2, _, _ = next(rounds)
    assert [h.first_token] + toks + toks2 == reference(IDS, 1 + len(toks) + len(toks2))
    end = time.monotonic() + 1.0
    while ahead and len(_reqs(df, "Draft")) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    assert len(_reqs(df, "Draft")) == (3 if ahead else 2)
    rounds.close()  # the client went away holding round 2's tokens: round 3's Draft (sent ahead) is abandoned
    assert loop._ahead is None and not calls._active
    time.sleep(0.2)  # and nothing more is sent
    assert len(_reqs(df, "Draft")) == (3 if ahead else 2) and len(_reqs(pf, "Verify")) == 2
