"""router/batcher.py: a round's calls to one worker go as one batched RPC, each item with its own outcome."""

from __future__ import annotations

import threading
import time
import types

import grpc
import pytest

from baton.v1 import common_pb2, decode_pb2
from router import batcher


class _Stub:
    """DraftMany of a fake decode worker: records each batch; session "bad" fails alone (INVALID_ARGUMENT)."""

    def __init__(self, delay: float = 0.0, error: grpc.StatusCode | None = None):
        self.batches, self.delay, self.error = [], delay, error

    def DraftMany(self, req, timeout):
        self.batches.append([r.session_id for r in req.requests])
        time.sleep(self.delay)
        if self.error is not None:
            raise _RpcError(self.error)
        out = []
        for r in req.requests:
            if r.session_id == "bad":
                st = common_pb2.ItemStatus(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="k: out of range")
                out.append(decode_pb2.DraftOutcome(status=st))
            else:
                resp = decode_pb2.DraftResponse(draft_tokens=[len(r.session_id), r.k])
                out.append(decode_pb2.DraftOutcome(response=resp))
        return decode_pb2.DraftManyResponse(outcomes=out)


class _RpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "from the stub"


def _worker(stub):
    return types.SimpleNamespace(stub=stub, batchers={}, address="127.0.0.1:1")


def _round(b, sids, timeout=5.0):
    """Each session submits from its own thread at once -> {sid: response or the exception raised}."""
    out, go = {}, threading.Barrier(len(sids))

    def one(sid):
        go.wait()
        t = b.submit(sid, decode_pb2.DraftRequest(session_id=sid, k=3), timeout)
        try:
            out[sid] = t.result()
        except Exception as e:  # noqa: BLE001
            out[sid] = e

    th = [threading.Thread(target=one, args=(s,)) for s in sids]
    for t in th:
        t.start()
    for t in th:
        t.join(10)
    return out


def test_a_round_of_sessions_goes_as_one_rpc_and_each_gets_its_own_outcome(monkeypatch):
    # a loaded 2-core run started the round's threads more than SETTLE_S apart: the leader sent early (two
    # batches). Here the leader may wait long; with every live session queued it sends at once anyway
    monkeypatch.setattr(batcher, "SETTLE_S", 0.5)
    monkeypatch.setattr(batcher, "MAX_WAIT_S", 2.0)
    stub = _Stub(delay=0.01)
    b = batcher.batcher_of(_worker(stub), "Draft")
    sids = ["a", "bb", "ccc", "bad", "eeeee", "ffffff"]
    _round(b, sids)  # the first round: nobody is known yet, so it may split while the sessions arrive
    stub.batches.clear()
    out = _round(b, sids)  # every session live: the leader waits for all of them
    assert len(stub.batches) == 1 and sorted(stub.batches[0]) == sorted(sids)
    for sid in sids:
        if sid == "bad":
            assert isinstance(out[sid], batcher.ItemError) and out[sid].code() == grpc.StatusCode.INVALID_ARGUMENT
        else:
            assert list(out[sid].draft_tokens) == [len(sid), 3]
    batcher.forget("bad", b.worker)  # a finished session is not waited for: the rest go at once
    stub.batches.clear()
    t0 = time.monotonic()
    _round(b, [s for s in sids if s != "bad"])
    assert len(stub.batches) == 1 and time.monotonic() - t0 < 0.5


def test_a_missing_session_delays_a_batch_by_the_settle_time_only():
    stub = _Stub()
    b = batcher.batcher_of(_worker(stub), "Draft")
    _round(b, ["a", "b"])
    t0 = time.monotonic()
    out = _round(b, ["a"])  # "b" is live but does not come: the batch goes after SETTLE_S .. MAX_WAIT_S
    assert list(out["a"].draft_tokens) == [1, 3] and time.monotonic() - t0 < 0.5


def test_a_worker_without_the_batched_method_gets_unary_calls():
    w = _worker(_Stub(error=grpc.StatusCode.UNIMPLEMENTED))
    out = _round(batcher.batcher_of(w, "Draft"), ["a", "b"])
    assert all(isinstance(v, batcher.Unbatched) for v in out.values())
    assert batcher.batcher_of(w, "Draft") is None


def test_a_failed_rpc_fails_every_item_with_its_code():
    out = _round(batcher.batcher_of(_worker(_Stub(error=grpc.StatusCode.UNAVAILABLE)), "Draft"), ["a", "b"])
    assert all(v.code() == grpc.StatusCode.UNAVAILABLE for v in out.values())


def test_an_item_s_own_deadline_and_cancel():
    b = batcher.batcher_of(_worker(_Stub(delay=0.5)), "Draft")
    lead = b.submit("lead", decode_pb2.DraftRequest(session_id="lead", k=1), 5.0)
    late = b.submit("late", decode_pb2.DraftRequest(session_id="late", k=1), 0.1)
    th = threading.Thread(target=lead.result)  # leads: sends the batch (0.5 s at the worker)
    th.start()
    while not late.sent:  # the first caller to wait leads: here lead's, so late only waits
        time.sleep(0.001)
    t0 = time.monotonic()
    with pytest.raises(batcher.ItemError) as ei:
        late.result()  # its own deadline, while the batch is still in flight
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 0.4
    th.join(5)
    t = b.submit("x", decode_pb2.DraftRequest(session_id="x", k=1), 5.0)
    t.cancel()  # leaves the queue: its caller wakes at once, and no batch counts it
    assert not b._queue
    with pytest.raises(batcher.CancelledError):
        t.result()


def test_batching_off_and_other_methods(monkeypatch):
    w = _worker(_Stub())
    assert batcher.batcher_of(w, "Release") is None
    monkeypatch.setenv(batcher.ENV, "0")
    assert batcher.batcher_of(w, "Draft") is None


def test_a_bug_while_sending_fails_the_items_instead_of_leaving_them_waiting():
    class Broken:
        def DraftMany(self, req, timeout):
            raise KeyError("boom")

    t0 = time.monotonic()
    out = _round(batcher.batcher_of(_worker(Broken()), "Draft"), ["a", "b"])
    assert all(v.code() == grpc.StatusCode.INTERNAL and "KeyError" in v.details() for v in out.values())
    assert time.monotonic() - t0 < 1.0


def test_an_abandoned_leader_still_sends_the_others_and_nobody_waits_for_a_busy_session():
    """A request cancelled between submit and result (Calls.batched's register, or a prefetched Draft whose
    client went away) abandons its ticket: it leaves the queue and the others' batch goes without it. A session
    waiting on another batcher's batch (its Verify) is not waited for by this one (no settle wait)."""
    stub = _Stub()
    b = batcher.batcher_of(_worker(stub), "Draft")
    _round(b, ["a", "b"])
    lead = b.submit("a", decode_pb2.DraftRequest(session_id="a", k=2), 5.0)
    other = b.submit("b", decode_pb2.DraftRequest(session_id="b", k=2), 5.0)
    lead.abandon()
    done = threading.Thread(target=other.result)
    done.start()
    done.join(2)
    assert not done.is_alive() and stub.batches[-1] == ["b"] and list(other.outcome.draft_tokens) == [1, 2]
    assert not batcher._BUSY  # nobody waits on anything any more
    verify = batcher.RoundBatcher(_worker(stub), "Draft")  # stands for b's sessions' other worker
    held = verify.submit("b", decode_pb2.DraftRequest(session_id="b", k=2), 5.0)  # "b" waits there
    now = time.monotonic()
    assert b._expected(now) == 1  # "a" only: "b" is queued at the other batcher
    held.sent = True  # ... and in flight there
    assert b._expected(now) == 1
    held.cancel()
    try:
        held.result()
    except batcher.CancelledError:
        pass
    assert b._expected(now) == 2 and not batcher._BUSY  # "b" is back: it may come to this batcher


def test_an_item_whose_caller_is_away_goes_with_the_batch_another_caller_leads(monkeypatch):
    """Exact mode submits a session's next Draft before it sends the round's tokens (router/exact.py): that
    caller is away, sending. The batch goes when every live session is queued, led by whoever waits first;
    the away caller finds its answer there when it comes back, without leading or waiting."""
    stub = _Stub()
    b = batcher.batcher_of(_worker(stub), "Draft")
    _round(b, ["a", "b", "c"])  # all three live now (a first round may split: with the default settle time, fast)
    stub.batches.clear()
    monkeypatch.setattr(batcher, "SETTLE_S", 0.5)  # from here a missing session would hold the batch 0.5 s
    monkeypatch.setattr(batcher, "MAX_WAIT_S", 2.0)
    away = b.submit("a", decode_pb2.DraftRequest(session_id="a", k=2), 5.0)  # its caller does not wait (yet)
    t0 = time.monotonic()
    out = _round(b, ["b", "c"])
    assert time.monotonic() - t0 < 0.4  # nobody waited for "a": it was queued
    assert len(stub.batches) == 1 and sorted(stub.batches[0]) == ["a", "b", "c"]
    assert away.sent and away.done.is_set() and away.answered >= t0
    assert list(away.result().draft_tokens) == [1, 2] and list(out["c"].draft_tokens) == [1, 3]
    assert not batcher._BUSY
