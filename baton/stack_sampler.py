"""A sampling profiler of a worker process's Python threads: where the host time of the gRPC handlers, the
batch leaders and the step threads goes, on a machine with no py-spy (the GPU machine installs nothing).
A diagnostic, off unless asked.

    BATON_STACK_SAMPLES=PATH        start(role) samples every thread (a worker: baton/worker/process.py ready;
                                    the router: router/__main__.py, deploy/local.py); the report is written to
                                    PATH at write() (after the clean stop); "{role}" and "{pid}" are filled in
    BATON_STACK_INTERVAL_MS=10      the sampling period

Every period the sampler thread reads sys._current_frames() (it holds the GIL for that moment, so a sample
lands where a thread was when it last let the GIL go or was switched out: running Python, or blocked in
native code such as a lock, a CUDA call or a gRPC wait). Per thread group (thread_cpu.group_of of the
thread's name) it counts each stack: the innermost function ("self") and every function on it ("total").
The report: per group its samples, the functions with the most self and total samples, and the most
frequent whole stacks, collapsed one to a line ("group;outer;...;inner count", flamegraph.pl's input).
Costs one walk of every thread's frames a period, holding the GIL: 0.19 ms for 40 threads 24 frames deep on
a 2-core CPU (stacks are kept as code objects, named only in the report), 1.9% at 10 ms
(benchmarks/bench_stack_sampler.py, results/stack-sampler-cpu-2026-12-05.json).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

from baton.thread_cpu import group_of

ENV, INTERVAL_ENV = "BATON_STACK_SAMPLES", "BATON_STACK_INTERVAL_MS"
MAX_DEPTH = 40  # frames kept per stack, innermost first
_state: dict = {}


def _where(code) -> str:
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


class Sampler:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.stacks: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter = collections.Counter()
        self._groups: dict[int, str] = {}  # thread ident -> its group (a reused ident keeps the first name's)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="baton-stack-sampler", daemon=True)
        self.started = time.monotonic()

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def sample(self) -> None:
        """One sample of every other thread's stack (kept as code objects: named only in the report)."""
        me = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            group = self._groups.get(ident)
            if group is None:  # a thread not seen yet: its name's group, once
                names = {t.ident: t.name for t in threading.enumerate()}
                group = self._groups[ident] = group_of(names.get(ident, f"thread-{ident}"))
            stack = []
            while frame is not None and len(stack) < MAX_DEPTH:
                stack.append(frame.f_code)
                frame = frame.f_back
            self.stacks[group][tuple(stack)] += 1
            self.samples[group] += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.interval_s + 1)

    def report(self, top: int = 25) -> str:
        """The text report (module doc)."""
        wall = time.monotonic() - self.started
        out = [f"# stack samples every {self.interval_s * 1e3:g} ms over {wall:.1f} s (pid {os.getpid()})"]
        for group, n in self.samples.most_common():
            own, total = collections.Counter(), collections.Counter()
            for stack, c in self.stacks[group].items():
                own[_where(stack[0])] += c
                for f in {_where(code) for code in stack}:
                    total[f] += c
            out.append(f"\n## {group}: {n} samples")
            out.append("self: " + ", ".join(f"{f} {c / n:.1%}" for f, c in own.most_common(top)))
            out.append("total: " + ", ".join(f"{f} {c / n:.1%}" for f, c in total.most_common(top)))
        out.append("\n## collapsed stacks (group;outer;...;inner count)")
        flat = collections.Counter()
        for group, stacks in self.stacks.items():
            for stack, c in stacks.items():
                flat[";".join([group, *(_where(code) for code in reversed(stack))])] += c
        out += [f"{s} {c}" for s, c in flat.most_common(20 * top)]
        return "\n".join(out) + "\n"


def start(role: str) -> Sampler | None:
    """Starts the process's sampler when BATON_STACK_SAMPLES is set (once; later calls return it)."""
    path = os.environ.get(ENV)
    if not path:
        return None
    if "sampler" not in _state:
        interval = float(os.environ.get(INTERVAL_ENV, "10")) / 1e3
        _state["path"] = path.format(role=role, pid=os.getpid())
        _state["sampler"] = Sampler(interval).start()
    return _state["sampler"]


def write() -> str | None:
    """Stops the sampler, if one runs, and writes its report -> the path written (None: none ran)."""
    s = _state.pop("sampler", None)
    if s is None:
        return None
    s.stop()
    with open(_state["path"], "w") as f:
        f.write(s.report())
    return _state["path"]
