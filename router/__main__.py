"""`python -m router`: the router process; `serve_router(...)` is the same thing in-process.

Lifecycle:
    serve_router(prefill=[...], decode=[...], model_dir=DIR, settings=..., port=P)
        model metadata (tokenizer, vocab, EOS) from DIR -> worker registry (static addresses and/or
        named Ray actors) -> gRPC server (Router + health + reflection, auth interceptor, TLS)
        -> first health poll -> health SERVING while >= 1 prefill and >= 1 decode worker serve (readiness;
           the health service "liveness" is SERVING from the start, workers up or not)
        -> /metrics on --metrics-port (0 = off)
        -> the OpenAI-compatible HTTP API on --http-port (0 = off; router/http, imported only then)
    prints `router: serving on HOST:PORT` (and `router: http on http://HOST:PORT` with --http-port)
    SIGINT / SIGTERM: health NOT_SERVING, stop accepting, in-flight requests get `--grace` s, exit 0
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from grpc_health.v1 import health_pb2

from baton import stack_sampler
from baton.engine.draft_length import POLICIES
from baton.heap import freeze_startup_heap
from baton.lifeline import die_with_parent
from baton.logs import setup_logging
from baton.rpc import ServerHandle, build_server, port_arg
from baton.settings import Settings, read_token_file
from baton.v1 import router_pb2_grpc
from router.config import DEFAULT_QUEUE_S
from router.http.reasoning import PARSERS as REASONING_PARSERS
from router.metrics import RouterMetrics
from router.registry import Registry
from router.service import ModelMeta, RouterConfig, RouterServicer

SERVICE_NAME = "baton.v1.Router"
LIVENESS_SERVICE = "liveness"  # grpc.health.v1 name SERVING from bind to shutdown, workers up or not


def serve_router(
    *,
    prefill=(),
    decode=(),
    model_dir=None,
    meta: ModelMeta | None = None,
    settings: Settings | None = None,
    worker_settings: Settings | None = None,
    config: RouterConfig = RouterConfig(),
    host: str | None = None,
    port: int = 0,
    metrics_port: int = 0,
    ray_namespace: str | None = None,
    poll_interval: float = 0.5,
    http_port: int = 0,
) -> tuple[ServerHandle, RouterServicer]:
    """Start a router; returns (handle, servicer). Stop it with `stop_router(handle, servicer, grace)`.

    meta (else read from model_dir, else the embedded default model) gives the tokenizer and limits.
    `settings` serve the router (token checked, TLS cert); `worker_settings` (default: `settings`)
    make the worker channels: its token is sent to the workers, its TLS files secure those calls.
    http_port > 0 also serves the HTTP API (`servicer.http`: router.http.server.HttpServer, else None)
    on the same host, with `settings`' token and TLS and model_dir's chat template.
    The public port receives messages up to settings.max_request_bytes (BATON_MAX_REQUEST_BYTES, 4 MiB;
    capped at max_message_bytes): past it RESOURCE_EXHAUSTED before anything is parsed."""
    settings = Settings.from_env() if settings is None else settings
    worker_settings = settings if worker_settings is None else worker_settings
    if meta is None or (http_port and model_dir is None):
        model_dir = _model_dir(model_dir)
    if meta is None:
        meta = ModelMeta.from_dir(model_dir)
    if config.draft_length not in POLICIES:
        raise ValueError(f"draft_length {config.draft_length!r}: one of {', '.join(POLICIES)}")
    if config.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {config.reasoning_parser!r}: one of {', '.join(REASONING_PARSERS)}")
    metrics = RouterMetrics()
    box: dict[str, ServerHandle] = {}

    def on_change(serving: bool, n_prefill: int, n_decode: int) -> None:
        metrics.workers(n_prefill, n_decode)
        if "handle" in box:  # NOTE: after enter_graceful_shutdown, set() is ignored: stays NOT_SERVING
            box["handle"].set_serving(serving)

    registry = Registry(
        worker_settings,
        prefill=prefill,
        decode=decode,
        ray_namespace=ray_namespace,
        poll_interval=poll_interval,
        on_change=on_change,
    )
    servicer = RouterServicer(registry, meta, config, metrics)
    metrics.watch_workers(registry)
    handle = build_server(
        [(router_pb2_grpc.add_RouterServicer_to_server, servicer)],
        service_names=[SERVICE_NAME],
        host=host,
        port=port,
        settings=settings,
        max_workers=config.max_inflight + 16,  # + health Watch streams, model info
        max_receive_bytes=min(settings.max_request_bytes, settings.max_message_bytes),
    )
    box["handle"] = handle
    # liveness probes (k8s `grpc: {service: liveness}`): "" and baton.v1.Router are readiness (NOT_SERVING
    # while no prefill or no decode worker is up); this one stays SERVING until the router shuts down
    handle.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    servicer.http = None
    try:
        registry.start()
        metrics.start(metrics_port, handle.host)
        if http_port:
            from router.http import start_http

            servicer.http = start_http(
                servicer, handle, host=handle.host, port=http_port, settings=settings, model_dir=model_dir
            )
    except BaseException:
        handle.stop(0)
        registry.stop()
        metrics.stop()
        raise
    logging.getLogger("baton.router").info(  # what it chose, in one line (its workers: the registry's lines)
        "router: model %s (vocab %d), max_inflight=%d queue_timeout=%gs call_timeout=%gs max_new_tokens_limit=%d "
        "draft_length=%s auth=%s tls=%s metrics_port=%s http=%s responses_store=%s",
        meta.model_id,
        meta.vocab_size,
        config.max_inflight,
        config.queue_s,
        config.call_timeout_s,
        config.max_new_tokens_limit,
        config.draft_length,
        "token" if settings.token else "off",
        "on" if settings.tls_enabled else "off",
        metrics_port or "off",
        servicer.http.url if servicer.http is not None else "off",
        f"{config.responses_store_mb} MiB" if servicer.http is not None and config.responses_store_mb > 0 else "off",
    )
    return handle, servicer


def _model_dir(model_dir) -> Path:
    if model_dir is None:
        from baton.loading import resolve_model_dir  # NOTE: imports torch: only for the embedded default

        return resolve_model_dir(None)
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir} (pass --model DIR: an HF checkpoint directory)")
    return Path(model_dir)


def stop_router(handle: ServerHandle, servicer: RouterServicer, grace: float = 5.0) -> None:
    """NOT_SERVING, refuse new calls (both doors), give in-flight requests `grace` s, then end the rest
    UNAVAILABLE "router: shutting down" (router/drain.py: gRPC status, HTTP 503 or an error chunk), then stop
    polling and /metrics. Takes about `grace` s at most, whichever doors are open."""
    http = getattr(servicer, "http", None)
    if http is not None:
        http.begin_stop()  # no new HTTP connections; its requests in flight drain with the gRPC ones
    handle.health.enter_graceful_shutdown()
    stopped = handle.server.stop(grace + 1.0)  # new RPCs refused now; its own cut (a backstop) after grace + 1
    cut = servicer.drain.stop(grace)
    if cut:
        logging.getLogger("baton.router").warning(
            "shutdown: %d request(s) still running after %.1fs: ended", cut, grace
        )
    stopped.wait()
    if http is not None:
        http.stop(1.0)  # its Generate calls have ended: what is left is their last bytes
    servicer.registry.stop()
    servicer.metrics.stop()


def _addrs(text: str | None) -> list[str]:
    return [a.strip() for a in (text or "").split(",") if a.strip()]


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # started by deploy.processes.WorkerProcess: SIGTERM when it dies
    p = argparse.ArgumentParser(prog="python -m router", description="Baton router")
    p.add_argument("--port", type=port_arg, default=50051, help="gRPC port (default 50051; 0 = a free one, printed)")
    p.add_argument("--host", default=None, help="bind host (default BATON_HOST or 127.0.0.1)")
    p.add_argument("--prefill", default="", help="prefill worker addresses, comma-separated")
    p.add_argument("--decode", default="", help="decode worker addresses, comma-separated")
    p.add_argument("--model", default=None, help="model directory for the tokenizer/config (default: embedded)")
    p.add_argument("--token-file", default=None, help="bearer token file (default: BATON_TOKEN[_FILE]; none: no auth)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate of the public port (default: BATON_TLS_CERT)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert (default: BATON_TLS_KEY)")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=RouterConfig.max_inflight,
        help=f"Generate calls in flight; past it RESOURCE_EXHAUSTED (default {RouterConfig.max_inflight})",
    )
    p.add_argument(
        "--max-new-tokens-limit",
        type=int,
        default=RouterConfig.max_new_tokens_limit,
        help="the largest max_new_tokens a request may ask (default %(default)s)",
    )
    p.add_argument(
        "--default-draft-block",
        type=int,
        default=RouterConfig.default_draft_block,
        help="exact mode's K for a request that sends none (default %(default)s)",
    )
    p.add_argument("--width", type=int, default=RouterConfig.width, help="workers' row width W (default %(default)s)")
    p.add_argument(
        "--draft-length",
        choices=POLICIES,
        default=RouterConfig.draft_length,
        help="exact mode's K per round: fixed (the request's K every round; default) or adaptive (per session, "
        "from its acceptance and the measured round costs; the request's K is the prior)",
    )
    p.add_argument(
        "--max-adaptive-k",
        type=int,
        default=RouterConfig.max_adaptive_k,
        help="the adaptive ceiling on K (a request's larger K raises it; at most width - 2)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=DEFAULT_QUEUE_S,
        help="seconds a new request waits in line for a session slot while the workers' slots are full, "
        f"before RESOURCE_EXHAUSTED (default {DEFAULT_QUEUE_S:g}; 0: refuse at once)",
    )
    p.add_argument(
        "--call-timeout",
        type=float,
        default=RouterConfig.call_timeout_s,
        help="seconds a worker may take to answer one call (or send the next token) before it is treated as hung",
    )
    p.add_argument(
        "--metrics-port", type=port_arg, default=0, help="Prometheus /metrics port on --host, no token (0 = off)"
    )
    p.add_argument(
        "--http-port",
        type=port_arg,
        default=0,
        help="OpenAI-compatible HTTP API port on --host (0 = off; needs fastapi, uvicorn, jinja2)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=RouterConfig.reasoning_parser,
        help="HTTP chat completions: qwen3 returns the model's <think> reasoning as message.reasoning_content "
        "(streamed: delta.reasoning_content) and the answer as content; none: all of it is content (default)",
    )
    p.add_argument(
        "--responses-store-mb",
        type=int,
        default=RouterConfig.responses_store_mb,
        help="MiB of the Responses API's stored responses (store: true, the default) kept in this router's memory "
        "for GET / DELETE /v1/responses/{id} and previous_response_id, least recently used out first "
        "(default %(default)s; 0: off)",
    )
    p.add_argument("--ray-namespace", default=None, help="also discover named Ray actors baton-{prefill,decode}-*")
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests get at shutdown, then UNAVAILABLE (default %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest message the public port receives (default BATON_MAX_REQUEST_BYTES or 4 MiB); "
        "past it RESOURCE_EXHAUSTED",
    )
    args = p.parse_args(argv)

    try:
        token = read_token_file(args.token_file) if args.token_file else None
        settings = Settings.from_env(
            token=token,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            host=args.host,
            max_request_bytes=args.max_request_bytes,
        )
        # NOTE: --tls-cert/--tls-key secure the public port only; worker channels follow BATON_TLS_*
        worker_settings = Settings.from_env(token=token)
    except ValueError as e:
        print(f"router: {e}", file=sys.stderr)
        return 2
    setup_logging(settings)
    config = RouterConfig(
        max_inflight=args.max_inflight,
        max_new_tokens_limit=args.max_new_tokens_limit,
        default_draft_block=args.default_draft_block,
        width=args.width,
        call_timeout_s=args.call_timeout,
        queue_s=args.queue_timeout,
        draft_length=args.draft_length,
        max_adaptive_k=args.max_adaptive_k,
        reasoning_parser=args.reasoning_parser,
        responses_store_mb=args.responses_store_mb,
    )
    for flag, bad in (
        ("--max-inflight must be >= 1", config.max_inflight < 1),
        ("--max-new-tokens-limit must be >= 1", config.max_new_tokens_limit < 1),
        ("--width must be >= 3", config.width < 3),
        ("--call-timeout must be > 0", not config.call_timeout_s > 0),
        ("--queue-timeout must be >= 0", not config.queue_s >= 0),
        ("--grace must be >= 0", not args.grace >= 0),
        ("--responses-store-mb must be >= 0", config.responses_store_mb < 0),
    ):
        if bad:
            p.error(flag)
    if not 1 <= config.default_draft_block <= config.width - 2:
        p.error(f"--default-draft-block must be in 1..{config.width - 2}")
    if not 1 <= config.max_adaptive_k <= config.width - 2:
        p.error(f"--max-adaptive-k must be in 1..{config.width - 2}")
    if not (_addrs(args.prefill) and _addrs(args.decode)) and not args.ray_namespace:
        p.error("give --prefill and --decode addresses (or --ray-namespace)")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        handle, servicer = serve_router(
            prefill=_addrs(args.prefill),
            decode=_addrs(args.decode),
            model_dir=args.model,
            settings=settings,
            worker_settings=worker_settings,
            config=config,
            port=args.port,
            metrics_port=args.metrics_port,
            ray_namespace=args.ray_namespace,
            http_port=args.http_port,
        )
    except (OSError, ValueError, ImportError) as e:
        print(f"router: {e}", file=sys.stderr)
        return 1
    freeze_startup_heap("router")
    stack_sampler.start("router")  # BATON_STACK_SAMPLES only (baton/stack_sampler.py)
    print(f"router: serving on {handle.address}", flush=True)
    if servicer.http is not None:
        print(f"router: http on {servicer.http.url}", flush=True)
    while not stop.wait(0.5):
        pass
    logging.getLogger("baton.router").info("shutting down (grace %.1fs)", args.grace)
    stop_router(handle, servicer, args.grace)
    stack_sampler.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
