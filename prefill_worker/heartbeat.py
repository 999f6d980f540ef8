"""PrefillStream heartbeats: signs of progress while a prompt waits for its passes or its state to land.

Why: the router cancels a stream whose worker sends nothing for its call timeout and marks the worker down
(router/calls.py: a frozen worker). A prompt queued behind others is not frozen: 32 prompts of 16K tokens
arriving together on one H200 had the last first token 30 s after it was asked for, and the router's
30 s stall check failed that request (benchmarks/results/gpu-h200-2026-12-03-ring.md). So the router asks
for heartbeats (PrefillRequest.heartbeat_ms > 0, PrefillStream only) and the worker sends a
PrefillResponse with only `heartbeat` set every heartbeat_ms until its last message: before the first
token, only when the engine finished a prefill pass since its last message; after it, while the state is
on its way to the decode worker (a hand-off waits its turn in the sender's ring), only when a pass or
another hand-off of this worker finished. A worker whose passes and hand-offs stopped (a hung device, a
wedged thread) goes silent, and the router still finds it stalled.

Lifecycle of one call of `wait` / `prefill` (generators: `first = yield from prefill(...)`):
    interval 0       the prefill runs on the caller's thread; nothing is yielded
    interval > 0     the prefill runs on a helper thread; every interval the generator yields HEARTBEAT
                     if progress was made (`moved`: the engine's pass count, the worker's finished
                     hand-offs) since the last check; it returns the first token or raises the error
    closed at a yield (the client went away)  it waits for the prefill to end (the passes write the
                     session's slot, which the caller releases afterwards), then GeneratorExit goes on
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Generator

from baton.v1 import prefill_pb2

HEARTBEAT = prefill_pb2.PrefillResponse(heartbeat=True)


def beating(
    fn: Callable[[], object], interval_s: float, progressed: Callable[[], bool]
) -> Generator[prefill_pb2.PrefillResponse, None, object]:
    """fn() on a helper thread; yields HEARTBEAT each interval_s in which progressed() is true -> fn()."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="baton-prefill-beat").start()
    while True:
        try:
            return fut.result(timeout=interval_s)
        except FutureTimeout:
            pass
        if not progressed():
            continue
        try:
            yield HEARTBEAT
        except GeneratorExit:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the client is gone: nobody reads the outcome
                pass
            raise


def moved(read: Callable[[], object]) -> Callable[[], bool]:
    """-> progressed(): True when read() changed since the last call (or creation)."""
    seen = [read()]

    def progressed() -> bool:
        now = read()
        changed, seen[0] = now != seen[0], now
        return changed

    return progressed


def passes_moved(engine) -> Callable[[], bool]:
    """-> progressed(): True when the engine finished a prefill pass since the last call (or creation)."""
    return moved(lambda: engine.pass_totals[0])


def wait(fn: Callable[[], object], interval_ms: int, progressed: Callable[[], bool]):
    """fn() with heartbeats every interval_ms in which progressed() (0: on this thread, none) -> fn()."""
    if interval_ms <= 0:
        return fn()
    return (yield from beating(fn, interval_ms / 1e3, progressed))


def prefill(engine, interval_ms: int, session, ids: list[int], progress=None, *, mtp: bool):
    """engine.run_prefill(session, ids, progress, mtp=mtp), with heartbeats every interval_ms (0: none)
    in which the engine finished a prefill pass."""
    run = lambda: engine.run_prefill(session, ids, progress, mtp=mtp)  # noqa: E731
    return (yield from wait(run, interval_ms, passes_moved(engine)))


def landing(servicer, context, push, interval_ms: int):
    """servicer.finish_push(context, push) (the state landed on the decode worker), with heartbeats every
    interval_ms (0: none) in which a prefill pass or another hand-off of this worker finished."""
    beat = moved(lambda: (servicer.engine.pass_totals[0], servicer.handoffs_done))
    return (yield from wait(lambda: servicer.finish_push(context, push), interval_ms, beat))
