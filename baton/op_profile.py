"""A window of torch.profiler over a worker's exact-round batches: which ops and kernels a served round's
batch runs, and how much of its wall time this process's kernels fill (the rest is its host, or the GPU busy
with another process: the other worker, on one GPU). A diagnostic, off unless asked.

    BATON_OP_PROFILE=PATH               the report, written once the window closes ("{role}", "{pid}" filled)
    BATON_OP_PROFILE_WINDOW=A:N[:M]     run unprofiled until A batches of at least M items (default 1) ran,
                                        then profile the next N batches of any size; default 200:100:1

    run_batch = op_profile.window(run_batch, "decode")   # run_batch itself when BATON_OP_PROFILE is unset
    op_profile.finish()                                  # at the clean stop: an open window closed, reports waited for
    prof = op_profile.profiler()                         # a torch profiler of CPU ops (every thread's) and kernels
    text = op_profile.tables(prof)                       # a finished torch.profiler.profile's op tables

Wired around the Draft batches (decode_worker/engine.py) and the Verify batches (prefill_worker/engine.py).
Lifecycle: the profiler starts as the window's first batch starts and stops as its N-th batch ends (batches
of one Gather run one at a time, under its lock); a daemon thread starts it, stops it (torch's profiler
must stop on the thread that started it, and the batches' threads take turns) and writes the report.
Everything the process runs in between is recorded (CPU ops of every thread where torch has
profile_all_threads, and every kernel), so a prefill pass interleaved with the Verify batches shows too; the
report's head gives the window's wall time, the time spent inside the batches, and the summed device time
of the process's kernels. A process profiles one window once.

Cost: the profiler slows every op it records, and stopping it and building the report hold the process (and
its GIL) for seconds after the window (32 exact streams on an H100 gave 479 tok/s with a window, against
1,840-1,871 unprofiled on two other H100s):
a run's figures around a window are not its speed; the proportions inside the window are what this gives.
The report says how long it took to build.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

ENV, WINDOW_ENV = "BATON_OP_PROFILE", "BATON_OP_PROFILE_WINDOW"
DEFAULT_WINDOW = (200, 100, 1)
log = logging.getLogger("baton.op_profile")


def parse_window(text: str | None) -> tuple[int, int, int]:
    """ "A:N[:M]" -> (A, N, M); None or "" -> DEFAULT_WINDOW. ValueError on a malformed or negative one."""
    if not text:
        return DEFAULT_WINDOW
    parts = [int(p) for p in text.split(":")]
    if len(parts) not in (2, 3) or min(parts) < 0 or parts[1] < 1:
        raise ValueError(f"{WINDOW_ENV}: {text!r}, want A:N[:M] (A, M >= 0, N >= 1)")
    return (parts[0], parts[1], parts[2] if len(parts) == 3 else 1)


def _device_us(e) -> float:
    """An op's self device time, us (torch's name for it changed: self_device_time_total, self_cuda_...)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, name, None)
        if v is not None:
            return float(v)
    return 0.0


def profiler():
    """A torch profiler of CPU ops (every thread's, where torch can: profile_all_threads) and CUDA kernels."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        from torch._C._profiler import _ExperimentalConfig

        return profile(activities=acts, experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except (ImportError, TypeError):  # an older torch: the starting thread's ops (and every kernel) only
        return profile(activities=acts)


def tables(prof, rows: int = 30) -> str:
    """The op tables of a finished profile: by self CPU time, and (when it recorded kernels) by device time."""
    ka = prof.key_averages()
    text = ["# by self CPU time", ka.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if any(_device_us(e) for e in ka):
        key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
        text += ["# by device time", ka.table(sort_by=key, row_limit=rows)]
    return "\n".join(text)


class Window:
    """run_batch wrapped: counts its batches, profiles the window (module doc)."""

    def __init__(self, fn, path: str, skip: int, count: int, min_items: int):
        self.fn, self.path, self.skip, self.count, self.min_items = fn, path, skip, count, min_items
        self.counted = 0  # batches of >= min_items items seen before the window
        self.profiled = 0  # batches run inside the window
        self.items = 0
        self.in_batches = 0.0  # seconds inside fn during the window
        self.prof = None
        self.done = threading.Event()  # set once the report is written (or failed)
        self._end = threading.Event()  # the window closed: the profiler thread stops and writes
        self._t0 = self._wall = 0.0
        self._started = False

    def __call__(self, items):
        if self.done.is_set() or self.profiled >= self.count:
            return self.fn(items)
        if not self._started:
            if self.counted < self.skip:
                self.counted += len(items) >= self.min_items
                return self.fn(items)
            self._started = True
            self._start()
        t0 = time.perf_counter()
        try:
            return self.fn(items)
        finally:
            self.in_batches += time.perf_counter() - t0
            self.profiled += 1
            self.items += len(items)
            if self.profiled >= self.count:
                self._stop()

    def _start(self) -> None:
        """Starts the profiler on a thread of its own, which stops it when _stop says so: torch's profiler
        must be stopped on the thread that started it, and the batches' threads take turns."""
        started = threading.Event()
        threading.Thread(target=self._profile, args=(started,), name="baton-op-profile", daemon=True).start()
        started.wait(30)
        self._t0 = time.perf_counter()
        log.info("op profile: started (%s)", self.path)

    def _stop(self) -> None:
        self._wall = time.perf_counter() - self._t0
        self._end.set()

    def _profile(self, started: threading.Event) -> None:
        try:
            self.prof = profiler()
            self.prof.start()
        except Exception:  # noqa: BLE001 - a diagnostic must not fail a batch
            log.exception("op profile: start failed")
            self.done.set()
            return
        finally:
            started.set()
        self._end.wait()
        try:
            t0 = time.perf_counter()
            self.prof.stop()
            self._write(self._wall, t0)
        except Exception:  # noqa: BLE001
            log.exception("op profile: stop failed")
            self.done.set()

    def _write(self, wall: float, stopping: float) -> None:
        try:
            ka = self.prof.key_averages()
            device_s = sum(_device_us(e) for e in ka) / 1e6
            text = tables(self.prof)
            head = (
                f"# op profile, pid {os.getpid()}: {self.profiled} batches ({self.items} items) after "
                f"{self.skip} of >= {self.min_items} items\n"
                f"# window {wall:.3f} s, inside the batches {self.in_batches:.3f} s, the process's kernels "
                f"{device_s:.3f} s of device time\n"
                f"# stopping the profiler and building this took {time.perf_counter() - stopping:.1f} s\n"
            )
            Path(self.path).write_text(head + text + "\n")
            log.info("op profile: written to %s", self.path)
        except Exception:  # noqa: BLE001
            log.exception("op profile: writing %s failed", self.path)
        finally:
            self.done.set()


_WINDOWS: list[Window] = []  # this process's windows (finish() at its clean stop)


def window(fn, role: str):
    """fn wrapped in a profiling Window when BATON_OP_PROFILE is set (module doc), else fn itself."""
    path = os.environ.get(ENV)
    if not path:
        return fn
    skip, count, min_items = parse_window(os.environ.get(WINDOW_ENV))
    w = Window(fn, path.replace("{role}", role).replace("{pid}", str(os.getpid())), skip, count, min_items)
    _WINDOWS.append(w)
    return w


def finish(timeout_s: float = 120.0) -> list[str]:
    """At a worker's clean stop (baton/worker/process.py): a window still open is closed with the batches it
    has (its report says how many), and every started window's report is waited for (building one takes
    seconds: the process must not exit under it). -> the reports written."""
    end = time.monotonic() + timeout_s
    for w in _WINDOWS:
        if w._started and not w._end.is_set():
            w._stop()
    for w in _WINDOWS:
        if w._started:
            w.done.wait(max(0.0, end - time.monotonic()))
    return [w.path for w in _WINDOWS if w._started and w.done.is_set() and Path(w.path).exists()]
