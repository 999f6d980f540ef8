"""The downstream calls of one Generate request: deadlines, cancellation, error triage, sessions.

Lifecycle of a request's calls:
    calls = Calls(registry, deadline=monotonic_deadline, call_timeout=30)
    context.add_callback(calls.cancel)         # client gone -> every active downstream call cancelled
    calls.lease(worker); calls.track(worker, session_id)   # outstanding work; a session to release
    calls.unary(worker, "Draft", req) / calls.stream(worker, "Decode", req)
    calls.batched(worker, "Draft", req)        # as unary, sent with other requests' in one DraftMany (router/batcher.py)
    p = calls.submit(worker, "Draft", req); ...; calls.answer(p)   # batched(), started now, answered later
        # every call has a deadline <= the client's (unary calls also <= call_timeout; a stream
        # whose worker sends nothing for call_timeout is cancelled by one shared watchdog thread)
        # errors become: Cancelled (client gone), WorkerFault (worker died / hung / lost the session:
        # retry or migrate), StatusError (the request's own fault: passed to the client)
    calls.close()                              # Release every tracked session on its worker, drop leases
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack

import grpc

from baton.rpc import StatusError
from baton.v1 import common_pb2
from router import batcher
from router.registry import Registry, Worker

log = logging.getLogger("baton.router")

C = grpc.StatusCode
# Codes that blame the worker, not the request: retry / migrate. NOTE: CANCELLED counts only when
# the router did not cancel the call itself (then Cancelled is raised instead).
_FAULTS = {C.UNAVAILABLE, C.CANCELLED, C.UNKNOWN, C.INTERNAL, C.DATA_LOSS, C.ABORTED}
RELEASE_TIMEOUT_S = 1.0


class Cancelled(Exception):
    """The client cancelled (or the RPC ended): stop quietly, release sessions."""


class WorkerFault(Exception):
    def __init__(self, worker: Worker, code: grpc.StatusCode, details: str):
        super().__init__(f"{worker.role} worker {worker.address}: {code.name}: {details}")
        self.worker, self.code, self.details = worker, code, details


def unavailable(msg: str) -> StatusError:
    return StatusError(C.UNAVAILABLE, msg)


class Calls:
    def __init__(self, registry: Registry, *, deadline: float, call_timeout: float):
        self.registry = registry
        self.deadline = deadline  # time.monotonic() by which everything must end
        self.call_timeout = call_timeout
        self._lock = threading.Lock()
        self._active: set = set()  # grpc futures / stream calls in flight
        self._cancelled = False
        self._sessions: list[tuple[Worker, str, bool]] = []  # (worker, session id, creation uncertain)
        self._leases = ExitStack()
        self._leased: set[int] = set()

    # ---- deadlines and cancellation --------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _timeout(self, capped: bool) -> float:
        rem = self.remaining()
        if rem <= 0:
            raise StatusError(C.DEADLINE_EXCEEDED, "deadline exceeded")
        return min(rem, self.call_timeout) if capped else rem

    @property
    def cancelled(self) -> bool:
        """The client went away (cancel()) or the request ended (close())."""
        return self._cancelled

    def cancel(self) -> None:
        """context.add_callback target: cancels active calls; later calls raise Cancelled."""
        with self._lock:
            self._cancelled = True
            active = list(self._active)
        for call in active:
            call.cancel()

    def _register(self, call) -> None:
        with self._lock:
            if not self._cancelled:
                self._active.add(call)
                return
        call.cancel()
        raise Cancelled()

    def _unregister(self, call) -> None:
        with self._lock:
            self._active.discard(call)

    def _error(self, worker: Worker, e: grpc.RpcError, timeout: float) -> Exception:
        code, details = e.code(), e.details() or ""
        if self._cancelled:
            return Cancelled()
        if code == C.DEADLINE_EXCEEDED:
            if self.remaining() <= 0.01:
                return StatusError(C.DEADLINE_EXCEEDED, "deadline exceeded")
            self.registry.mark_down(worker)  # hung: no answer within call_timeout
            return WorkerFault(worker, code, f"no answer within {timeout:.1f}s")
        if code == C.UNAVAILABLE:
            # NOTE: a Prefill also ends UNAVAILABLE when its decode_target is down: ask before blaming
            self.registry.probe(worker)
        if code in _FAULTS or (code == C.NOT_FOUND and worker.role == "decode"):
            return WorkerFault(worker, code, details)
        if code in (C.UNAUTHENTICATED, C.PERMISSION_DENIED):
            return StatusError(C.INTERNAL, f"router: {worker.role} worker refused the router's credentials")
        return StatusError(code, details)

    # ---- calls -----------------------------------------------------------------------------------
    def lease(self, worker: Worker) -> None:
        """Count this request as outstanding work on `worker` until close()."""
        if id(worker) not in self._leased:
            self._leased.add(id(worker))
            self._leases.enter_context(self.registry.lease(worker))

    def _start_call(self, worker: Worker, fn, request, timeout: float):
        try:
            return fn(request, timeout=timeout)
        except ValueError:  # "Channel closed": the worker left the pool (e.g. a restarted Ray actor)
            raise WorkerFault(worker, C.UNAVAILABLE, "worker removed from the pool") from None

    def unary(self, worker: Worker, method: str, request):
        timeout = self._timeout(capped=True)
        fut = self._start_call(worker, getattr(worker.stub, method).future, request, timeout)
        self._register(fut)
        return self._answer(worker, fut, timeout)

    def batched(self, worker: Worker, method: str, request):
        """As unary(worker, method, request), but sent with other requests' calls of that method to that worker
        in one batched RPC (router/batcher.py: Draft -> DraftMany, Verify -> VerifyMany); each request keeps
        its own deadline, status and cancellation. A worker without the batched method gets unary calls."""
        return self.answer(self.submit(worker, method, request))

    def submit(self, worker: Worker, method: str, request) -> "Pending":
        """Starts a batched() call without waiting for it: answer(pending) waits (exact mode's next Draft, sent
        before the round's tokens go to the client). Never raises: an error to start the call is
        raised by answer(). abandon(pending) when its answer is no longer wanted."""
        p = Pending(worker, method, request)
        try:
            b = batcher.batcher_of(worker, method)
            p.timeout = self._timeout(capped=True)
            if b is None:
                p.handle = self._start_call(worker, getattr(worker.stub, method).future, request, p.timeout)
                p.handle.add_done_callback(p.mark)
            else:
                p.handle = b.submit(request.session_id, request, p.timeout)
            self._register(p.handle)
        except Exception as e:  # noqa: BLE001 - StatusError, WorkerFault, Cancelled: raised where it is answered
            self.abandon(p)
            p.error = e
        return p

    def answer(self, p: "Pending"):
        """The response of a submitted call (or what submit met), errors triaged as unary()'s."""
        if p.error is not None:
            raise p.error
        try:
            return self._answer(p.worker, p.handle, p.timeout)
        except batcher.Unbatched:
            return self.unary(p.worker, p.method, p.request)

    def abandon(self, p: "Pending") -> None:
        """A submitted call nobody will answer: cancelled (a batched item leaves its queue, or is answered to
        nobody if in flight)."""
        if p.handle is not None:
            (p.handle.abandon if isinstance(p.handle, batcher.Ticket) else p.handle.cancel)()
            self._unregister(p.handle)

    def _answer(self, worker: Worker, handle, timeout: float):
        """The response of a registered call (a grpc future, or a batcher Ticket), its errors triaged."""
        try:
            resp = handle.result()
            worker.last_answer = time.monotonic()  # alive, however late its health checks are
            return resp
        except grpc.FutureCancelledError:
            raise Cancelled() from None
        except grpc.RpcError as e:
            raise self._error(worker, e, timeout) from None
        finally:
            self._unregister(handle)

    def stream(self, worker: Worker, method: str, request):
        """Yields the responses of a server stream; breaking out of the loop cancels the call.
        A stream that sends nothing for call_timeout s (a frozen worker) is a WorkerFault."""
        timeout = self._timeout(capped=False)
        call = self._start_call(worker, getattr(worker.stub, method), request, timeout)
        self._register(call)
        it = iter(call)
        try:
            while True:
                stalled = _WATCHDOG.arm(call, self.call_timeout)  # only while waiting on the worker
                try:
                    resp = next(it)
                except StopIteration:
                    return
                finally:
                    _WATCHDOG.disarm(call)
                worker.last_answer = time.monotonic()
                yield resp
        except grpc.RpcError as e:
            if stalled.is_set() and not self._cancelled:
                self.registry.mark_down(worker)
                raise WorkerFault(worker, C.DEADLINE_EXCEEDED, f"stream stalled for {self.call_timeout:.1f}s") from None
            raise self._error(worker, e, timeout) from None
        finally:
            self._unregister(call)
            call.cancel()

    # ---- sessions --------------------------------------------------------------------------------
    def track(self, worker: Worker, session_id: str, uncertain: bool = False) -> None:
        self._sessions.append((worker, session_id, uncertain))

    def release(self, worker: Worker, session_id: str) -> None:
        """Releases one tracked session now (in the background: the request goes on) and stops tracking it."""
        gone = [t for t in self._sessions if t[0] is worker and t[1] == session_id]
        self._sessions = [t for t in self._sessions if t not in gone]
        if gone:
            threading.Thread(target=_release, args=(gone,), daemon=True, name="baton-release").start()

    def mark_uncertain(self, session_id: str) -> None:
        """A Prefill for this session was cut short: its hand-off may still land after the Release."""
        self._sessions = [(w, s, u or s == session_id) for w, s, u in self._sessions]

    def close(self) -> None:
        """Cancel what is still running, Release every tracked session (in parallel), drop leases.
        A call started but not yet registered when close() runs is cancelled as it registers (the
        closed Calls counts as cancelled), so no downstream call outlives its request."""
        with self._lock:
            self._cancelled = True
            active = list(self._active)
        for call in active:
            call.cancel()
        sessions, self._sessions = self._sessions, []
        _release(sessions)
        late = [(w, s, u) for w, s, u in sessions if u]
        if late:  # a hand-off that was in flight may create the session after the first Release
            t = threading.Timer(1.0, _release, args=(late,))
            t.daemon = True
            t.start()
        self._leases.close()


class Pending:
    """A call started by Calls.submit: handle (a batcher Ticket or a grpc future) or the error met starting it."""

    __slots__ = ("worker", "method", "request", "handle", "timeout", "error", "started", "done_at")

    def __init__(self, worker: Worker, method: str, request):
        self.worker, self.method, self.request = worker, method, request
        self.handle, self.timeout, self.error = None, 0.0, None
        self.started, self.done_at = time.monotonic(), 0.0

    def mark(self, _future=None) -> None:
        self.done_at = self.done_at or time.monotonic()

    def seconds(self) -> float:
        """Start -> answer of the call (when the answer came, not when its caller came back for it)."""
        end = self.handle.answered if isinstance(self.handle, batcher.Ticket) else self.done_at
        return (end or time.monotonic()) - self.started


class _Watchdog:
    """One thread for every stream: cancels a call whose worker sent nothing before its due time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._due: dict[int, tuple[float, object, threading.Event]] = {}  # id(call) -> (due, call, flag)
        self._thread: threading.Thread | None = None

    def arm(self, call, idle_s: float) -> threading.Event:
        flag = threading.Event()
        with self._lock:
            self._due[id(call)] = (time.monotonic() + idle_s, call, flag)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="baton-router-watchdog", daemon=True)
                self._thread.start()
        return flag

    def disarm(self, call) -> None:
        with self._lock:
            self._due.pop(id(call), None)

    def _run(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                late = [k for k, (due, _, _) in self._due.items() if due <= now]
                fired = [self._due.pop(k) for k in late]
            for _, call, flag in fired:
                flag.set()
                call.cancel()


_WATCHDOG = _Watchdog()


def _release(sessions: list[tuple[Worker, str, bool]]) -> None:
    futs = []
    for w, s, _ in sessions:
        try:
            futs.append(
                (w, s, w.stub.Release.future(common_pb2.ReleaseRequest(session_id=s), timeout=RELEASE_TIMEOUT_S))
            )
        except ValueError:  # the worker was removed (its channel closed) meanwhile
            continue
    for w, s, f in futs:
        try:
            f.result()
        except grpc.RpcError as e:
            log.debug("Release %s on %s: %s", s, w.address, e.code().name)
        except ValueError:  # its channel closed meanwhile (an interceptor defers the error to the future)
            log.debug("Release %s on %s: channel closed", s, w.address)
