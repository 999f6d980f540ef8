"""The downstream side of one Generate request: guarded calls, sessions, stop conditions, hand-off.

Lifecycle of a request's calls:
    calls = Calls(registry, deadline=monotonic_deadline, call_timeout=30)
    context.add_callback(calls.cancel)         # client gone -> every active downstream call cancelled
    h = start_session(calls, ids, mode=..., engine=..., exclude_decode=())
        # pick prefill P + decode D (least outstanding), Prefill(decode_target=D): the state goes P -> D;
        # a failure before the first token is retried once on another prefill worker
    calls.unary(worker, "Draft", req) / calls.stream(worker, "Decode", req)
        # every call has a deadline <= the client's (unary calls also <= call_timeout)
        # errors become: Cancelled (client gone), WorkerFault (worker died / hung / lost the session:
        # retry or migrate), StatusError (the request's own fault: passed to the client)
    calls.close()                              # Release every tracked session on its worker, drop leases

Budget applies max_new_tokens / stop ids / EOS to a token stream, truncating after the first stop
(inclusive), so every path reports the same finish_reason for the same tokens.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass

import grpc

from baton.rpc import StatusError
from baton.v1 import common_pb2, prefill_pb2
from router.registry import NoWorker, Registry, Worker

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
        self.deadline = deadline              # time.monotonic() by which everything must end
        self.call_timeout = call_timeout
        self._lock = threading.Lock()
        self._active: set = set()             # grpc futures / stream calls in flight
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

    def unary(self, worker: Worker, method: str, request):
        timeout = self._timeout(capped=True)
        fut = getattr(worker.stub, method).future(request, timeout=timeout)
        self._register(fut)
        try:
            return fut.result()
        except grpc.FutureCancelledError:
            raise Cancelled() from None
        except grpc.RpcError as e:
            raise self._error(worker, e, timeout) from None
        finally:
            self._unregister(fut)

    def stream(self, worker: Worker, method: str, request):
        """Yields the responses of a server stream; breaking out of the loop cancels the call."""
        timeout = self._timeout(capped=False)
        call = getattr(worker.stub, method)(request, timeout=timeout)
        self._register(call)
        try:
            yield from call
        except grpc.RpcError as e:
            raise self._error(worker, e, timeout) from None
        finally:
            self._unregister(call)
            call.cancel()

    # ---- sessions --------------------------------------------------------------------------------
    def track(self, worker: Worker, session_id: str, uncertain: bool = False) -> None:
        self._sessions.append((worker, session_id, uncertain))

    def mark_uncertain(self, session_id: str) -> None:
        """A Prefill for this session was cut short: its hand-off may still land after the Release."""
        self._sessions = [(w, s, u or s == session_id) for w, s, u in self._sessions]

    def close(self) -> None:
        """Cancel what is still running, Release every tracked session (in parallel), drop leases."""
        with self._lock:
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


def _release(sessions: list[tuple[Worker, str, bool]]) -> None:
    futs = []
    for w, s, _ in sessions:
        try:
            futs.append((w, s, w.stub.Release.future(common_pb2.ReleaseRequest(session_id=s),
                                                     timeout=RELEASE_TIMEOUT_S)))
        except ValueError:  # the worker was removed (its channel closed) meanwhile
            continue
    for w, s, f in futs:
        try:
            f.result()
        except grpc.RpcError as e:
            log.debug("Release %s on %s: %s", s, w.address, e.code().name)


class Budget:
    """Stop conditions of one request over the tokens it emits (first token included)."""

    def __init__(self, max_new_tokens: int, stop_ids, eos_ids, ignore_eos: bool):
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(stop_ids)
        self.eos_ids = frozenset(() if ignore_eos else eos_ids)
        self.emitted: list[int] = []

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.emitted)

    def take(self, tokens) -> tuple[list[int], int | None]:
        """-> (tokens to send, FinishReason or None). Truncates after the first stop/EOS (inclusive)."""
        out: list[int] = []
        for t in tokens:
            if self.remaining <= 0:
                break
            t = int(t)
            out.append(t)
            self.emitted.append(t)
            if t in self.stop_ids:
                return out, common_pb2.STOP
            if t in self.eos_ids:
                return out, common_pb2.EOS
        return out, (common_pb2.LENGTH if self.remaining <= 0 else None)


@dataclass
class Handoff:
    """A prefilled session: P keeps it (exact mode) and D holds its state."""
    session_id: str
    prefill: Worker
    decode: Worker
    response: prefill_pb2.PrefillResponse

    @property
    def first_token(self) -> int:
        return int(self.response.first_token)


def start_session(calls: Calls, ids: list[int], *, mode: int, engine: int, engine_name: str | None,
                  exclude_decode=(), retries: int = 1, decode_wait_s: float = 0.0, on_retry=None) -> Handoff:
    """Prefill `ids` on a prefill worker with the state pushed to a decode worker.

    A worker fault before the first token is retried `retries` times on another prefill worker (the
    same one only when no other is up); a decode target that no longer answers its health check is
    excluded too. decode_wait_s > 0 waits that long for a decode worker to come up (migration).
    Raises StatusError (UNAVAILABLE when no worker can serve), Cancelled."""
    reg = calls.registry
    bad_p: list[Worker] = []
    bad_d: list[Worker] = list(exclude_decode)
    for attempt in range(retries + 1):
        try:
            try:
                p = reg.pick("prefill", exclude=bad_p)
            except NoWorker:
                p = reg.pick("prefill")
            d = reg.wait_pick("decode", engine_name, bad_d, min(decode_wait_s, max(0.0, calls.remaining())))
        except NoWorker as e:
            raise unavailable(str(e)) from None
        sid = uuid.uuid4().hex
        calls.lease(p)
        calls.lease(d)
        calls.track(p, sid)
        calls.track(d, sid)
        req = prefill_pb2.PrefillRequest(session_id=sid, prompt_ids=ids, mode=mode, decode_target=d.address,
                                         engine=engine)
        try:
            return Handoff(sid, p, d, calls.unary(p, "Prefill", req))
        except StatusError as e:
            calls.mark_uncertain(sid)
            if e.code != C.RESOURCE_EXHAUSTED or attempt == retries:
                raise
            if "decode_target" in e.message:
                bad_d.append(d)   # the decode target's slots are full (the prefill worker names it)
            else:
                bad_p.append(p)   # the prefill worker's slots are full
        except Cancelled:
            calls.mark_uncertain(sid)
            raise
        except WorkerFault as e:
            calls.mark_uncertain(sid)
            log.warning("prefill attempt %d failed: %s", attempt + 1, e)
            if attempt == retries:
                raise unavailable(f"prefill failed after {retries + 1} attempts: {e}") from None
            bad_p.append(p)
            if not reg.probe(d):
                bad_d.append(d)
            if on_retry is not None:
                on_retry()
    raise AssertionError("unreachable")
