"""router/slot_line.py: new requests wait in line for a session slot, first come first served, instead of
being refused at once; the wait ends with a start, the refusal (after queue_s), or the client's cancel."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from fakes import Cluster, reference

from baton.rpc import StatusError
from router import slot_line
from router.calls import Cancelled
from router.config import RouterConfig
from router.slot_line import SlotLine

PROMPT = [5, 6, 7]
FULL = StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode workers: all session slots are in use")


class Pool:
    """n slots; take() is start_session: a slot, or RESOURCE_EXHAUSTED; give() ends a request."""

    def __init__(self, n: int, line: SlotLine):
        self.free, self.line, self.order, self.tries = n, line, [], 0
        self._lock = threading.Lock()

    def take(self, name: str):
        def attempt():
            with self._lock:
                self.tries += 1
                if self.free == 0:
                    raise FULL
                self.free -= 1
                self.order.append(name)
                return name

        return attempt

    def give(self, tell: bool = True) -> None:
        with self._lock:
            self.free += 1
        if tell:
            self.line.freed()


def _start(line, pool, name, out, wait=10.0, priority=0):
    def run():
        try:
            out[name] = line.start(pool.take(name), time.monotonic() + wait, priority=priority)
        except Exception as e:  # noqa: BLE001
            out[name] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def _until(cond, timeout=2.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    assert cond()


def test_requests_wait_in_line_and_start_first_come_first_served():
    line = SlotLine(10.0)
    pool, out = Pool(1, line), {}
    assert line.start(pool.take("a"), time.monotonic() + 5) == "a" and len(line) == 0  # free: no line
    threads = []
    for name in ("b", "c", "d"):
        threads.append(_start(line, pool, name, out))
        _until(lambda n=len(threads): len(line) == n)  # each joined behind the last
    for want in ("b", "c", "d"):
        pool.give()  # a request ended: the head starts, the others stay in line
        _until(lambda: want in out)
        assert out[want] == want and pool.order[-1] == want
    for t in threads:
        t.join(2)
    assert pool.order == ["a", "b", "c", "d"] and len(line) == 0 and (line.waited, line.started) == (3, 3)


def test_a_lower_priority_value_waits_ahead_and_equal_ones_keep_their_order():
    """GenerateRequest.priority (vLLM's: lower first): waiters start in order of priority, then of arrival; a
    request that arrives with a lower value than the waiters passes them; the running one is not preempted."""
    line = SlotLine(10.0)
    pool, out = Pool(1, line), {}
    assert line.start(pool.take("run"), time.monotonic() + 5, priority=9) == "run"
    threads = []
    for name, prio in (("b0", 0), ("c5", 5), ("d0", 0), ("e-3", -3), ("f5", 5)):
        threads.append(_start(line, pool, name, out, priority=prio))
        _until(lambda n=len(threads): len(line) == n)
    for _ in range(5):
        pool.give()
        _until(lambda n=len(pool.order): len(pool.order) == n + 1)
    for t in threads:
        t.join(2)
    assert pool.order == ["run", "e-3", "b0", "d0", "c5", "f5"] and len(line) == 0


def test_a_new_request_queues_behind_a_waiting_one_even_when_a_slot_is_free(monkeypatch):
    """A slot freed where the router does not see it (a TTL, another router) is found by the head's retry
    every RETRY_S; a request arriving meanwhile joins the line behind the head instead of taking it."""
    monkeypatch.setattr(slot_line, "RETRY_S", 0.3)
    line = SlotLine(10.0)
    pool, out = Pool(0, line), {}
    tb = _start(line, pool, "b", out)
    _until(lambda: len(line) == 1)
    pool.give(tell=False)
    tc = _start(line, pool, "c", out)  # it would get the slot if it tried first
    _until(lambda: "b" in out)
    assert out["b"] == "b" and "c" not in out and len(line) == 1
    pool.give()
    tb.join(2), tc.join(2)
    assert pool.order == ["b", "c"]


def test_the_wait_runs_out_as_resource_exhausted_and_other_errors_pass_at_once():
    line = SlotLine(0.3)
    pool, out = Pool(0, line), {}
    t0 = time.monotonic()
    _start(line, pool, "b", out).join(3)
    assert isinstance(out["b"], StatusError) and out["b"].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "all session slots" in out["b"].message and "waited 0." in out["b"].message
    assert 0.3 <= time.monotonic() - t0 < 1.5 and len(line) == 0
    bad = StatusError(grpc.StatusCode.UNAVAILABLE, "no decode worker")

    def broken():
        raise bad

    with pytest.raises(StatusError) as e:
        line.start(broken, time.monotonic() + 5)
    assert e.value is bad and len(line) == 0
    t0 = time.monotonic()
    with pytest.raises(StatusError):  # a line of 0 s: refused at once, as without a line
        SlotLine(0.0).start(pool.take("x"), time.monotonic() + 5)
    assert time.monotonic() - t0 < 0.1


def test_a_cancelled_request_leaves_the_line():
    line = SlotLine(10.0)
    pool, gone = Pool(0, line), threading.Event()
    got = []

    def run():
        try:
            line.start(pool.take("b"), time.monotonic() + 10, gone.is_set)
        except Cancelled:
            got.append("cancelled")

    t = threading.Thread(target=run)
    t.start()
    _until(lambda: len(line) == 1)
    gone.set()
    t.join(2)
    assert got == ["cancelled"] and len(line) == 0 and pool.order == []


def test_the_router_waits_for_a_slot_when_the_line_is_on():
    """Through the router (loopback fakes): the decode target refuses once for full slots. With
    RouterConfig.queue_s the request waits in line, tries again and is served; without, it is refused."""
    full = (grpc.StatusCode.RESOURCE_EXHAUSTED, "decode_target x: hand-off failed: all 8 session slots are in use")
    for queue_s in (5.0, 0.0):
        c = Cluster(config=RouterConfig(call_timeout_s=2.0, migrate_wait_s=1.0, queue_s=queue_s), n_decode=1)
        try:
            c.prefill[0].servicer.fail["Prefill"] = full
            if queue_s:
                assert c.run(PROMPT, max_new_tokens=4)[0] == reference(PROMPT, 4)
                assert (c.servicer.line.waited, c.servicer.line.started) == (1, 1)
            else:
                with pytest.raises(grpc.RpcError) as e:
                    c.run(PROMPT, max_new_tokens=4)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert c.servicer.line.waited == 0
            assert c.wait_sessions_zero()
        finally:
            c.close()


def test_the_router_puts_a_requests_priority_in_line():
    """GenerateRequest.priority through the router (loopback fakes): refused once for full slots, the request
    waits in line at its priority (the line's start gets it) and is served."""
    full = (grpc.StatusCode.RESOURCE_EXHAUSTED, "decode_target x: hand-off failed: all 8 session slots are in use")
    c = Cluster(config=RouterConfig(call_timeout_s=2.0, migrate_wait_s=1.0, queue_s=5.0), n_decode=1)
    try:
        seen, start = [], c.servicer.line.start

        def recorded(*a, priority=0, **kw):
            seen.append(priority)
            return start(*a, priority=priority, **kw)

        c.servicer.line.start = recorded
        c.prefill[0].servicer.fail["Prefill"] = full
        assert c.run(PROMPT, max_new_tokens=4, priority=-7)[0] == reference(PROMPT, 4)
        assert c.run(PROMPT, max_new_tokens=4)[0] == reference(PROMPT, 4)
        assert seen == [-7, 0] and (c.servicer.line.waited, c.servicer.line.started) == (1, 1)
        assert c.wait_sessions_zero()
    finally:
        c.close()
