"""router.calls.Calls: the downstream calls of one request over real loopback gRPC (tests/fakes.py
workers, through the `fake_pool` fixture): deadlines, cancellation, error triage, session release."""

from __future__ import annotations

import threading
import time

import fakes
import grpc
import pytest

from baton.rpc import StatusError
from baton.v1 import decode_pb2, prefill_pb2
from router.calls import Calls, Cancelled, WorkerFault

C = grpc.StatusCode
DRAFT = decode_pb2.DraftRequest(session_id="nope", k=2)
DECODE = decode_pb2.DecodeRequest(session_id="s", max_new_tokens=50)


class Recording(fakes.FakeDecode):
    """A fake decode worker that records each call's remaining deadline, and sets `ended` once a
    hung call saw its client go away."""

    def __init__(self, settings, **kw):
        super().__init__(settings, **kw)
        self.remaining: list[float | None] = []
        self.ended = threading.Event()

    def _enter(self, method, request, context):
        self.remaining.append(context.time_remaining())
        if method in self.hang:
            self.calls.append((method, request))
            while context.is_active():
                time.sleep(0.01)
            self.ended.set()
            context.abort(C.CANCELLED, "hung call cancelled")
        super()._enter(method, request, context)

    def Release(self, request, context):
        self.calls.append(("Release", request))
        return super().Release(request, context)


class RecPrefill(fakes.FakePrefill):
    def Release(self, request, context):
        self.calls.append(("Release", request))
        return super().Release(request, context)


# a server measures its deadline from when the call reached it, so it may see a few ms more than the
# client's timeout (transit, the wire's timeout rounding): allowed slack
SLACK = 0.05


def _load(fake, sid: str, ctx=(1, 2, 3)) -> None:
    with fake.servicer.lock:
        fake.servicer.sessions[sid] = {"ctx": list(ctx), "pending": 4, "engine": "bf16", "drafts": []}


def _in_thread(fn):
    """Runs fn() in a thread -> (thread, box); box["exc"] / box["ret"] once it ends."""
    box: dict = {}

    def run():
        try:
            box["ret"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box["exc"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait(pred, timeout=3.0) -> bool:
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.01)
    return pred()


# ---- deadlines ------------------------------------------------------------------------------------
def test_unary_deadline_is_the_clients_when_it_is_sooner(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(fake, "s")
    calls = fake_pool.calls(timeout=1.5, call_timeout=30.0)
    t0 = time.monotonic()
    resp = calls.unary(w, "Draft", decode_pb2.DraftRequest(session_id="s", k=2))
    assert len(resp.draft_tokens) == 2
    (rem,) = fake.servicer.remaining
    assert rem is not None and 1.0 < rem <= (calls.deadline - t0) + SLACK <= 1.5 + SLACK


def test_unary_deadline_is_capped_at_call_timeout(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(fake, "s")
    calls = fake_pool.calls(timeout=60.0, call_timeout=0.7)
    calls.unary(w, "Draft", decode_pb2.DraftRequest(session_id="s", k=2))
    (rem,) = fake.servicer.remaining
    assert 0.4 < rem <= 0.7 + SLACK


def test_a_stream_gets_the_clients_deadline_not_call_timeout(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(fake, "s")
    calls = fake_pool.calls(timeout=4.0, call_timeout=0.5)
    out = [
        t
        for r in calls.stream(w, "Decode", decode_pb2.DecodeRequest(session_id="s", max_new_tokens=3))
        for t in r.token_ids
    ]
    assert len(out) == 3
    (rem,) = fake.servicer.remaining
    assert 3.0 < rem <= 4.0 + SLACK  # the whole stream may run to the client's deadline


def test_a_spent_deadline_fails_before_any_call(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    calls = fake_pool.calls(timeout=-0.01)
    for call in (lambda: calls.unary(w, "Draft", DRAFT), lambda: list(calls.stream(w, "Decode", DECODE))):
        with pytest.raises(StatusError) as ei:
            call()
        assert ei.value.code == C.DEADLINE_EXCEEDED
    assert fake.servicer.calls == [] and w.up


def test_the_clients_deadline_passing_is_deadline_exceeded_not_a_fault(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    fake.servicer.hang.add("Draft")
    calls = fake_pool.calls(timeout=0.4, call_timeout=10.0)
    with pytest.raises(StatusError) as ei:
        calls.unary(w, "Draft", DRAFT)
    assert ei.value.code == C.DEADLINE_EXCEEDED
    assert w.up  # the worker is not blamed for the client's deadline


def test_a_hung_unary_call_is_a_worker_fault_and_marks_it_down(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    fake.servicer.hang.add("Draft")
    calls = fake_pool.calls(timeout=10.0, call_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(WorkerFault) as ei:
        calls.unary(w, "Draft", DRAFT)
    assert ei.value.code == C.DEADLINE_EXCEEDED and ei.value.worker is w
    assert time.monotonic() - t0 < 2.0 and not w.up


def test_a_stalled_stream_is_a_worker_fault(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(fake, "s")
    fake.servicer.freeze_after = 3  # sends two tokens, then nothing
    calls = fake_pool.calls(timeout=10.0, call_timeout=0.4)
    got = []
    t0 = time.monotonic()
    with pytest.raises(WorkerFault) as ei:
        for r in calls.stream(w, "Decode", DECODE):
            got += r.token_ids
    assert len(got) == 2 and ei.value.code == C.DEADLINE_EXCEEDED and "stalled" in str(ei.value)
    assert time.monotonic() - t0 < 2.5 and not w.up


# ---- cancellation ---------------------------------------------------------------------------------
def test_cancel_reaches_an_active_unary_call(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    fake.servicer.hang.add("Draft")
    calls = fake_pool.calls(timeout=10.0, call_timeout=10.0)
    t, box = _in_thread(lambda: calls.unary(w, "Draft", DRAFT))
    assert _wait(lambda: fake.servicer.calls)  # the call is on the worker
    calls.cancel()
    t.join(3)
    assert isinstance(box.get("exc"), Cancelled)
    assert fake.servicer.ended.wait(3)  # the worker saw its caller go away
    assert w.up  # a cancel blames no one


def test_cancel_reaches_an_active_stream(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(fake, "s")
    fake.servicer.delay = 0.05
    calls = fake_pool.calls(timeout=10.0, call_timeout=10.0)
    got = []

    def consume():
        for r in calls.stream(w, "Decode", decode_pb2.DecodeRequest(session_id="s", max_new_tokens=1000)):
            got.extend(r.token_ids)

    t, box = _in_thread(consume)
    assert _wait(lambda: len(got) >= 2)
    calls.cancel()
    t.join(3)
    assert isinstance(box.get("exc"), Cancelled)
    n = len(fake.servicer.sessions["s"]["ctx"])
    time.sleep(0.3)  # the worker stopped producing
    assert len(fake.servicer.sessions["s"]["ctx"]) <= n + 1 and len(got) < 100
    assert w.up


def test_calls_after_cancel_raise_cancelled(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(fake, "s")
    calls = fake_pool.calls()
    calls.cancel()
    with pytest.raises(Cancelled):
        calls.unary(w, "Draft", decode_pb2.DraftRequest(session_id="s", k=1))
    with pytest.raises(Cancelled):
        list(calls.stream(w, "Decode", DECODE))


def test_a_cancel_of_one_request_leaves_another_alone(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(fake, "s")
    a, b = fake_pool.calls(), fake_pool.calls()
    a.cancel()
    assert len(b.unary(w, "Draft", decode_pb2.DraftRequest(session_id="s", k=3)).draft_tokens) == 3


def test_breaking_out_of_a_stream_cancels_the_call(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(fake, "s")
    fake.servicer.delay = 0.02
    calls = fake_pool.calls()
    for r in calls.stream(w, "Decode", decode_pb2.DecodeRequest(session_id="s", max_new_tokens=1000)):
        break
    n = len(fake.servicer.sessions["s"]["ctx"])
    time.sleep(0.3)
    assert len(fake.servicer.sessions["s"]["ctx"]) <= n + 1
    assert not calls._active


# ---- error triage ---------------------------------------------------------------------------------
FAULTS = [C.UNAVAILABLE, C.CANCELLED, C.UNKNOWN, C.INTERNAL, C.DATA_LOSS, C.ABORTED]
PASSED = [C.INVALID_ARGUMENT, C.OUT_OF_RANGE, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION, C.ALREADY_EXISTS]


@pytest.mark.parametrize("code", FAULTS)
def test_codes_that_blame_the_worker_are_worker_faults(fake_pool, code):
    fake, w = fake_pool.add("decode")
    fake.servicer.fail["Draft"] = (code, f"boom {code.name}")
    with pytest.raises(WorkerFault) as ei:
        fake_pool.calls().unary(w, "Draft", DRAFT)
    assert ei.value.code == code and ei.value.worker is w and ei.value.details == f"boom {code.name}"
    assert w.up  # alive (UNAVAILABLE: probed, answers SERVING): not marked down


@pytest.mark.parametrize("code", PASSED)
def test_the_requests_own_faults_pass_through(fake_pool, code):
    fake, w = fake_pool.add("prefill")
    fake.servicer.fail["Verify"] = (code, "field: why")
    with pytest.raises(StatusError) as ei:
        fake_pool.calls().unary(w, "Verify", prefill_pb2.VerifyRequest(session_id="x", tokens=[1, 2]))
    assert (ei.value.code, ei.value.message) == (code, "field: why")
    assert w.up


def test_not_found_is_a_fault_on_a_decode_worker_only(fake_pool):
    _, d = fake_pool.add("decode")
    _, p = fake_pool.add("prefill")
    calls = fake_pool.calls()
    with pytest.raises(WorkerFault) as ei:  # the decode worker lost the session: migrate
        calls.unary(d, "Draft", DRAFT)
    assert ei.value.code == C.NOT_FOUND
    with pytest.raises(StatusError) as ei:  # the exact worker's session is the reference: pass it on
        calls.unary(p, "Verify", prefill_pb2.VerifyRequest(session_id="nope", tokens=[1, 2]))
    assert ei.value.code == C.NOT_FOUND
    assert d.up and p.up


@pytest.mark.parametrize("code", [C.UNAUTHENTICATED, C.PERMISSION_DENIED])
def test_a_refused_credential_is_internal_to_the_client(fake_pool, code):
    fake, w = fake_pool.add("decode")
    fake.servicer.fail["Draft"] = (code, "bad token")
    with pytest.raises(StatusError) as ei:
        fake_pool.calls().unary(w, "Draft", DRAFT)
    assert ei.value.code == C.INTERNAL and "credentials" in ei.value.message


def test_a_dead_worker_is_a_fault_and_is_probed_down(fake_pool):
    fake, w = fake_pool.add("decode")
    fake.stop()
    with pytest.raises(WorkerFault) as ei:
        fake_pool.calls().unary(w, "Draft", DRAFT)
    assert ei.value.code == C.UNAVAILABLE and not w.up


def test_a_worker_removed_from_the_pool_is_a_fault(fake_pool):
    _, w = fake_pool.add("decode")
    fake_pool.registry.remove(w)  # its channel closed (e.g. a restarted Ray actor)
    calls = fake_pool.calls()
    for call in (lambda: calls.unary(w, "Draft", DRAFT), lambda: list(calls.stream(w, "Decode", DECODE))):
        with pytest.raises(WorkerFault) as ei:
            call()
        assert ei.value.code == C.UNAVAILABLE and "removed" in ei.value.details


def test_a_stream_error_mid_way_is_triaged_too(fake_pool):
    fake, w = fake_pool.add("decode")
    _load(fake, "s")
    fake.servicer.die_on["Decode.token"] = 3  # dies after two tokens
    got = []
    with pytest.raises(WorkerFault) as ei:
        for r in fake_pool.calls().stream(w, "Decode", DECODE):
            got += r.token_ids
    assert len(got) == 2 and ei.value.code == C.UNAVAILABLE


def test_a_successful_answer_records_that_the_worker_is_alive(fake_pool):
    fake, w = fake_pool.add("decode")
    _load(fake, "s")
    w.last_answer = 0.0
    fake_pool.calls().unary(w, "Draft", decode_pb2.DraftRequest(session_id="s", k=1))
    assert time.monotonic() - w.last_answer < 1.0


# ---- sessions and leases --------------------------------------------------------------------------
def test_close_releases_every_tracked_session_and_drops_leases(fake_pool):
    pf, p = fake_pool.add("prefill", RecPrefill(fake_pool.settings))
    df, d = fake_pool.add("decode", Recording(fake_pool.settings))
    _load(df, "s1")
    _load(df, "s2")
    pf.servicer.sessions["s1"] = {"ctx": [1], "pending": 2}
    keep_df = "other"
    _load(df, keep_df)
    calls = fake_pool.calls()
    calls.lease(p)
    calls.lease(d)
    calls.lease(d)  # a worker is leased once per request
    assert (p.outstanding, d.outstanding) == (1, 1)
    calls.track(p, "s1")
    calls.track(d, "s1")
    calls.track(d, "s2")
    calls.close()
    assert (p.outstanding, d.outstanding) == (0, 0)
    assert set(df.servicer.sessions) == {keep_df} and pf.servicer.sessions == {}
    released = sorted((m, r.session_id) for f in (pf, df) for m, r in f.servicer.calls if m == "Release")
    assert released == [("Release", "s1"), ("Release", "s1"), ("Release", "s2")]


def test_close_with_a_dead_worker_still_releases_the_others(fake_pool):
    dead, a = fake_pool.add("decode")
    live, b = fake_pool.add("decode")
    _load(live, "s")
    calls = fake_pool.calls()
    calls.lease(a)
    calls.lease(b)
    calls.track(a, "s")
    calls.track(b, "s")
    dead.stop()
    t0 = time.monotonic()
    calls.close()  # no exception; bounded by RELEASE_TIMEOUT_S
    assert time.monotonic() - t0 < 3.0
    assert live.servicer.sessions == {} and (a.outstanding, b.outstanding) == (0, 0)


def test_an_uncertain_session_is_released_again_later(fake_pool):
    """A Prefill cut short: its hand-off may create the session after the first Release."""
    df, d = fake_pool.add("decode", Recording(fake_pool.settings))
    calls = fake_pool.calls()
    calls.track(d, "late")
    calls.track(d, "sure")
    calls.mark_uncertain("late")
    calls.close()
    _load(df, "late")  # the hand-off lands after the first Release
    _load(df, "sure")  # (a certain session is released once only)
    assert _wait(lambda: "late" not in df.servicer.sessions, timeout=3.0)
    rel = [r.session_id for m, r in df.servicer.calls if m == "Release"]
    assert sorted(rel) == ["late", "late", "sure"] and "sure" in df.servicer.sessions


def test_close_cancels_calls_still_running(fake_pool):
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    fake.servicer.hang.add("Draft")
    calls = fake_pool.calls(timeout=10.0, call_timeout=10.0)
    t, box = _in_thread(lambda: calls.unary(w, "Draft", DRAFT))
    assert _wait(lambda: fake.servicer.calls)
    calls.close()
    assert fake.servicer.ended.wait(3)
    t.join(3)
    assert not t.is_alive() and "exc" in box


def test_a_call_started_after_close_is_cancelled(fake_pool):
    """close() racing a call between its start and its registration: the call is cancelled as it
    registers (Cancelled), not left to run until its timeout."""
    fake, w = fake_pool.add("decode", Recording(fake_pool.settings))
    fake.servicer.hang.add("Draft")
    calls = fake_pool.calls(timeout=10.0, call_timeout=10.0)
    calls.close()
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        calls.unary(w, "Draft", DRAFT)
    assert time.monotonic() - t0 < 3


def test_calls_of_two_requests_are_independent(fake_pool):
    """Two Calls on one registry: each keeps its own sessions and leases."""
    df, d = fake_pool.add("decode")
    _load(df, "a")
    _load(df, "b")
    ca, cb = Calls(fake_pool.registry, deadline=time.monotonic() + 5, call_timeout=2), fake_pool.calls()
    ca.lease(d)
    cb.lease(d)
    ca.track(d, "a")
    cb.track(d, "b")
    assert d.outstanding == 2
    ca.close()
    assert d.outstanding == 1 and set(df.servicer.sessions) == {"b"}


def test_release_survives_a_channel_closed_under_its_future():
    """With an interceptor on the channel, a Release on a channel closed meanwhile fails in the future's
    result() (ValueError), not at the call: the other sessions are still released and nothing is raised."""
    from types import SimpleNamespace

    from router import calls as calls_mod

    done = []

    class Fut:
        def __init__(self, sid):
            self.sid = sid

        def result(self):
            if self.sid == "closed":
                raise ValueError("Cannot invoke RPC: Channel closed!")
            done.append(self.sid)

    stub = SimpleNamespace(Release=SimpleNamespace(future=lambda req, timeout: Fut(req.session_id)))
    w = SimpleNamespace(stub=stub, address="127.0.0.1:1")
    calls_mod._release([(w, "closed", True), (w, "open", True)])  # raised ValueError before the fix
    assert done == ["open"]
