"""What the prefill and decode workers share: options, command line, RPC bookkeeping, lifecycle.

Lifecycle of a worker process (python -m prefill_worker | python -m decode_worker):
    parse_args -> WorkerOptions          frozen; dtype default: bf16 on cuda, fp32 on cpu (both roles)
    settings_for(options)                baton.settings (the one place env vars are read) + --token-file
    serve_*(...) -> (WorkerHandle, servicer)
        model loaded -> engine -> gRPC server bound -> health SERVING
    run_until_signal(role, handle)       prints "<role>: serving on HOST:PORT"; SIGINT/SIGTERM ->
                                         health NOT_SERVING -> stop(grace) -> servicer.close()
    exit_process(code)                   flush, os._exit: no interpreter teardown (see its note)
Inside a Ray actor (prefill_worker/actor.py, decode_worker/actor.py) the same serve_*() runs in the
actor's constructor; `WorkerActor` gives address() / health() / stats() / stop(), and
`make_remote(cls, ...)` decorates it (ray is imported only there: the GPU machine has no Ray).

Inside a servicer every RPC runs under `ServicerBase.call(context)`: counts outstanding/requests,
refuses a spent deadline, maps engine exceptions to gRPC status codes, and SessionLocks keeps two RPCs
from touching one session's slot at once (a Release of a busy session is deferred to its end).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, NoReturn

import grpc

from baton.gpus import pin_device
from baton.rpc import ServerHandle, StatusError, abort_with
from baton.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH, WindowError
from baton.settings import Settings, read_token_file
from baton.wire import StateError

log = logging.getLogger("baton.worker")

DEFAULT_SLOTS = 8
DEFAULT_TTL_S = 300.0
DEFAULT_GRACE_S = 5.0


def default_dtype(device: str) -> str:
    """bf16 on cuda, fp32 on cpu: the same rule on both workers and `baton complete` (exactness)."""
    return "bf16" if str(device).startswith("cuda") else "fp32"


@dataclass(frozen=True)
class WorkerOptions:
    model: str | None
    port: int = 0
    host: str | None = None            # None = settings.host (127.0.0.1 unless BATON_HOST says otherwise)
    device: str = "cpu"
    dtype: str | None = None           # None = default_dtype(device)
    width: int = DEFAULT_WIDTH
    max_len: int = DEFAULT_MAX_LEN     # NOTE: must equal the other worker's and `baton complete`'s
    slots: int = DEFAULT_SLOTS
    ttl_s: float = DEFAULT_TTL_S
    token_file: str | None = None
    grace_s: float = DEFAULT_GRACE_S

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or default_dtype(self.device)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    p.add_argument("--port", type=int, default=0, help="port to bind (0 = pick a free one and print it)")
    p.add_argument("--host", default=None, help="bind host (default: BATON_HOST or 127.0.0.1)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="fixed row width W")
    p.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, help="window: prompt + generated tokens")
    p.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help="concurrent sessions (static state slots)")
    p.add_argument("--ttl", type=float, default=DEFAULT_TTL_S, help="idle seconds before a session is reaped")
    p.add_argument("--token-file", default=None, help="bearer token file (default: BATON_TOKEN[_FILE])")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds to drain RPCs on shutdown")
    p.add_argument("--random-init", default=None, metavar="SHAPE",
                   help="benchmarks: seeded random weights of a named shape (benchmarks/shapes.py) or of the "
                        "config.json in a directory, instead of --model")
    p.add_argument("--seed", type=int, default=0, help="--random-init: weight seed (same on every worker)")


def model_from_args(a: argparse.Namespace, opts: "WorkerOptions", role: str):
    """What serve_prefill / serve_decode load: --model DIR (None = the embedded model), or with
    --random-init a LoadedModel of seeded random weights, bitwise the same in every process."""
    if not a.random_init:
        return opts.model
    from benchmarks.shapes import random_init

    log.info("%s: random weights of %s (seed %d)", role, a.random_init, a.seed)
    return random_init(a.random_init, seed=a.seed, dtype=opts.resolved_dtype, device=opts.device)


def options_from_args(a: argparse.Namespace) -> WorkerOptions:
    if a.random_init and a.model:
        raise SystemExit("give --model or --random-init, not both")
    for name in ("width", "max_len", "slots"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1")
    try:
        device = pin_device(a.device)   # cuda:N -> this process sees only GPU N (baton/gpus.py)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return WorkerOptions(a.model, a.port, a.host, device, a.dtype, a.width, a.max_len, a.slots, a.ttl,
                         a.token_file, a.grace)


def settings_for(token_file: str | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from the environment; a --token-file wins over BATON_TOKEN / BATON_TOKEN_FILE."""
    return Settings.from_env(env, token=read_token_file(token_file) if token_file else None)


def setup_logging(settings: Settings) -> None:
    fmt = ('{"t": "%(asctime)s", "level": "%(levelname)s", "logger": "%(name)s", "msg": "%(message)s"}'
           if settings.log_json else "%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.basicConfig(level=settings.log_level, format=fmt, stream=sys.stderr)


# ---------------------------------------------------------------- lifecycle
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


def run_until_signal(role: str, handle: ServerHandle, grace: float = DEFAULT_GRACE_S) -> int:
    """Prints the serving line, blocks until SIGINT/SIGTERM, then stops cleanly. Returns 0."""
    done = threading.Event()

    def on_signal(signum, _frame):
        log.info("%s: signal %d, shutting down (grace %.1fs)", role, signum, grace)
        done.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"{role}: serving on {handle.address}", flush=True)
    while not done.wait(0.5):
        pass
    handle.stop(grace)
    log.info("%s: stopped", role)
    return 0


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


# ---------------------------------------------------------------- per-RPC bookkeeping
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
                raise StatusError(grpc.StatusCode.ABORTED,
                                  f"session_id: {sid!r} is busy with another call on this worker")
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


class ServicerBase:
    """Counters, deadline check, exception -> status mapping, TTL reaper. Subclasses set `errors`
    (exception type -> status code; the first isinstance match wins, so list subclasses first)."""

    errors: Mapping[type[BaseException], grpc.StatusCode] = {}

    def __init__(self, engine, *, reap_interval_s: float = 2.0):
        self.engine = engine
        self.sessions = SessionLocks()
        self._count_lock = threading.Lock()
        self.outstanding = 0          # RPCs in flight (GetStats itself not counted)
        self.requests_total = 0
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval_s,),
                                        name=f"{type(self).__name__}-reaper", daemon=True)
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

    @contextmanager
    def call(self, context: grpc.ServicerContext, what: str) -> Iterator[None]:
        with self._count_lock:
            self.outstanding += 1
            self.requests_total += 1
        try:
            try:
                if context.time_remaining() <= 0:
                    raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: deadline already passed")
                yield
            except StatusError as e:
                abort_with(context, e.code, e.message)
            except StateError as e:
                abort_with(context, getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL), str(e))
            except tuple(self.errors) as e:
                code = next(c for t, c in self.errors.items() if isinstance(e, t))
                abort_with(context, code, _message(e))
        finally:
            with self._count_lock:
                self.outstanding -= 1


# ---------------------------------------------------------------- Ray actors
def make_remote(cls, *, num_gpus: float = 0, resources: dict | None = None, max_restarts: int = -1,
                max_task_retries: int | None = None, num_cpus: float | None = None):
    """ray.remote(...)(cls). max_task_retries defaults to -1 (retry across restarts) when the actor
    may restart: every actor method is idempotent."""
    import ray

    opts = dict(num_gpus=num_gpus, max_restarts=max_restarts,
                max_task_retries=(-1 if max_restarts else 0) if max_task_retries is None else max_task_retries)
    if resources:
        opts["resources"] = dict(resources)
    if num_cpus is not None:
        opts["num_cpus"] = num_cpus
    return ray.remote(**opts)(cls)


class WorkerActor:
    """Base of the worker actor classes: subclasses set self.handle (a WorkerHandle) and self.role.
    Constructor arguments are plain str/int/float (NOTE: never pass the token itself: use token_file
    or BATON_TOKEN in the actor's runtime_env)."""

    role = "worker"
    handle: WorkerHandle

    def _settings(self, token_file: str | None) -> Settings:
        settings = settings_for(token_file or None)
        setup_logging(settings)
        return settings

    def _advertised(self) -> str:
        """The address to give others: a wildcard bind host is replaced by this node's IP."""
        host = self.handle.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            import ray

            host = ray.util.get_node_ip_address()
        return f"[{host}]:{self.handle.port}" if ":" in host else f"{host}:{self.handle.port}"

    def address(self) -> str:
        return self._advertised()

    def health(self) -> str:
        """grpc.health.v1 status of the server, asked over its own socket: "SERVING", "NOT_SERVING", or
        "UNREACHABLE" (stopped)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from baton.rpc import make_channel

        with make_channel(self.handle.address, self.handle.servicer.settings) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            except grpc.RpcError:
                return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def stats(self) -> dict:
        s = self.handle.servicer.stats()
        return {"role": self.role, "address": self.address(), "sessions": s.sessions,
                "session_bytes": s.session_bytes, "outstanding": s.outstanding, "engine": s.engine,
                "model_fingerprint": s.model_fingerprint, "max_len": s.max_len, "requests_total": s.requests_total}

    def stop(self, grace: float = DEFAULT_GRACE_S) -> bool:
        self.handle.stop(grace)
        return True
