"""router.session: start_session (Prefill on one prefill worker, the state pushed to a decode target;
retry once on a worker fault before the first token; full decode workers) over loopback fake workers
(tests/fakes.py via the `fake_pool` fixture), and Budget's stop conditions."""

from __future__ import annotations

import threading
import time

import fakes
import grpc
import pytest

from baton.rpc import StatusError
from baton.v1 import common_pb2
from router import session as session_mod
from router.calls import Cancelled
from router.session import Budget, start_session

C = grpc.StatusCode
IDS = [5, 6, 7]


class Flaky(fakes.FakePrefill):
    """Prefill fails with `code` while the shared `budget[0]` > 0 (whichever worker gets it first)."""

    def __init__(self, settings, budget: list, code=C.UNAVAILABLE, msg="prefill worker crashed"):
        super().__init__(settings)
        self.budget, self.code, self.msg = budget, code, msg

    def Prefill(self, request, context):
        with self.lock:
            fail = self.budget[0] > 0
            self.budget[0] -= fail
        if fail:
            self.calls.append(("Prefill", request))
            context.abort(self.code, self.msg)
        return super().Prefill(request, context)


def _prefills(*fakes_):
    return [(f, r) for f in fakes_ for m, r in f.servicer.calls if m == "Prefill"]


def _start(calls, ids=IDS, mode=common_pb2.FAST, engine=0, **kw):
    return start_session(calls, ids, mode=mode, engine=engine, engine_name=None, **kw)


def test_prefill_goes_to_one_prefill_worker_with_the_decode_target_set(fake_pool):
    p1, _ = fake_pool.add("prefill")
    p2, _ = fake_pool.add("prefill")
    d1, _ = fake_pool.add("decode")
    d2, _ = fake_pool.add("decode")
    calls = fake_pool.calls()
    h = _start(calls, mode=common_pb2.EXACT)
    ((fake, req),) = _prefills(p1, p2)  # exactly one Prefill
    assert h.prefill.address == fake.address and req.session_id == h.session_id
    assert list(req.prompt_ids) == IDS and req.mode == common_pb2.EXACT
    assert req.decode_target == h.decode.address in (d1.address, d2.address)
    target = d1 if h.decode.address == d1.address else d2
    assert set(target.servicer.sessions) == {h.session_id}  # the state went P -> D
    assert target.servicer.sessions[h.session_id]["ctx"] == IDS
    assert h.first_token == fakes.exact_next(IDS) == int(h.response.first_token)
    assert set(fake.servicer.sessions) == {h.session_id}  # EXACT: P keeps the exact session
    assert h.prefill.outstanding == h.decode.outstanding == 1  # both leased for the request
    assert sorted((w.role, s) for w, s, _ in calls._sessions) == [("decode", h.session_id), ("prefill", h.session_id)]
    calls.close()
    assert target.servicer.sessions == {} and fake.servicer.sessions == {}
    assert h.prefill.outstanding == h.decode.outstanding == 0


def test_equal_prompts_are_announced_in_the_prefill(fake_pool):
    """start_session's equal_prompts (GenerateRequest.equal_prompts, the HTTP API's n) goes to the prefill
    worker as PrefillRequest.equal_prompts; none by default."""
    p, _ = fake_pool.add("prefill")
    fake_pool.add("decode")
    calls = fake_pool.calls()
    _start(calls, equal_prompts=4)
    _start(calls)
    assert [r.equal_prompts for _, r in _prefills(p)] == [4, 0]
    calls.close()


def test_equal_prompts_meet_on_one_prefill_worker(fake_pool):
    """Calls announcing equal prompts (equal_prompts > 1) go to the prefill worker their prompt hashes to,
    whatever the load, so one worker computes the prompt once; unannounced calls spread by load."""
    ps = [fake_pool.add("prefill")[0] for _ in range(3)]
    fake_pool.add("decode")
    calls = fake_pool.calls()
    count = lambda: [len(_prefills(f)) for f in ps]  # noqa: E731
    for _ in range(4):
        _start(calls, equal_prompts=4)
    assert sorted(count()) == [0, 0, 4]
    before = count()
    for _ in range(3):
        _start(calls)
    assert [a - b for a, b in zip(count(), before)] == [1, 1, 1]  # least loaded, least recently picked
    calls.close()


def test_the_least_loaded_workers_are_picked(fake_pool):
    _, pa = fake_pool.add("prefill")
    _, pb = fake_pool.add("prefill")
    _, da = fake_pool.add("decode")
    _, db = fake_pool.add("decode")
    busy = fake_pool.calls()
    busy.lease(pa)
    busy.lease(db)
    h = _start(fake_pool.calls())
    assert (h.prefill, h.decode) == (pb, da)


@pytest.mark.parametrize(
    "engines, engine, want",
    [
        (("fp8", "bf16"), 0, common_pb2.FP8),  # UNSPECIFIED: named as the target's default engine
        (("bf16", "mtp"), 0, common_pb2.BF16),
        (("fp8", "bf16"), common_pb2.BF16, common_pb2.BF16),  # an engine asked for is passed as is
    ],
)
def test_the_engine_is_named_in_the_prefill(fake_pool, engines, engine, want):
    p, _ = fake_pool.add("prefill")
    fake_pool.add("decode", engines=engines)
    _start(fake_pool.calls(), engine=engine)
    ((_, req),) = _prefills(p)
    assert req.engine == want


class TakesDraftOnly(fakes.FakeDecode):
    """A decode worker whose GetStats says its LoadState takes draft-only states."""

    def GetStats(self, request, context):
        st = super().GetStats(request, context)
        st.draft_only_states = True
        return st


def test_a_draft_only_hand_off_is_asked_for_exact_mtp_sessions_only(fake_pool, monkeypatch):
    """PrefillRequest.draft_only (router.session.draft_only_for): only for EXACT with engine MTP, to a decode
    worker that reports WorkerStats.draft_only_states, while this router relays verdict hidden rows
    (BATON_VERDICT_HIDDEN) and BATON_SLIM_HANDOFF is not "0"; else the whole state."""
    p, _ = fake_pool.add("prefill")
    _, d = fake_pool.add("decode", servicer=TakesDraftOnly(fake_pool.settings))
    EXACT, MTP = common_pb2.EXACT, common_pb2.MTP

    def asked(mode=EXACT, engine=MTP, **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        n = len(_prefills(p))
        _start(fake_pool.calls(), mode=mode, engine=engine)
        return _prefills(p)[n][1].draft_only

    assert d.draft_only_states and asked()  # learned from its GetStats
    assert not asked(mode=common_pb2.FAST) and not asked(engine=common_pb2.FP8) and not asked(engine=0)
    assert not asked(BATON_SLIM_HANDOFF="0")
    assert not asked(BATON_SLIM_HANDOFF="1", BATON_VERDICT_HIDDEN="0")
    assert asked(BATON_VERDICT_HIDDEN="1")
    d.draft_only_states = False  # an older decode worker (its GetStats without the field)
    assert not asked()


def test_a_fault_before_the_first_token_is_retried_once_on_another_prefill_worker(fake_pool):
    budget = [1]
    p1, w1 = fake_pool.add("prefill", Flaky(fake_pool.settings, budget))
    p2, w2 = fake_pool.add("prefill", Flaky(fake_pool.settings, budget))
    d, _ = fake_pool.add("decode")
    retried = []
    calls = fake_pool.calls()
    h = _start(calls, on_retry=lambda: retried.append(1))
    sent = _prefills(p1, p2)
    assert len(sent) == 2 and retried == [1]
    ((f_a, first),) = [(f, r) for f, r in sent if r.session_id != h.session_id]  # the failed attempt
    ((f_b, _second),) = [(f, r) for f, r in sent if r.session_id == h.session_id]
    assert {f_a.address, f_b.address} == {w1.address, w2.address}  # two different workers
    assert h.prefill.address == f_b.address
    assert h.first_token == fakes.exact_next(IDS) and set(d.servicer.sessions) == {h.session_id}
    # the failed attempt's session is tracked as uncertain (its hand-off may still land)
    unc = {s: u for _, s, u in calls._sessions}
    assert unc[first.session_id] is True and unc[h.session_id] is False


def test_the_retry_goes_to_the_same_worker_when_it_is_the_only_one(fake_pool):
    p, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, [1]))
    fake_pool.add("decode")
    h = _start(fake_pool.calls())
    assert len(_prefills(p)) == 2 and h.first_token == fakes.exact_next(IDS)


def test_two_faults_are_unavailable(fake_pool):
    budget = [5]
    p1, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, budget))
    p2, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, budget))
    fake_pool.add("decode")
    retried = []
    with pytest.raises(StatusError) as ei:
        _start(fake_pool.calls(), on_retry=lambda: retried.append(1))
    assert ei.value.code == C.UNAVAILABLE and "after 2 attempts" in ei.value.message
    assert len(_prefills(p1, p2)) == 2 and retried == [1]  # retried once, not more


def test_retries_zero_means_no_retry(fake_pool):
    budget = [1]
    p1, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, budget))
    p2, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, budget))
    fake_pool.add("decode")
    with pytest.raises(StatusError) as ei:
        _start(fake_pool.calls(), retries=0)
    assert ei.value.code == C.UNAVAILABLE and len(_prefills(p1, p2)) == 1


def test_a_dead_decode_target_is_excluded_on_the_retry(fake_pool):
    p1, _ = fake_pool.add("prefill")
    p2, _ = fake_pool.add("prefill")
    d_dead, w_dead = fake_pool.add("decode")
    d_live, w_live = fake_pool.add("decode")
    d_dead.stop()  # the registry still has it up: the Prefill's hand-off fails
    assert w_dead.up
    h = _start(fake_pool.calls())
    reqs = [r for _, r in _prefills(p1, p2)]
    assert [r.decode_target for r in reqs] == [w_dead.address, w_live.address]
    assert h.decode is w_live and not w_dead.up
    assert set(d_live.servicer.sessions) == {h.session_id}


def test_the_requests_own_error_is_not_retried(fake_pool):
    p1, _ = fake_pool.add("prefill")
    p2, _ = fake_pool.add("prefill")
    fake_pool.add("decode")
    with pytest.raises(StatusError) as ei:
        _start(fake_pool.calls(), ids=[])  # the fake refuses an empty prompt
    assert ei.value.code == C.INVALID_ARGUMENT and len(_prefills(p1, p2)) == 1


def test_no_worker_up_is_unavailable(fake_pool):
    fake_pool.add("prefill")
    with pytest.raises(StatusError) as ei:
        _start(fake_pool.calls())
    assert ei.value.code == C.UNAVAILABLE and "decode" in ei.value.message


def test_a_full_prefill_worker_is_skipped(fake_pool):
    budget = [1]
    msg = "all 1 exact slots are in use"
    p1, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, budget, C.RESOURCE_EXHAUSTED, msg))
    p2, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, budget, C.RESOURCE_EXHAUSTED, msg))
    _d, _ = fake_pool.add("decode")
    h = _start(fake_pool.calls())
    assert len(_prefills(p1, p2)) == 2 and h.first_token == fakes.exact_next(IDS)
    assert len({f.address for f, _ in _prefills(p1, p2)}) == 2


def test_every_prefill_worker_full_is_resource_exhausted(fake_pool):
    budget = [5]
    msg = "all 1 exact slots are in use"
    _p1, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, budget, C.RESOURCE_EXHAUSTED, msg))
    _p2, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, budget, C.RESOURCE_EXHAUSTED, msg))
    fake_pool.add("decode")
    with pytest.raises(StatusError) as ei:
        _start(fake_pool.calls())
    assert ei.value.code == C.RESOURCE_EXHAUSTED and ei.value.message == msg


FULL_D = "decode_target: all 4 bf16 decode slots are in use"


def test_a_full_decode_target_is_skipped_for_another(fake_pool):
    p, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, [1], C.RESOURCE_EXHAUSTED, FULL_D))
    _d1, w1 = fake_pool.add("decode")
    _d2, w2 = fake_pool.add("decode")
    h = _start(fake_pool.calls())
    reqs = [r for _, r in _prefills(p)]
    assert [r.decode_target for r in reqs] == [w1.address, w2.address] and h.decode is w2
    assert w1.full_until > time.monotonic()  # held off new requests for a while


def test_a_full_only_decode_worker_is_resource_exhausted_and_then_refused_before_a_prefill(fake_pool):
    p, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, [1], C.RESOURCE_EXHAUSTED, FULL_D))
    _, _d = fake_pool.add("decode")
    calls = fake_pool.calls()
    with pytest.raises(StatusError) as ei:
        _start(calls)
    assert (ei.value.code, ei.value.message) == (C.RESOURCE_EXHAUSTED, FULL_D)  # not UNAVAILABLE
    calls.close()
    assert len(_prefills(p)) == 1
    with pytest.raises(StatusError) as ei:  # within FULL_HOLD_S: refused here, no Prefill spent
        _start(fake_pool.calls())
    assert ei.value.code == C.RESOURCE_EXHAUSTED and "slots are in use" in ei.value.message
    assert len(_prefills(p)) == 1


def test_a_full_decode_worker_takes_requests_again_once_one_of_ours_ended(fake_pool):
    p, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, [1], C.RESOURCE_EXHAUSTED, FULL_D))
    _, d = fake_pool.add("decode")
    other = fake_pool.calls()
    other.lease(d)  # another request of ours holds a slot on d
    for _ in range(2):  # refused by d, then (still full) refused here
        calls = fake_pool.calls()
        with pytest.raises(StatusError) as ei:
            _start(calls)
        assert ei.value.code == C.RESOURCE_EXHAUSTED
        calls.close()
    assert d.full_at == 1 and len(_prefills(p)) == 1
    other.close()  # that request ended: its slot is free
    h = _start(fake_pool.calls())
    assert h.decode is d and len(_prefills(p)) == 2


def test_a_full_decode_worker_is_tried_again_after_the_hold(fake_pool, monkeypatch):
    monkeypatch.setattr(session_mod, "FULL_HOLD_S", 0.2)
    _p, _ = fake_pool.add("prefill", Flaky(fake_pool.settings, [1], C.RESOURCE_EXHAUSTED, FULL_D))
    fake_pool.add("decode")
    with pytest.raises(StatusError):
        _start(fake_pool.calls())
    time.sleep(0.25)
    assert _start(fake_pool.calls()).first_token == fakes.exact_next(IDS)


def test_cancel_during_the_prefill_is_cancelled_and_the_session_uncertain(fake_pool):
    p, _ = fake_pool.add("prefill")
    p.servicer.hang.add("Prefill")
    fake_pool.add("decode")
    calls = fake_pool.calls(timeout=10, call_timeout=10)
    box = {}

    def run():
        try:
            _start(calls)
        except BaseException as e:  # noqa: BLE001
            box["exc"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    end = time.monotonic() + 3
    while not p.servicer.calls and time.monotonic() < end:
        time.sleep(0.01)
    calls.cancel()
    t.join(3)
    assert isinstance(box.get("exc"), Cancelled)
    assert calls._sessions and all(u for _, _, u in calls._sessions)


# ---- Budget ---------------------------------------------------------------------------------------
def test_budget_length():
    b = Budget(5, stop_ids=(), eos_ids=(99,), ignore_eos=False)
    assert b.take([1]) == ([1], None) and b.remaining == 4
    assert b.take([2, 3]) == ([2, 3], None)
    assert b.take([4, 5, 6, 7]) == ([4, 5], common_pb2.LENGTH)  # truncated at max_new_tokens
    assert b.emitted == [1, 2, 3, 4, 5] and b.remaining == 0
    assert b.take([8]) == ([], common_pb2.LENGTH)


def test_budget_stop_and_eos_are_inclusive_and_end_the_request():
    b = Budget(10, stop_ids=[7], eos_ids=[99], ignore_eos=False)
    assert b.take([1, 7, 2]) == ([1, 7], common_pb2.STOP)
    b = Budget(10, stop_ids=[7], eos_ids=[99], ignore_eos=False)
    assert b.take([1, 99, 7]) == ([1, 99], common_pb2.EOS)
    assert b.emitted == [1, 99]


def test_budget_ignore_eos():
    b = Budget(3, stop_ids=[], eos_ids=[99], ignore_eos=True)
    assert b.take([99, 99]) == ([99, 99], None)
    assert b.take([99, 99]) == ([99], common_pb2.LENGTH)


def test_budget_stop_on_the_last_allowed_token_is_stop():
    b = Budget(2, stop_ids=[7], eos_ids=[99], ignore_eos=False)
    assert b.take([1, 7]) == ([1, 7], common_pb2.STOP)
    b = Budget(2, stop_ids=[7], eos_ids=[99], ignore_eos=False)
    assert b.take([1, 99]) == ([1, 99], common_pb2.EOS)


def test_budget_a_stop_id_that_is_also_eos_is_stop():
    b = Budget(5, stop_ids=[99], eos_ids=[99], ignore_eos=False)
    assert b.take([3, 99]) == ([3, 99], common_pb2.STOP)


def test_budget_takes_numpy_like_ints_and_empty_batches():
    b = Budget(2, stop_ids=[7], eos_ids=(), ignore_eos=False)
    assert b.take([]) == ([], None)
    out, fin = b.take(iter([True, 7]))  # anything int() accepts
    assert out == [1, 7] and all(type(t) is int for t in out) and fin == common_pb2.STOP


def test_budget_zero_tokens_is_length_at_once():
    assert Budget(0, (), (), False).take([1, 2]) == ([], common_pb2.LENGTH)
