"""prefill_worker/announced.py: equal prompts announced by their callers (PrefillRequest.equal_prompts) are
expected by a pass's leader until they arrive, and a group whose calls never come stops counting."""

from __future__ import annotations

from prefill_worker.announced import MAX_GROUP, Announced


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_group_counts_the_calls_still_to_come():
    a = Announced(clock=_Clock())
    a.arrive([1, 2, 3], 4)
    assert a.pending() == 3
    a.arrive([1, 2, 3], 4)
    a.arrive([9], 2)  # another prompt's group
    assert a.pending() == 2 + 1
    a.arrive([1, 2, 3], 4)
    a.arrive([1, 2, 3], 4)  # the fourth: the group is complete
    a.arrive([9], 2)
    assert a.pending() == 0
    a.arrive([1, 2, 3], 4)  # a later request of the same prompt: a new group
    assert a.pending() == 3


def test_no_announcement_and_the_cap():
    a = Announced(clock=_Clock())
    a.arrive([1], 0)
    a.arrive([1], 1)
    assert a.pending() == 0
    a.arrive([2], 10**6)
    assert a.pending() == MAX_GROUP - 1


def test_a_group_whose_calls_never_come_stops_counting():
    clock = _Clock()
    a = Announced(expire_s=0.5, clock=clock)
    a.arrive([1, 2], 8)
    clock.t += 0.4
    assert a.pending() == 7
    clock.t += 0.2
    assert a.pending() == 0
    a.arrive([1, 2], 8)  # arrives after its group expired: starts a new one
    assert a.pending() == 7
