"""How late a Python thread of this process gets to run: the GIL held by another thread, a garbage
collection, or the OS. A serving process whose decode steps are launched from Python stalls with it.

    start()             one daemon probe thread per process (idempotent): it sleeps PERIOD_S at a time and
                        records how late each wake-up ran Python code (lateness beyond the sleep)
    read(reset=False)   -> (p99 s, max s, share): over the wake-ups in the window (at most WINDOW, ~20 s),
                        the 99th percentile and the largest lateness, and the share of the window's wall
                        time the probe spent late; (0, 0, 0) when the probe never started. reset=True
                        starts a new window (a benchmark's point)

Started by the worker process mains and Ray actors once ready (baton/worker/process.py: ready), not
by serve_*(): a test process starts many servers. Cost: 200 wake-ups a second, a clock read and an append
each. On a host with spare cores the OS adds little, so the lateness is the GIL's (benchmarks/gil_probe.py
measures the same thing against a hand-off, the OS's share apart).
"""

from __future__ import annotations

import collections
import threading
import time

PERIOD_S = 0.005
WINDOW = 4096  # wake-ups kept: ~20 s at PERIOD_S

_late: collections.deque = collections.deque(maxlen=WINDOW)
_lock = threading.Lock()
_thread: threading.Thread | None = None


def _run() -> None:
    while True:
        t0 = time.perf_counter()
        time.sleep(PERIOD_S)
        late = max(0.0, time.perf_counter() - t0 - PERIOD_S)
        with _lock:
            _late.append(late)


def start() -> None:
    """The probe thread, once per process."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="baton-stall-probe", daemon=True)
            _thread.start()


def read(reset: bool = False) -> tuple[float, float, float]:
    """(p99, max, share) of the window's lateness (see the module doc)."""
    with _lock:
        xs = sorted(_late)
        if reset:
            _late.clear()
    if not xs:
        return 0.0, 0.0, 0.0
    total = sum(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))], xs[-1], total / (total + len(xs) * PERIOD_S)
