"""The OpenAI-compatible HTTP API of one router: a FastAPI app over RouterServicer.Generate.

    app = create_app(servicer, serving=lambda: True, token="t", chat_template=ChatTemplate | None)

    GET  /health                200 {"status": "SERVING"} only while the router's gRPC health is SERVING,
                                else 503; no token needed (the readiness probe)
    GET  /live                  200 {"status": "ALIVE"} while the process serves this event loop, workers up
                                or not; no token needed (the liveness probe)
    GET  /metrics               the router's Prometheus registry (text exposition)
    GET  /v1/models             the served model; GET /v1/models/{id}: its card (OpenAI's retrieve; 404 another id)
    GET  /version               {"version": Baton's} (vLLM's)
    POST /v1/completions        router/http/schemas.py parse_completion
    POST /v1/chat/completions   router/http/schemas.py parse_chat (the model's chat template)
    POST /v1/messages           Anthropic's Messages API: router/http/messages.py and message_events.py, its errors
                                in Anthropic's shape; POST /v1/messages/count_tokens: the prompt's tokens
    POST /v1/responses          OpenAI's Responses API: router/http/responses.py (the request, as a chat) and
                                response_events.py (its output and events); GET / DELETE /v1/responses/{id}:
                                a stored response (store true: router/http/response_store.py), else 404
    POST /tokenize, /detokenize router/http/tokenize.py (vLLM's shapes: the tokenizer and template alone)

Every path but /health and /live needs `Authorization: Bearer <token>` (or Anthropic's `x-api-key: <token>`)
when the router has a token (the gRPC one; constant-time compare): 401 otherwise, one rate-limited warning line. A request refused before it reaches
the router's Generate (400 a body that is not JSON or a bad field, 404, 405, 413) is one rate-limited warning
line too: method, path, client, status and the error's message (which never quotes the prompt or messages;
the body is never logged); Generate's own refusals are in the router's request line. A body over `body_limit` bytes is 413 before it is parsed
(Content-Length, or counted while it arrives); a body that is not JSON is 400. Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}; router statuses map as router/http/errors.py says.
Streaming responses are SSE (fastapi.sse framing): one `data: {chunk}` per router message, then
`data: [DONE]`. The HTTP status is sent once every prompt has its first token, so a refusal (400, 429,
503) is a status, not a chunk.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import weakref
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, Counter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from baton.rpc_guard import RateLimitedLog
from router.http.errors import ApiError, bad
from router.http.message_events import MessageEvents, error_body
from router.http.messages import count_tokens, parse_messages
from router.http.response_events import ResponseEvents
from router.http.response_store import ResponseStore
from router.http.response_store import watch as watch_store
from router.http.responses import parse_responses
from router.http.run import Run
from router.http.schemas import Limits, check_model, parse_chat, parse_completion
from router.http.tokenize import detokenize, tokenize

log = logging.getLogger("baton.router.http")
DEFAULT_BODY_LIMIT = 4 << 20
OPEN_PATHS = ("/health", "/live")
MESSAGES = "/v1/messages"  # Anthropic's Messages API: its errors in Anthropic's shape


def _version() -> str:
    """Baton's installed version (pyproject.toml), or "unknown" when run from a checkout not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("baton")
    except PackageNotFoundError:
        return "unknown"


VERSION = _version()
KNOWN = {
    "/health",
    "/live",
    "/metrics",
    "/v1/models",
    "/version",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_HEADER_ID = 120  # X-Request-Id: the router's 128-character request_id, less a choice's "-N" suffix


def header_request_id(request: Request) -> str | None:
    """The X-Request-Id a client or gateway set (vLLM's, Envoy's, nginx's): 1..MAX_HEADER_ID visible ASCII
    characters, else a 400 naming the header; None when absent."""
    v = request.headers.get("x-request-id")
    if v is None:
        return None
    if not 0 < len(v) <= MAX_HEADER_ID or not all("!" <= ch <= "~" for ch in v):
        raise ApiError(400, f"X-Request-Id: 1..{MAX_HEADER_ID} visible ASCII characters", param="X-Request-Id")
    return v


_COUNTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _counter(registry) -> Counter:
    """baton_router_http_requests{endpoint, status}, once per metrics registry."""
    if registry not in _COUNTERS:
        _COUNTERS[registry] = Counter(
            "baton_router_http_requests",
            "HTTP API requests by endpoint and status",
            ["endpoint", "status"],
            registry=registry,
        )
    return _COUNTERS[registry]


def error_response(e: ApiError, path: str = "") -> JSONResponse:
    """OpenAI's error body; Anthropic's on the Messages API's paths."""
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    body = error_body(e.status, e.message) if path.startswith(MESSAGES) else e.body()
    return JSONResponse(body, status_code=e.status, headers=headers)


class Gate:
    """Pure ASGI, outermost: a request to anything but /health and /live needs the token (401 before any
    routing), as `Authorization: Bearer <token>` or Anthropic's `x-api-key: <token>`; every response is counted
    in baton_router_http_requests{endpoint, status}."""

    def __init__(self, app, token: str | None, counter: Counter):
        self.app, self.counter = app, counter
        self._expected = f"Bearer {token}".encode() if token else None
        self._key = token.encode() if token else None
        self._refused = RateLimitedLog(log)  # one line a refused request, rate-limited (a flood cannot fill the log)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in KNOWN else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self._expected is None or path in OPEN_PATHS:
            return await self.app(scope, receive, counted)
        headers = scope.get("headers", ())
        auth = [v for k, v in headers if k == b"authorization"]
        keys = [v for k, v in headers if k == b"x-api-key"]
        ok = False
        for v in auth:
            ok |= hmac.compare_digest(v, self._expected)
        for v in keys:
            ok |= hmac.compare_digest(v, self._key)
        if ok:
            return await self.app(scope, receive, counted)
        why = (
            "a wrong bearer token"
            if auth
            else "a wrong x-api-key"
            if keys
            else "no Authorization: Bearer <token> (or x-api-key) header"
        )
        client = scope.get("client") or ("?", 0)
        self._refused.warning("refused %s %s from %s:%s: %s (401)", scope.get("method"), endpoint, *client[:2], why)
        refusal = error_response(ApiError(401, f"authorization: {why}", code="invalid_api_key"), path)
        await refusal(scope, receive, counted)


def _printable(text: str) -> str:
    """Control characters escaped: a client's path (%0A decoded) cannot forge a log line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


async def read_json(request: Request, limit: int):
    """The body as JSON: 413 past `limit` bytes (before parsing), 400 when it is not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"body: {int(length)} bytes is over the limit of {limit}", code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"body: over the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: nothing to answer, nothing to log
        raise ApiError(400, "body: the client disconnected while sending it", code="client_disconnected") from None
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise bad("body", f"not valid JSON: {str(e)[:200]}") from None


def create_app(
    servicer,
    *,
    serving: Callable[[], bool],
    token: str | None,
    chat_template=None,
    body_limit: int = DEFAULT_BODY_LIMIT,
) -> FastAPI:
    app = FastAPI(title="Baton", docs_url=None, redoc_url=None, openapi_url=None)
    counter = _counter(servicer.metrics.registry)
    started = int(time.time())
    meta, reg, cfg = servicer.meta, servicer.registry, servicer.config

    def limits() -> Limits:
        return Limits(
            meta.model_id,
            reg.max_context(cfg.max_context),
            cfg.width,
            meta.tokenizer,
            chat_template,
            reg.capacity(),
            cfg.reasoning_parser,
            cfg.max_new_tokens_limit,
        )

    refused = RateLimitedLog(log)  # a client flooding bad requests cannot flood the log

    def answer(request: Request, e: ApiError) -> JSONResponse:
        if not e.from_router and e.code != "client_disconnected":  # gone: nobody to answer, nothing to say
            host, port = (request.client or ("?", 0))[:2]
            path, why = _printable(request.url.path[:200]), _printable(e.message[:300])
            refused.warning("%s %s from %s:%s: %d %s", request.method, path, host, port, e.status, why)
        return error_response(e, request.url.path)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return answer(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return answer(request, ApiError(e.status_code, f"{request.url.path[:200]}: {e.detail}", code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return error_response(ApiError(500, "internal error (see the router's log)", code="internal"), request.url.path)

    @app.get("/health")
    async def health():
        ok = serving()
        return JSONResponse({"status": "SERVING" if ok else "NOT_SERVING"}, status_code=200 if ok else 503)

    @app.get("/live")
    async def live():  # liveness: this loop answers; /health (readiness) is 503 while the workers are down
        return {"status": "ALIVE"}

    @app.get("/metrics")
    async def metrics():
        # off the event loop: rendering asks every worker's GetStats (router/worker_metrics.py, up to ~1.5 s)
        return Response(await asyncio.to_thread(servicer.metrics.render), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return {
            "id": meta.model_id,
            "object": "model",
            "created": started,
            "owned_by": "baton",
            "max_model_len": reg.max_context(cfg.max_context) - cfg.width,  # prompt + new tokens (Limits.usable)
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model({"model": model}, limits())  # 404 naming `model` for another id
        return card()

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    store = ResponseStore(cfg.responses_store_mb << 20) if cfg.responses_store_mb > 0 else None
    if store is not None:
        watch_store(store, servicer.metrics.registry)

    async def generate(request: Request, parse, events_of=None, id_prefix: str | None = None) -> Response:
        """One request through Run (router/http/run.py). Completions and chat: its response or its chunks as
        SSE, then [DONE]. The Responses and Messages APIs (events_of): parse gives (Job, request), the chat
        stream becomes events_of(run, request, model)'s object (collect) or its named events (stream)."""
        rid = header_request_id(request)
        body = await read_json(request, body_limit)
        parsed = await asyncio.to_thread(parse, body, limits())  # tokenizing and templating off the loop
        job, req = parsed if events_of is not None else (parsed, None)
        run = Run(servicer, job, meta.model_id, id_prefix=id_prefix, request_id=rid)
        await run.start()
        out = events_of(run, req, meta.model_id) if events_of is not None else run
        traced = {"X-Request-Id": run.request_id}  # the id the router's log lines name
        if not (body.get("stream") is True if events_of is not None else job.stream):
            watch = asyncio.create_task(_on_disconnect(request, run.cancel))
            try:
                return JSONResponse(await out.collect(), headers=traced)
            finally:
                watch.cancel()

        async def sse():
            if events_of is not None:  # each event named by its type (no [DONE] after them, as OpenAI's)
                async for event in out.stream():
                    yield format_sse_event(event=event["type"], data_str=json.dumps(event, ensure_ascii=False))
                return
            async for chunk in run.chunks():
                yield format_sse_event(data_str=json.dumps(chunk, ensure_ascii=False))
            yield format_sse_event(data_str="[DONE]")

        return EventSourceResponse(sse(), headers={**SSE_HEADERS, **traced})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_chat)

    async def answered(request: Request, fn) -> JSONResponse:
        """A body answered by the tokenizer and template alone (no worker), off the event loop."""
        body = await read_json(request, body_limit)
        return JSONResponse(await asyncio.to_thread(fn, body, limits()))

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await generate(request, lambda body, lim: parse_responses(body, lim, store), ResponseEvents, "resp_")

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await generate(request, parse_messages, MessageEvents, "msg_")

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request):
        return await answered(request, count_tokens)

    def stored_miss(response_id: str) -> ApiError:
        why = (
            "never stored, deleted, evicted, or stored by another router"
            if store is not None
            else "--responses-store-mb 0"
        )
        return ApiError(
            404, f"response_id: {response_id[:80]!r} is not stored ({why})", param="response_id", code="not_found"
        )

    @app.get("/v1/responses/{response_id}")
    async def response_by_id(response_id: str):
        got = store.get(response_id) if store is not None else None
        if got is None:
            raise stored_miss(response_id)
        return got

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if store is None or not store.delete(response_id):
            raise stored_miss(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/tokenize")
    async def tokenize_(request: Request):
        return await answered(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_(request: Request):
        return await answered(request, detokenize)

    app.add_middleware(Gate, token=token, counter=counter)
    return app


async def _on_disconnect(request: Request, cancel: Callable[[], None]) -> None:
    """Non-streaming requests: the body has been read, so the next ASGI message is the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel()
            return
