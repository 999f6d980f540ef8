"""Which threads of this process use its CPU: CPU seconds (user + system) per group of threads, from the
kernel's per-thread counters (Linux: /proc/self/task/TID/stat; elsewhere nothing is reported).

    read() -> {group: seconds}      the CPU each group's live threads used since they started
    share(before, after, wall_s)    -> {group: CPU seconds per wall second} between two reads

Why. A worker's step thread that waits for the GIL shows as a long launch phase (baton/engine/scheduler.py)
and a late stall probe (baton/stalls.py), but neither says who holds the GIL. Python code runs only with
the GIL, so the CPU a thread spends outside C code that drops it (torch kernels, hashing, socket I/O) is
time it held the GIL: under a busy GIL the groups' shares say where it goes (the gRPC handler threads of
the Decode streams and the hand-off's receive, grpc's server loop, the step thread itself).

Groups. A thread Python knows goes by its name with its trailing counters cut: "ThreadPoolExecutor-0_12"
-> "ThreadPoolExecutor", "baton-rpc_3" -> "baton-rpc" (the workers' gRPC handlers), "Thread-153 (run)" ->
"Thread (run)", "baton-steps" as it is. A thread Python
does not know (gRPC's C-core pollers and timers, torch's intra-op pool) goes by the kernel's name of it,
"os:" first ("os:grpc_global_tim"); the process's main thread is "main". Counters are per live thread: a
thread that ended takes its seconds with it, so a share over a window counts only threads alive at its
end (the pools' threads live as long as the worker; a group's share never goes below 0).
Cost: one small /proc read a thread, on demand (GetStats), nothing in between.
"""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from typing import Iterator

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_COUNTER = re.compile(r"[-_]\d+")


_calls: dict[str, float] = {}
_calls_lock = threading.Lock()


@contextmanager
def charged(name: str) -> Iterator[None]:
    """Adds the CPU this thread uses inside the block to the group "rpc:" + name (when the block ends)."""
    t0 = time.thread_time()
    try:
        yield
    finally:
        used = time.thread_time() - t0
        with _calls_lock:
            _calls[name] = _calls.get(name, 0.0) + used


def group_of(name: str) -> str:
    """A thread's group: its name without the counters Python and pools number threads with."""
    return re.sub(r"\s+", " ", _COUNTER.sub("", name)).strip() or name


def stat_cpu_s(path: str) -> float | None:
    """utime + stime, s, of a /proc stat file (/proc/PID/stat: a process's own threads; /proc/self/task/TID/stat:
    one thread); None when it is gone (or no /proc)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) ": state is field 3, utime 14
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _cpu_s(tid: int) -> float | None:
    """utime + stime of thread `tid` of this process, s; None when it is gone (or no /proc)."""
    return stat_cpu_s(f"/proc/self/task/{tid}/stat")


def _comm(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def read() -> dict[str, float]:
    """{group: CPU seconds of its live threads, and "rpc:NAME": of the calls `charged` so far}; {} where
    /proc/self/task is not there."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    named = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    for tid in tids:
        secs = _cpu_s(tid)
        if secs is None:
            continue
        if tid == main:
            group = "main"
        elif tid in named:
            group = group_of(named[tid])
        else:
            group = "os:" + group_of(_comm(tid))
        out[group] = out.get(group, 0.0) + secs
    with _calls_lock:
        out.update({f"rpc:{k}": v for k, v in _calls.items()})
    return out


def share(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """{group: CPU seconds per wall second} from `before` to `after` (reads of the same process or summed
    over processes), largest first; groups below 0.5% left out."""
    if wall_s <= 0:
        return {}
    got = {g: max(0.0, s - before.get(g, 0.0)) / wall_s for g, s in after.items()}
    return {g: round(v, 4) for g, v in sorted(got.items(), key=lambda kv: -kv[1]) if v >= 0.005}
