"""Baton's OpenAI-compatible HTTP API, served by the router process beside its gRPC port.

    srv = start_http(servicer, handle, host=..., port=8000, settings=..., model_dir=DIR)
    srv.url; stop with srv.stop(grace)

Imported only when an HTTP port is asked for (`python -m router --http-port P`, `baton serve --http-port
P`): fastapi, uvicorn and jinja2 are needed then only. Without them: HttpUnavailable, which says so.
Modules: app (routes, auth, body limit), schemas (request fields -> GenerateRequests), run (Generate
calls -> OpenAI responses and chunks), responses / response_events and messages /
message_events (OpenAI's Responses and Anthropic's Messages APIs over the chat path),
bridge (Generate in process), chat (templates), errors (OpenAI
error shape, status mapping), server (uvicorn on a thread); stop strings are matched by the router
(router/stops.py). docs/HTTP.md describes the API.
"""

from __future__ import annotations


class HttpUnavailable(ImportError):
    """The HTTP API was asked for but its packages are not installed."""


def start_http(
    servicer,
    handle,
    *,
    host: str,
    port: int,
    settings,
    model_dir=None,
    grace: float = 5.0,
    body_limit: int | None = None,
):
    """Serve the API for `servicer` (its health read from `handle`, the router's gRPC ServerHandle)."""
    try:
        import fastapi  # noqa: F401
        import jinja2  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise HttpUnavailable(
            f"--http-port {port}: the HTTP API needs fastapi, uvicorn and jinja2 ({e}); "
            f"install them (pip install fastapi uvicorn jinja2) or pass --http-port 0"
        ) from None
    from grpc_health.v1 import health_pb2

    from router.http.app import DEFAULT_BODY_LIMIT, create_app
    from router.http.chat import ChatTemplate
    from router.http.server import HttpServer

    check = health_pb2.HealthCheckRequest(service="")

    def serving() -> bool:  # the gRPC health of "" (always present, so no context is needed)
        return handle.health.Check(check, None).status == health_pb2.HealthCheckResponse.SERVING

    app = create_app(
        servicer,
        serving=serving,
        token=settings.token,
        chat_template=ChatTemplate.from_dir(model_dir),
        body_limit=body_limit or DEFAULT_BODY_LIMIT,
    )
    return HttpServer(app, host=host, port=port, settings=settings, grace=grace)
