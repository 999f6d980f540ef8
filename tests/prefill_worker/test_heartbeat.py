"""prefill_worker/heartbeat.py: beats only where progress was made, the prefill's result or error comes through,
and a generator closed at a beat (the client went away) returns only once the prefill ended."""

from __future__ import annotations

import threading

import pytest

from prefill_worker.heartbeat import HEARTBEAT, beating, passes_moved


def _drain(gen):
    beats = 0
    try:
        while True:
            assert next(gen) is HEARTBEAT
            beats += 1
    except StopIteration as stop:
        return beats, stop.value


def test_beats_only_while_progress_is_made_then_the_result():
    ended = threading.Event()
    checks = iter([True, False, True] + [False] * 1000)
    threading.Timer(0.5, ended.set).start()
    beats, value = _drain(beating(lambda: ended.wait(5) and 42, 0.05, lambda: next(checks)))
    assert (beats, value) == (2, 42)


def test_the_prefills_error_is_raised():
    def boom():
        raise ValueError("prompt_ids: nope")

    with pytest.raises(ValueError, match="nope"):
        _drain(beating(boom, 0.05, lambda: True))


def test_closed_at_a_beat_it_waits_for_the_prefill_to_end():
    release, done = threading.Event(), []

    def prefill():
        release.wait(5)
        done.append(1)
        return 7

    gen = beating(prefill, 0.02, lambda: True)
    assert next(gen) is HEARTBEAT
    threading.Timer(0.3, release.set).start()
    gen.close()  # GeneratorExit at the yield: returns only after prefill() ended (its slot is then free)
    assert done == [1]


def test_passes_moved_reads_the_engines_pass_count():
    class Engine:
        pass_totals = [3, 0, 0, 0.0]

    e = Engine()
    moved = passes_moved(e)
    assert moved() is False
    e.pass_totals = [4, 1, 10, 0.1]
    assert moved() is True and moved() is False
