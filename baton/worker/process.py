"""A worker process's life: serve until a signal, then drain and exit.

signals = StopSignals(role)          first thing in main: SIGINT/SIGTERM while starting (the imports, the
                                     model load, graph capture, warm-up) raise LoadInterrupted, so the
                                     start-up unwinds and main returns 0 (was: killed by the signal, -15);
                                     a "still starting" line every 30 s until serving
serve_*(...) -> (WorkerHandle, servicer)
    model loaded -> engine -> gRPC server bound -> health SERVING
run_until_signal(role, handle, grace, signals)
                                     prints "<role>: serving on HOST:PORT"; SIGINT/SIGTERM ->
                                     health NOT_SERVING -> stop(grace) -> servicer.close()
exit_process(code)                   flush, os._exit: no interpreter teardown (see its note)"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

from baton import op_profile, stack_sampler, stalls
from baton.heap import freeze_startup_heap
from baton.rpc import ServerHandle, build_server
from baton.settings import Settings
from baton.worker.options import DEFAULT_GRACE_S
from baton.worker.servicer import ServicerBase

log = logging.getLogger("baton.worker")


class WorkerHandle(ServerHandle):
    """A ServerHandle whose stop() also closes the servicer (reaper thread, cached channels)."""

    def __init__(self, base: ServerHandle, servicer: "ServicerBase"):
        super().__init__(base.server, base.host, base.port, base.health, base.service_names)
        self.servicer = servicer

    def stop(self, grace: float | None = None) -> None:
        try:
            super().stop(grace)
        finally:
            self.servicer.close()


def ready(role: str, settings: Settings) -> None:
    """A worker's process is ready to serve: its start-up heap frozen out of the collector (baton/heap.py),
    its GIL switch interval set (settings.switch_interval_us) and its stall probe started (baton/stalls.py:
    WorkerStats' stall_* fields). The process mains and the Ray actors call it once, never serve_*() (a
    test process starts many servers)."""
    freeze_startup_heap(role)
    sys.setswitchinterval(settings.switch_interval_us / 1e6)
    log.info("%s: GIL switch interval %d us", role, settings.switch_interval_us)
    stalls.start()
    stack_sampler.start(role)  # BATON_STACK_SAMPLES only (baton/stack_sampler.py)


class LoadInterrupted(BaseException):
    """SIGINT / SIGTERM while the worker was starting: its start-up unwinds, and the process exits 0."""


class StopSignals:
    """A worker's SIGINT / SIGTERM handling from the first line of its main to its exit.

    While starting (imports, model load, graph capture, warm-up: minutes on a GPU, and no port open yet) a
    signal raises LoadInterrupted in the main thread, between two Python steps (a long native call, one
    tensor's read, finishes first), so main unwinds and returns 0 at once; a thread logs "still starting"
    every `every` s meanwhile. Once serving() is called a signal only sets `done` (run_until_signal drains)."""

    def __init__(self, role: str, every: float = 30.0):
        self.role, self.every, self.t0 = role, every, time.monotonic()
        self.done, self.starting = threading.Event(), True
        self.grace = DEFAULT_GRACE_S
        self._old = {s: signal.signal(s, self._on) for s in (signal.SIGINT, signal.SIGTERM)}
        threading.Thread(target=self._progress, name=f"{role}-starting", daemon=True).start()

    def _on(self, signum, _frame) -> None:
        self.done.set()
        if self.starting:
            self.starting = False
            log.info("%s: signal %d while starting (%.1f s in): exiting", self.role, signum, self.since())
            raise LoadInterrupted(signum)
        log.info("%s: signal %d, shutting down (grace %.1fs)", self.role, signum, self.grace)

    def since(self) -> float:
        return time.monotonic() - self.t0

    def _progress(self) -> None:
        while not self.done.wait(self.every) and self.starting:
            log.info(
                "%s: still starting, %.0f s so far (loading the model, capturing graphs, warming up; "
                "the gRPC port opens once it is ready)",
                self.role,
                self.since(),
            )

    def serving(self) -> None:
        """Started: from now on a signal sets `done` instead of interrupting."""
        self.starting = False

    def restore(self) -> None:
        """The handlers from before (tests; a worker process keeps these until it exits)."""
        self.starting = False
        self.done.set()
        for s, h in self._old.items():
            signal.signal(s, h)


def run_until_signal(
    role: str, handle: WorkerHandle, grace: float = DEFAULT_GRACE_S, signals: StopSignals | None = None
) -> int:
    """Prints the serving line, blocks until SIGINT/SIGTERM, then stops cleanly. Returns 0. `signals`: the
    StopSignals main installed before the load (None: installed now)."""
    signals = signals or StopSignals(role)
    signals.grace = grace
    signals.serving()
    dump_stacks_on_sigusr1(role)
    ready(role, handle.servicer.settings)
    print(f"{role}: serving on {handle.address}", flush=True)
    while not signals.done.wait(0.5):
        pass
    handle.stop(grace)
    log.info("%s: stopped", role)
    written = stack_sampler.write()
    if written:
        log.info("%s: stack samples in %s", role, written)
    for path in op_profile.finish():  # BATON_OP_PROFILE only (baton/op_profile.py)
        log.info("%s: op profile in %s", role, path)
    return 0


def dump_stacks_on_sigusr1(role: str) -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack (faulthandler): to stderr, or with
    BATON_STACK_DIR set to <dir>/<role>-<pid>.stacks (for a worker whose stderr is not at hand)."""
    import faulthandler
    import os

    d = os.environ.get("BATON_STACK_DIR")
    f = open(os.path.join(d, f"{role}-{os.getpid()}.stacks"), "a") if d else sys.stderr  # noqa: SIM115 - kept open
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)


def exit_process(code: int) -> NoReturn:
    """End a worker process after its clean stop without interpreter finalization.

    NOTE: with a client connection still open at SIGTERM (the router's health polls always are), a
    worker's teardown aborted in native code now and then ("terminate called without an active
    exception", SIGABRT: exit -6 instead of 0; 1 in 12 to 3 in 4 runs on a 2-core VM). Everything that
    matters is already stopped here: flush what is buffered and leave."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def worker_threads(sessions: int) -> int:
    """gRPC handler threads a worker needs for `sessions` live sessions: each may hold a streaming call
    (Decode, or Prefill waiting for its turn) and a hand-off stream at once, plus room for health,
    Release and the control calls. A sync gRPC server runs one RPC per thread: with fewer, the calls
    past the pool queue behind streams that last a whole generation (a LoadState then waits for a Decode
    to finish, and the Prefill that pushes it times out)."""
    return 2 * sessions + 16


def start_serving(
    servicer, add_to_server, service: str, *, host, port, settings, max_workers: int, max_concurrent_rpcs: int
) -> "WorkerHandle":
    """The last step of serve_prefill / serve_decode: bind the gRPC server for `servicer`, then report
    SERVING. A failure to bind closes the servicer (its threads, sender process) before re-raising."""
    try:
        base = build_server(
            [(add_to_server, servicer)],
            service_names=[service],
            host=host,
            port=port,
            settings=settings,
            max_workers=max_workers,
            max_concurrent_rpcs=max_concurrent_rpcs,
        )
    except BaseException:
        servicer.close()
        raise
    handle = WorkerHandle(base, servicer)
    handle.set_serving(True)
    return handle
