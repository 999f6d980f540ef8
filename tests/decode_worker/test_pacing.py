"""decode_worker/pacing.py: the grouping streams share the message budget; each waits out the rest of its
interval after a message, and no longer than MAX_WAIT_S."""

from __future__ import annotations

import time

import pytest

from decode_worker.pacing import MAX_WAIT_S, MessagePace


def test_the_interval_grows_with_the_streams_and_is_capped():
    pace = MessagePace(1000)
    assert pace.interval() == 0.0
    with pace.stream(), pace.stream():
        assert pace.active == 2 and pace.interval() == pytest.approx(0.002)
        with pace.stream(), pace.stream(), pace.stream():
            assert pace.interval() == pytest.approx(0.005)
    assert pace.active == 0
    many = MessagePace(10)
    with many.stream():
        assert many.interval() == MAX_WAIT_S  # 0.1 s uncapped
    assert MessagePace(0).interval() == 0.0  # off
    off = MessagePace(0)
    with off.stream() as wait:  # off: nothing counted, wait() returns at once
        assert off.active == 0 and wait() is None
    with pytest.raises(ValueError, match=">= 0"):
        MessagePace(-1)


def test_wait_sleeps_out_the_rest_of_the_interval():
    pace = MessagePace(40)  # one stream: 25 ms
    with pace.stream() as wait:
        t0 = time.monotonic()
        for _ in range(4):
            wait()
        took = time.monotonic() - t0
        assert 0.09 <= took < 0.5, took
        time.sleep(0.03)  # the interval passed already: no wait
        t1 = time.monotonic()
        wait()
        assert time.monotonic() - t1 < 0.01
    assert pace.active == 0
