"""SlotTable (baton/engine/slots.py): sessions keyed by id, each owning one slot of a pool, with a TTL.
Invariant under test throughout: a slot is in exactly one place, a pool's free list or one live session."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from baton.engine import slots as slots_mod
from baton.engine.slots import SessionLimit, SessionNotFound, SlotTable


@dataclass(eq=False)
class Sess:
    id: str
    slot: int
    last_used: float = 0.0


class Clock:
    """A fake time.monotonic for the table (monkeypatched into baton.engine.slots)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(slots_mod, "time", SimpleNamespace(monotonic=c))
    return c


def _open(table: SlotTable, pool, sid=None, *, now: float = 1000.0, replace=False) -> Sess:
    return table.open(pool, sid, lambda s, slot: Sess(s, slot, now), replace=replace)


def _free(table: SlotTable, pool) -> list[int]:
    return sorted(table._free[pool])


def _check_invariant(table: SlotTable, pools: dict) -> None:
    """Each pool's slots: free or owned by exactly one live session, never both, never twice."""
    for pool, n in pools.items():
        owned = [s.slot for p, s in table._sessions.values() if p == pool]
        free = list(table._free[pool])
        assert sorted(owned + free) == list(range(n)), (pool, owned, free)


def test_take_publish_get_release(clock):
    t = SlotTable(60, {"r": 2})
    sid, slot = t.take("r", "a", replace=False, what="test")
    assert (sid, slot) == ("a", slot) and slot in (0, 1)
    with pytest.raises(SessionNotFound):  # reserved, not yet visible
        t.get("a")
    assert len(t) == 0 and "a" not in t
    s = t.publish("r", sid, Sess(sid, slot))
    clock.t += 5
    assert "a" in t and s.last_used == 0.0  # `in` does not touch the session (a reap's check)
    assert t.get("a") is s and len(t) == 1 and t.sessions() == [s]
    assert _free(t, "r") == [1 - slot]
    assert t.release("a") is True
    assert len(t) == 0 and _free(t, "r") == [0, 1] and "a" not in t
    with pytest.raises(SessionNotFound) as ei:
        t.get("a")
    assert "'a'" in str(ei.value) and not str(ei.value).startswith('"')  # no KeyError quoting


def test_open_without_an_id_makes_a_unique_one(clock):
    t = SlotTable(60, {0: 3})
    ids = {_open(t, 0).id for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
    assert sorted(s.slot for s in t.sessions()) == [0, 1, 2]


def test_slot_limit_is_session_limit_and_frees_on_release(clock):
    t = SlotTable(60, {0: 2})
    a, b = _open(t, 0, "a"), _open(t, 0, "b")
    assert {a.slot, b.slot} == {0, 1}
    with pytest.raises(SessionLimit, match="all decode slots are in use"):
        t.take(0, "c", replace=False, what="decode")
    assert len(t) == 2 and _free(t, 0) == []  # the refusal took nothing
    t.release("a")
    c = _open(t, 0, "c")
    assert c.slot == a.slot
    _check_invariant(t, {0: 2})


def test_a_duplicate_id_is_refused_unless_replace(clock):
    t = SlotTable(60, {0: 3})
    a = _open(t, 0, "a")
    with pytest.raises(ValueError, match="already exists"):
        t.take(0, "a", replace=False, what="x")
    assert t.get("a") is a and _free(t, 0) == sorted({0, 1, 2} - {a.slot})
    a2 = _open(t, 0, "a", replace=True)
    assert t.get("a") is a2 and a2 is not a and len(t) == 1
    _check_invariant(t, {0: 3})


def test_replace_frees_the_old_slot_even_when_the_pool_was_full(clock):
    t = SlotTable(60, {0: 1})
    a = _open(t, 0, "a")
    a2 = _open(t, 0, "a", replace=True)  # the old session's slot is the only one: reused
    assert a2.slot == a.slot == 0 and t.get("a") is a2
    _check_invariant(t, {0: 1})


def test_publish_over_a_live_session_frees_the_old_slot(clock):
    t = SlotTable(60, {0: 2})
    a = _open(t, 0, "a")
    _sid, slot = t.take(0, None, replace=False, what="x")  # a re-sent state reserves a fresh slot ...
    assert slot != a.slot
    new = t.publish(0, "a", Sess("a", slot))  # ... and replaces "a" when it commits
    assert t.get("a") is new and len(t) == 1 and _free(t, 0) == [a.slot]
    t.publish(0, "a", new)  # publishing the same object again frees nothing
    assert _free(t, 0) == [a.slot]
    _check_invariant(t, {0: 2})


def test_give_back_returns_a_reserved_slot(clock):
    t = SlotTable(60, {0: 1})
    _sid, slot = t.take(0, "a", replace=False, what="x")
    with pytest.raises(SessionLimit):
        t.take(0, "b", replace=False, what="x")
    t.give_back(0, slot)
    assert _open(t, 0, "b").slot == slot and len(t) == 1


def test_release_of_an_unknown_id_is_false_and_frees_nothing(clock):
    t = SlotTable(60, {0: 2})
    a = _open(t, 0, "a")
    assert t.release("nope") is False
    assert t.release("a") is True
    assert t.release("a") is False  # twice: the slot is not freed twice
    assert _free(t, 0) == [0, 1] and a.slot in (0, 1)
    _check_invariant(t, {0: 2})


def test_pools_are_counted_separately(clock):
    fp8, bf16 = object(), object()  # DecodeEngine keys pools by id(runner)
    t = SlotTable(60, {id(fp8): 1, id(bf16): 2})
    x = _open(t, id(fp8), "x")
    with pytest.raises(SessionLimit):  # fp8 full ...
        _open(t, id(fp8), "y")
    y, z = _open(t, id(bf16), "y"), _open(t, id(bf16), "z")  # ... bf16 still has both its slots
    assert x.slot == 0 and {y.slot, z.slot} == {0, 1}  # slot numbers are per pool
    with pytest.raises(SessionLimit):
        _open(t, id(bf16), "w")
    t.release("x")  # freeing fp8 does not make room on bf16
    with pytest.raises(SessionLimit):
        _open(t, id(bf16), "w")
    assert _free(t, id(fp8)) == [0] and _free(t, id(bf16)) == []
    t.release("y")  # a released slot goes back to its own pool
    assert _free(t, id(bf16)) == [y.slot] and _free(t, id(fp8)) == [0]
    _check_invariant(t, {id(fp8): 1, id(bf16): 2})


def test_replace_across_pools_frees_the_slot_in_the_old_pool(clock):
    t = SlotTable(60, {"fp8": 1, "bf16": 1})
    _open(t, "fp8", "a")
    b = _open(t, "bf16", "a", replace=True)  # a re-sent state for another engine
    assert t.get("a") is b and _free(t, "fp8") == [0] and _free(t, "bf16") == []
    _check_invariant(t, {"fp8": 1, "bf16": 1})


def test_ttl_expiry_reaps_idle_sessions_only(clock):
    t = SlotTable(10.0, {0: 3})
    a = _open(t, 0, "a", now=clock.t)
    b = _open(t, 0, "b", now=clock.t)
    clock.t += 6
    t.get("b")  # get() refreshes last_used
    assert b.last_used == clock.t
    clock.t += 4.5  # a idle 10.5 s > ttl, b idle 4.5 s
    assert t.reap_expired() == 1
    with pytest.raises(SessionNotFound):
        t.get("a")
    assert t.get("b") is b and _free(t, 0) == sorted({0, 1, 2} - {b.slot})
    clock.t += 10.0  # exactly ttl idle: not yet expired (strictly older)
    assert t.reap_expired() == 0
    clock.t += 0.5
    assert t.reap_expired() == 1 and len(t) == 0 and _free(t, 0) == [0, 1, 2]
    assert a.slot != b.slot


def test_take_reaps_expired_sessions_first(clock):
    t = SlotTable(5.0, {0: 1})
    _open(t, 0, "old", now=clock.t)
    with pytest.raises(SessionLimit):
        _open(t, 0, "new", now=clock.t)
    clock.t += 5.1  # "old" expired: take() reaps it and reuses its slot
    new = _open(t, 0, "new", now=clock.t)
    assert new.slot == 0 and [s.id for s in t.sessions()] == ["new"]


def test_every_slot_is_free_again_after_random_takes_and_releases(clock):
    pools = {"a": 4, "b": 3, "c": 1}
    t = SlotTable(1e9, pools)
    rng = random.Random(1234)
    live: dict[str, str] = {}
    refused = 0
    for i in range(2000):
        op = rng.random()
        pool = rng.choice(list(pools))
        if op < 0.45:
            try:
                s = _open(t, pool, f"s{i}")
                live[s.id] = pool
            except SessionLimit:
                refused += 1
                assert sum(1 for p in live.values() if p == pool) == pools[pool]
        elif op < 0.55 and live:  # re-send an existing id into some pool
            sid = rng.choice(sorted(live))
            try:
                _open(t, pool, sid, replace=True)
                live[sid] = pool
            except SessionLimit:
                live.pop(sid)  # the old session was dropped before the refusal
                refused += 1
        elif op < 0.62:  # a reservation that never opens
            try:
                _, slot = t.take(pool, None, replace=False, what="x")
                t.give_back(pool, slot)
            except SessionLimit:
                refused += 1
        elif live:
            sid = rng.choice(sorted(live))
            assert t.release(sid) is True
            del live[sid]
        else:
            assert t.release(f"gone{i}") is False
        assert len(t) == len(live)
        _check_invariant(t, pools)
    assert refused > 0  # the limits were actually hit
    for sid in list(live):
        assert t.release(sid)
    assert len(t) == 0
    assert {p: _free(t, p) for p in pools} == {p: list(range(n)) for p, n in pools.items()}


class _CountingLock:
    """A lock that counts its acquisitions (stands in for SlotTable._lock)."""

    def __init__(self):
        self._lock, self.acquired = threading.Lock(), 0

    def __enter__(self):
        self._lock.acquire()
        self.acquired += 1

    def __exit__(self, *exc):
        self._lock.release()


def test_the_reaper_chooses_and_frees_under_one_hold_of_the_lock(clock):
    """Choosing the expired sessions and freeing their slots must be one critical section: between
    two, a get() could hand out a session whose slot the reaper then frees (and take() gives away)."""
    t = SlotTable(10.0, {0: 2})
    _open(t, 0, "a", now=clock.t)
    _open(t, 0, "b", now=clock.t + 5)
    clock.t += 11  # "a" idle past its TTL, "b" not
    t._lock = lock = _CountingLock()
    assert t.reap_expired() == 1
    assert lock.acquired == 1
    assert [x.id for x in t.sessions()] == ["b"] and len(_free(t, 0)) == 1


def test_a_session_used_while_the_reaper_runs_is_either_reaped_first_or_kept(clock):
    """A get() racing the reaper: either the reaper wins (get raises NotFound) or get wins and the
    session stays live with its slot; never a session handed out and then freed. The race window is
    narrow, so this rarely catches the old two-step reaper: the lock-count test above is the one that
    fails on it deterministically."""
    for _ in range(200):
        t = SlotTable(10.0, {0: 1})
        _open(t, 0, "a", now=clock.t)
        clock.t += 11
        got, start = [], threading.Barrier(2)

        def user():
            start.wait()
            try:
                got.append(t.get("a"))
            except SessionNotFound:
                pass

        th = threading.Thread(target=user)
        th.start()
        start.wait()
        t.reap_expired()
        th.join()
        if got:  # get() won: it refreshed last_used, so the session must still be live
            assert t.get("a") is got[0] and _free(t, 0) == []
        else:
            assert len(t) == 0 and _free(t, 0) == [0]


def test_reserved_counts_slots_taken_for_states_not_yet_published(clock):
    """SlotTable.reserved: a state being received holds a slot no session shows (mtp_launch.landing reads it)."""
    t = SlotTable(ttl_s=60.0, pools={"a": 2, "b": 1})
    assert t.reserved() == 0
    sid, slot = t.take("a", "s1", replace=False, what="a")
    _, slot2 = t.take("b", "s2", replace=False, what="b")
    assert t.reserved() == 2
    t.publish("a", sid, Sess(sid, slot))
    assert t.reserved() == 1 and len(t) == 1
    t.give_back("b", slot2)  # a stream that failed: its slot back, nothing published
    assert t.reserved() == 0
    t.release(sid)
    assert t.reserved() == 0 and len(t) == 0
