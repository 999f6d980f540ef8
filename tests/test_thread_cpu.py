"""baton/thread_cpu.py: CPU seconds per thread group, from the kernel's per-thread counters."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from baton import thread_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task is Linux's")


def test_groups_cut_the_counters_pools_number_threads_with():
    assert thread_cpu.group_of("ThreadPoolExecutor-0_12") == "ThreadPoolExecutor"
    assert thread_cpu.group_of("Thread-153 (run)") == "Thread (run)"
    assert thread_cpu.group_of("baton-steps") == "baton-steps"
    assert thread_cpu.group_of("baton-rpc_3") == "baton-rpc"
    assert thread_cpu.group_of("7") == "7"  # nothing left: the name as it is


def test_a_busy_thread_shows_in_its_group_and_an_idle_one_does_not():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(2000))

    busy = [threading.Thread(target=spin, name=f"spinner-{i}") for i in range(2)]
    idle = threading.Thread(target=stop.wait, name="sleeper-1")
    for t in (*busy, idle):
        t.start()
    try:
        before, t0 = thread_cpu.read(), time.monotonic()
        time.sleep(0.6)
        after, wall = thread_cpu.read(), time.monotonic() - t0
    finally:
        stop.set()
        for t in (*busy, idle):
            t.join()
    got = thread_cpu.share(before, after, wall)
    # two spinners share the GIL: together about one core's worth (at least a third on a busy 2-core box)
    assert got.get("spinner", 0.0) >= 0.3, got
    assert "sleeper" not in got, got
    assert list(got.values()) == sorted(got.values(), reverse=True)
    assert after["spinner"] >= before.get("spinner", 0.0) + 0.1


def test_share_clamps_ended_threads_and_drops_small_groups():
    got = thread_cpu.share({"a": 5.0, "b": 1.0, "c": 0.0}, {"a": 2.0, "b": 3.0, "c": 0.004}, 2.0)
    assert got == {"b": 1.0}  # a: its threads ended (never < 0, left out); c: under 0.5%
    assert thread_cpu.share({}, {"a": 1.0}, 0.0) == {}


def test_a_charged_call_counts_its_own_cpu_and_not_its_sleep():
    before = thread_cpu.read().get("rpc:spin-call", 0.0)
    with thread_cpu.charged("spin-call"):
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            sum(range(2000))
        time.sleep(0.3)  # waiting uses no CPU: not charged
    got = thread_cpu.read()["rpc:spin-call"] - before
    assert 0.18 <= got < 0.45, got
    with pytest.raises(KeyError), thread_cpu.charged("failing-call"):
        raise KeyError("x")  # a call that raises is charged too
    assert "rpc:failing-call" in thread_cpu.read()
