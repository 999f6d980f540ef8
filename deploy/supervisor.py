"""Supervisor: `baton serve --processes` restarting the worker processes that exit on their own.

Lifecycle of a worker under it (deploy/processes.py: WorkerProcess): it exits on its own -> restarted on
the same port after 1, 2, 4 ... 30 s; one that exits more than `max_restarts` times in RESTART_WINDOW_S (a
failed restart counts) is given up on: GaveUp, and `baton serve` stops and exits 1.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from deploy.processes import Progress, StartupError, WorkerProcess


class GaveUp(RuntimeError):
    """A worker kept exiting: the Supervisor stopped restarting it (the message says which, how often, why)."""


RESTART_WINDOW_S = 600.0  # a worker's exits counted over the last 10 minutes
DEFAULT_MAX_RESTARTS = 5


class Supervisor:
    """Restarts a worker process that exited on its own (what Ray's max_restarts does for actors), on
    the same port, so the router's address for it stays valid; backs off 1, 2, 4 ... 30 s on repeats.
    A worker that exits more than `max_restarts` times within `window` s (a restart that fails to come
    up is an exit too) is not started again: check() raises GaveUp (max_restarts < 0: restart forever).

    NOTE: call check() from the main thread: PR_SET_PDEATHSIG fires when the *thread* that forked a
    child exits, so a worker started from a short-lived thread would be killed with it.
    `workers` is the caller's list (shared with its clean-up); a restart replaces the entry in place."""

    def __init__(
        self,
        workers: list[WorkerProcess],
        *,
        progress: Progress,
        timeout: float,
        settings=None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        window: float = RESTART_WINDOW_S,
    ):
        self.workers, self.progress, self.timeout, self.settings = workers, progress, timeout, settings
        self.max_restarts, self.window = max_restarts, window
        self._failures: dict[int, int] = {}
        self._next_try: dict[int, float] = {}
        self._exits: dict[int, list[float]] = {}  # worker -> the times it exited, within the window

    def check(self, stop: threading.Event | None = None) -> None:
        for i, w in enumerate(list(self.workers)):
            if w.proc is None or w.proc.poll() is None or w._terminated:
                continue
            if i not in self._next_try:
                now = time.monotonic()
                exits = self._exits[i] = [t for t in self._exits.get(i, []) if now - t < self.window] + [now]
                if 0 <= self.max_restarts < len(exits):
                    raise GaveUp(
                        f"{w.spec.name}: {len(exits)} exits within {self.window:.0f} s (the last with code "
                        f"{w.proc.returncode}), more than --max-restarts {self.max_restarts}: giving up"
                    )
                n = self._failures[i] = self._failures.get(i, 0) + 1
                self._next_try[i] = time.monotonic() + min(30.0, 2.0 ** (n - 1))
                self.progress.say(
                    f"{w.spec.name} exited (code {w.proc.returncode}): restarting "
                    f"in {self._next_try[i] - time.monotonic():.0f} s"
                )
            if time.monotonic() >= self._next_try[i]:
                self._restart(i, w, stop)

    def _restart(self, i: int, old: WorkerProcess, stop: threading.Event | None) -> None:
        del self._next_try[i]
        port = int(old.address.rsplit(":", 1)[1]) if old.address else old.spec.port
        new = WorkerProcess(replace(old.spec, port=port), env=old._env)
        self.workers[i] = new.start()
        t0 = time.monotonic()
        try:
            addr = new.wait_ready(timeout=self.timeout, stop=stop, settings=self.settings)
        except StartupError as e:
            self.progress.say(f"{old.spec.name} restart failed: {e}")
            new.stop(grace=1.0)
            new._terminated = False  # NOTE: dead, not stopped by us: the next check() tries again
            return
        self._failures[i] = 0
        self.progress.say(f"{old.spec.name} ready again on {addr} ({time.monotonic() - t0:.1f} s)")
