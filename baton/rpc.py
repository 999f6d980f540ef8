"""gRPC plumbing shared by the router and both workers (sync grpc everywhere).

Server lifecycle:
    handle = build_server([(add_FooServicer_to_server, FooServicer())],
                          service_names=["baton.v1.Foo"], port=0, settings=settings)
        # bound to settings.host (127.0.0.1 by default), started, health = NOT_SERVING
    handle.set_serving(True)          # once weights are loaded / graphs captured
    ... handle.address  ("127.0.0.1:54321") goes to the router / clients ...
    handle.stop(grace=5)              # health -> NOT_SERVING, drains, waits for shutdown

Every incoming RPC passes `AuthInterceptor` first. With a token configured, a call must carry
metadata `authorization: Bearer <token>` or it ends with UNAUTHENTICATED before reaching the
servicer. grpc.health.v1 and server reflection stay open by default (`protect_health=False`) so
k8s / Ray probes work without the secret; pass `protect_health=True` to guard them too.

Then `DecodeGuard`: a request body that does not parse ends INVALID_ARGUMENT naming the message type, with
one rate-limited log line (grpc's own answer would be INTERNAL and a traceback per request).

Client side: `make_channel(address, settings)` applies TLS, message limits, keepalive and (when a
token is configured) attaches the bearer metadata to every call, so stubs need no extra argument.
`call_metadata(token)` gives the same metadata for channels made elsewhere.
"""

from __future__ import annotations

import argparse
import collections
import hmac
import logging
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.rpc_guard import DecodeGuard, RateLimitedLog
from baton.settings import Settings

AUTH_HEADER = "authorization"
AUTH_FAILED = "missing or invalid bearer token"
# Method prefixes left open when protect_health=False.
_PROBE_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
AddFn = Callable[[Any, grpc.Server], None]  # e.g. decode_pb2_grpc.add_DecodeWorkerServicer_to_server


# ---------------------------------------------------------------- auth
def call_metadata(token: str | None) -> tuple:
    """(("authorization", "Bearer <token>"),) or () when no token is configured."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def _denying_handler(handler: grpc.RpcMethodHandler, method: str, why: str, log: RateLimitedLog):
    """A handler of the same streaming shape as `handler` that aborts with UNAUTHENTICATED, after one
    rate-limited warning line naming the method, the peer and `why` (no / a wrong token).

    NOTE: no request deserializer, so an unauthenticated request is never parsed."""

    def _deny(request_or_iterator, context: grpc.ServicerContext) -> NoReturn:
        log.warning("refused %s from %s: %s (UNAUTHENTICATED)", method, context.peer(), why)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, AUTH_FAILED)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)


class AuthInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every RPC when `token` is set.

    token=None disables the check. Health and reflection are exempt unless protect_health=True.
    Comparison is constant-time (hmac.compare_digest); any one matching header value passes."""

    def __init__(self, token: str | None, *, protect_health: bool = False):
        self._expected = f"Bearer {token}".encode() if token else None
        self._protect_health = protect_health
        self._log = RateLimitedLog(logging.getLogger("baton.rpc"))  # a client with a bad token cannot flood it

    def authorized(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        if self._expected is None:
            return True
        ok = False
        for key, value in metadata or ():
            if key.lower() == AUTH_HEADER:
                raw = value.encode() if isinstance(value, str) else bytes(value)
                ok |= hmac.compare_digest(raw, self._expected)
        return ok

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self._expected is None:
            return handler  # unknown method -> UNIMPLEMENTED; or auth disabled
        if not self._protect_health and handler_call_details.method.startswith(_PROBE_PREFIXES):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        sent = any(k.lower() == AUTH_HEADER for k, _ in handler_call_details.invocation_metadata or ())
        why = "a bearer token that does not match" if sent else "no authorization header"
        return _denying_handler(handler, handler_call_details.method, why, self._log)


class _ClientCallDetails(
    collections.namedtuple(
        "_ClientCallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Appends the bearer metadata to every outgoing call (all four call shapes)."""

    def __init__(self, token: str):
        self._md = call_metadata(token)

    def _details(self, d: grpc.ClientCallDetails) -> _ClientCallDetails:
        md = tuple(d.metadata or ()) + self._md
        return _ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


# ---------------------------------------------------------------- errors
class StatusError(Exception):
    """Raise inside a servicer (under `rpc_errors`) to end the RPC with `code` and `message`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def abort_with(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """context.abort, typed NoReturn (it raises)."""
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort returned")


@contextmanager
def rpc_errors(
    context: grpc.ServicerContext, mapping: Mapping[type[BaseException], grpc.StatusCode] | None = None
) -> Iterator[None]:
    """Turns StatusError, and exceptions whose type is in `mapping`, into context.abort.

        with rpc_errors(context, {SessionNotFound: grpc.StatusCode.NOT_FOUND}):
            ...
    Anything else propagates (grpc reports it as UNKNOWN and logs the traceback)."""
    try:
        yield
    except StatusError as e:
        abort_with(context, e.code, e.message)
    except tuple(mapping or ()) as e:  # type: ignore[misc]
        code = next(c for t, c in mapping.items() if isinstance(e, t))
        abort_with(context, code, str(e) or type(e).__name__)


# ---------------------------------------------------------------- options
# Every name below is a grpc core channel argument (grpc_types.h GRPC_ARG_*): a misspelt one is silently
# ignored (issue 24: "min_recv_ping_interval..." left servers at the 5-minute default, so they sent GOAWAY
# too_many_pings to our own idle channels). tests/test_grpc_hygiene.py checks each against cygrpc.
def _message_options(settings: Settings, max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    n = settings.max_message_bytes
    return [
        ("grpc.max_receive_message_length", n if max_receive_bytes is None else max_receive_bytes),
        ("grpc.max_send_message_length", n),
    ]


def _server_options(settings: Settings) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 0),  # NOTE: a taken port must fail to bind, never be shared silently
        ("grpc.keepalive_permit_without_calls", 1),
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: accept client pings this often (<= the
        # clients' keepalive time, Settings checks it)
        ("grpc.http2.min_ping_interval_without_data_ms", settings.min_ping_interval_ms),
    ]


def _client_options(settings: Settings) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _hostport(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


# ---------------------------------------------------------------- server
class ServerHandle:
    """A started server: its bound port, address, health servicer and lifecycle."""

    def __init__(self, server: grpc.Server, host: str, port: int, health_servicer, service_names):
        self.server = server
        self.host = host
        self.port = port  # the bound port (never 0)
        self.health = health_servicer  # grpc_health.v1.health.HealthServicer
        self.service_names = tuple(service_names)

    @property
    def address(self) -> str:
        """ "host:port" to give to make_channel."""
        return _hostport(self.host, self.port)

    def set_serving(self, serving: bool) -> None:
        """Health status of "" (the whole server) and of each service name."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def stop(self, grace: float | None = None) -> None:
        """Health -> NOT_SERVING, reject new RPCs, wait up to `grace` s for running ones, then return."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server terminates (True) or `timeout` passes (False)."""
        return self.server.wait_for_termination(timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop(0)


def port_arg(text: str) -> int:
    """argparse type of a port option: an int in 0..65535 (0: a free one, or off, as the option says)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0..65535)")
    return port


def build_server(
    servicers: Sequence[tuple[AddFn, Any]],
    *,
    service_names: Sequence[str],
    host: str | None = None,
    port: int = 0,
    settings: Settings | None = None,
    max_workers: int = 16,
    max_concurrent_rpcs: int | None = None,
    protect_health: bool = False,
    serving: bool = False,
    max_receive_bytes: int | None = None,
) -> ServerHandle:
    """Build, bind and start a sync gRPC server.

    servicers: [(add_XServicer_to_server, servicer)]; service_names: their full names
    ("baton.v1.DecodeWorker") for health and reflection. host None = settings.host; port 0 = a
    free port (read it from handle.port). settings None = Settings.from_env(). TLS when
    settings.tls_cert/tls_key are set; with settings.tls_ca client certificates are required.
    max_concurrent_rpcs bounds in-flight RPCs (past it: RESOURCE_EXHAUSTED). max_receive_bytes: the
    largest message received (past it: RESOURCE_EXHAUSTED, before parsing); None = settings.max_message_bytes
    (the router's public port passes settings.max_request_bytes). Keepalive: settings.min_ping_interval_ms.
    Health starts NOT_SERVING unless serving=True. Raises OSError when the port cannot be bound.
    """
    if not 0 <= port <= 65535:  # NOTE: grpc takes 99999 (as 34463) or -1 (as 65535) without a word
        raise ValueError(f"port {port}: must be in 0..65535")
    settings = Settings.from_env() if settings is None else settings
    host = settings.host if host is None else host
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="baton-rpc"),
        interceptors=[AuthInterceptor(settings.token, protect_health=protect_health), DecodeGuard()],
        options=_message_options(settings, max_receive_bytes) + _server_options(settings),
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    for add_fn, servicer in servicers:
        add_fn(servicer, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)

    target = _hostport(host, port)
    try:
        if settings.tls_enabled:
            creds = grpc.ssl_server_credentials(
                [(_read(settings.tls_key), _read(settings.tls_cert))],
                root_certificates=_read(settings.tls_ca),
                require_client_auth=settings.tls_ca is not None,
            )
            bound = server.add_secure_port(target, creds)
        else:
            bound = server.add_insecure_port(target)
    except RuntimeError as e:  # grpc >= 1.5x raises instead of returning 0
        raise OSError(f"cannot bind {target}: {e}") from e
    if bound == 0:
        raise OSError(f"cannot bind {target}")
    server.start()
    handle = ServerHandle(server, host, bound, health_servicer, names)
    handle.set_serving(serving)
    return handle


# ---------------------------------------------------------------- client
def make_channel(
    address: str,
    settings: Settings | None = None,
    *,
    attach_token: bool = True,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """Channel to "host:port" with message limits and keepalive (settings.keepalive_time_ms / _timeout_ms).

    Secure when settings.tls_ca or settings.tls_cert is set (tls_ca = trust roots, else the
    system's; tls_cert+tls_key = client certificate). With a token and attach_token=True every call
    carries the bearer metadata. settings None = Settings.from_env()."""
    settings = Settings.from_env() if settings is None else settings
    opts = _message_options(settings) + _client_options(settings) + list(options)
    if settings.tls_ca is not None or settings.tls_cert is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(settings.tls_ca),
            private_key=_read(settings.tls_key),
            certificate_chain=_read(settings.tls_cert),
        )
        channel = grpc.secure_channel(address, creds, options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    if attach_token and settings.token:
        channel = grpc.intercept_channel(channel, _BearerClientInterceptor(settings.token))
    return channel
