"""decode_worker/call_waits.py: a Decode call's two waits before its first message (WorkerStats
decode_called_s_*, decode_first_message_s_*)."""

from __future__ import annotations

import time

from baton.v1 import common_pb2
from decode_worker.call_waits import CallWaits


def test_a_first_call_records_its_wait_from_the_commit_a_later_call_only_its_first_message():
    w = CallWaits()
    entered = w.called(time.monotonic() - 0.25)  # a session committed 250 ms ago: its first Decode call
    time.sleep(0.01)
    w.asked(entered)  # the handler's set-up done: the engine is asked
    time.sleep(0.02)
    w.first(entered)
    later = w.called(None)  # a later call of a session: no commit to measure from
    w.first(later)
    assert len(w.loaded_to_called) == 1 and 0.25 <= w.loaded_to_called[0] < 5
    assert len(w.called_to_first) == 2 and w.called_to_first[0] >= 0.03
    assert len(w.called_to_asked) == 1 and 0.01 <= w.called_to_asked[0] <= w.called_to_first[0] - 0.02
    out = common_pb2.WorkerStats()
    w.fill(out)
    assert 0.25 <= out.decode_called_s_p50 == out.decode_called_s_p99 < 5
    assert out.decode_first_message_s_p50 <= out.decode_first_message_s_p99
    assert out.decode_first_message_s_p99 >= 0.03
    assert 0.01 <= out.decode_setup_s_p50 == out.decode_setup_s_p99 < out.decode_first_message_s_p99
    w.fill(out, reset=True)  # reported, then the windows start again
    assert out.decode_called_s_p50 > 0
    again = common_pb2.WorkerStats()
    w.fill(again)
    assert again.decode_called_s_p99 == again.decode_first_message_s_p99 == again.decode_setup_s_p99 == 0.0


def test_a_commit_stamped_after_the_entry_counts_as_no_wait():
    """created comes from another thread's clock read: a call that starts first records 0, not a negative wait."""
    w = CallWaits()
    w.called(time.monotonic() + 1.0)
    assert list(w.loaded_to_called) == [0.0]
