"""ServicerBase: the per-RPC bookkeeping both workers' gRPC servicers share.

Every RPC runs under `ServicerBase.call(context)`: counts outstanding/requests, refuses a spent deadline,
maps engine exceptions to gRPC status codes, and SessionLocks keeps two RPCs from touching one session's
slot at once (a Release of a busy session is deferred to its end)."""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import grpc

from baton import grammar, thread_cpu
from baton.engine.runner import WindowError
from baton.engine.slots import SessionLimit, SessionNotFound
from baton.handoff.wire import StateError
from baton.rpc import StatusError, abort_with

log = logging.getLogger("baton.worker")


class SessionLocks:
    """At most one RPC per session at a time. hold() raises ABORTED when the session is busy.
    release_or_defer(sid, fn): fn() now if idle, else when the holder leaves (never mid-step)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._busy: set[str] = set()
        self._deferred: dict[str, Callable[[], object]] = {}

    @contextmanager
    def hold(self, sid: str) -> Iterator[None]:
        with self._lock:
            if sid in self._busy:
                raise StatusError(
                    grpc.StatusCode.ABORTED, f"session_id: {sid!r} is busy with another call on this worker"
                )
            self._busy.add(sid)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(sid)
                fn = self._deferred.pop(sid, None)
            if fn is not None:
                fn()

    def release_or_defer(self, sid: str, fn: Callable[[], bool]) -> bool:
        with self._lock:
            if sid in self._busy:
                self._deferred[sid] = fn
                return True
        return bool(fn())


@contextmanager
def window_field(field: str) -> Iterator[None]:
    """A WindowError inside becomes OUT_OF_RANGE with a message that starts with `field`."""
    try:
        yield
    except WindowError as e:
        raise StatusError(grpc.StatusCode.OUT_OF_RANGE, f"{field}: {_message(e)}") from None


def _message(e: BaseException) -> str:
    # NOTE: str(KeyError("x")) is "'x'": use the raw argument so the field name leads the message
    return str(e.args[0]) if e.args else type(e).__name__


# both workers' engine exceptions -> status codes (the first isinstance match wins, so subclasses first)
WORKER_ERRORS: Mapping[type[BaseException], grpc.StatusCode] = {
    WindowError: grpc.StatusCode.OUT_OF_RANGE,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    SessionLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    grammar.Unavailable: grpc.StatusCode.FAILED_PRECONDITION,  # (a ValueError: before it)
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
}


class ServicerBase:
    """Counters, deadline check, exception -> status mapping, TTL reaper. `errors`: exception type -> status
    code, the first isinstance match winning (WORKER_ERRORS unless a subclass sets its own)."""

    errors: Mapping[type[BaseException], grpc.StatusCode] = WORKER_ERRORS

    def __init__(self, engine, *, reap_interval_s: float = 2.0):
        self.engine = engine
        self.sessions = SessionLocks()
        self._count_lock = threading.Lock()
        self.outstanding = 0  # RPCs in flight (GetStats itself not counted)
        self.requests_total = 0
        self.batched_rpcs = self.batched_items = 0  # DraftMany / VerifyMany calls, and the requests in them
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap_loop, args=(reap_interval_s,), name=f"{type(self).__name__}-reaper", daemon=True
        )
        self._reaper.start()

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                n = self.engine.reap_expired()
                if n:
                    log.info("reaped %d expired session(s)", n)
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                log.exception("session reaper")

    def close(self) -> None:
        self._stop.set()

    def count_batched(self, items: int) -> None:
        """One batched RPC (DraftMany, VerifyMany) of `items` requests: WorkerStats.batched_rpcs / batched_items."""
        with self._count_lock:
            self.batched_rpcs += 1
            self.batched_items += items

    def status_of(self, e: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status a call that raised `e` ends with: StatusError's own, StateError's code, `errors`' mapping;
        anything else is INTERNAL (a unary call would end UNKNOWN; an item of a batched RPC needs a code)."""
        if isinstance(e, StatusError):
            return e.code, e.message
        if isinstance(e, StateError):
            return getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL), str(e)
        code = next((c for t, c in self.errors.items() if isinstance(e, t)), None)
        return (code, _message(e)) if code is not None else (grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    @contextmanager
    def call(self, context: grpc.ServicerContext, what: str) -> Iterator[None]:
        with thread_cpu.charged(what), self._call(context, what):
            yield

    @contextmanager
    def _call(self, context: grpc.ServicerContext, what: str) -> Iterator[None]:
        with self._count_lock:
            self.outstanding += 1
            self.requests_total += 1
        try:
            try:
                if context.time_remaining() <= 0:
                    raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: deadline already passed")
                yield
            except (StatusError, StateError, *self.errors) as e:
                abort_with(context, *self.status_of(e))
        finally:
            with self._count_lock:
                self.outstanding -= 1
