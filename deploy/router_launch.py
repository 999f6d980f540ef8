"""The router stage of a deployment: its keyword arguments, the in-process router (`serve_router`,
`RouterHandle`) and the detached Ray actor that hosts it (`start_router_actor`, pinned to the head node,
restarted on failure), and `ask`: one request through it as a client sends it (`baton serve --ask`). Used by deploy/launch.py (a Ray cluster) and deploy/local.py (`baton serve`)."""

from __future__ import annotations

import time

ROUTER_NAME = "baton-router"
TASK_RETRIES = 3  # address()/health()/stats() calls survive an actor restart


def router_kwargs(
    *,
    host: str,
    port: int,
    namespace: str | None,
    prefill=(),
    decode=(),
    model_dir=None,
    token_file=None,
    http_port: int = 0,
    max_inflight: int | None = None,
    draft_length: str | None = None,
    queue_s: float | None = None,
    reasoning_parser: str | None = None,
    responses_store_mb: int | None = None,
) -> dict:
    """Plain keyword arguments for serve_router (they may cross into a Ray actor)."""
    return dict(
        max_inflight=max_inflight,
        draft_length=draft_length,
        queue_s=queue_s,
        reasoning_parser=reasoning_parser,
        responses_store_mb=responses_store_mb,
        host=host,
        port=port,
        prefill=list(prefill),
        decode=list(decode),
        ray_namespace=namespace,
        model_dir=model_dir,
        token_file=token_file,
        http_port=http_port,
    )


class RouterHandle:
    """The in-process router: `.address` ("host:port") and `.stop(grace)`."""

    def __init__(self, handle, servicer, stop_fn):
        self._handle, self._servicer, self._stop_fn = handle, servicer, stop_fn
        self.address = handle.address
        self.port = handle.port
        http = getattr(servicer, "http", None)
        self.http_url = http.url if http is not None else None  # the HTTP API (router/http), or None

    def stop(self, grace: float = 2.5) -> None:
        """Health NOT_SERVING, no new RPCs, in-flight ones get `grace` s; then polling stops."""
        self._stop_fn(self._handle, self._servicer, grace)


def router_options(args) -> dict:
    """The router_kwargs both launchers take from their parsed options alike (`baton serve`, deploy/launch.py;
    deploy/serve_args.py: add_router_options): the model, the token, the HTTP door, the admission limits, exact
    mode's K policy and the reasoning parser. Imports the workers' defaults (torch: seconds) when called."""
    from baton.worker.options import DEFAULT_SLOTS
    from router.config import DEFAULT_QUEUE_S

    queue_s = getattr(args, "queue_timeout", None)
    return dict(
        model_dir=args.model,
        token_file=args.token_file,
        http_port=args.http_port,
        max_inflight=args.max_inflight or max(64, (args.slots or DEFAULT_SLOTS) * args.decode),
        draft_length=getattr(args, "draft_length", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        responses_store_mb=getattr(args, "responses_store_mb", None),
        queue_s=DEFAULT_QUEUE_S if queue_s is None else queue_s,
    )


def serve_router(
    *,
    host: str,
    port: int,
    prefill=(),
    decode=(),
    ray_namespace=None,
    model_dir=None,
    token_file=None,
    http_port: int = 0,
    max_inflight: int | None = None,
    draft_length: str | None = None,
    queue_s: float | None = None,
    reasoning_parser: str | None = None,
    responses_store_mb: int | None = None,
) -> RouterHandle:
    """Starts the router in this process (router.service / router.__main__ serve_router); max_inflight,
    draft_length (exact mode's K per round: baton/engine/draft_length.py), queue_s (how long a new request
    waits for a session slot: router/slot_line.py), reasoning_parser (HTTP chat's: router/http/reasoning.py),
    responses_store_mb (the Responses API's stored responses: router/http/response_store.py)
    None: RouterConfig's defaults."""
    from baton.settings import Settings, read_token_file
    from router.service import RouterConfig

    try:
        from router.service import serve_router as _serve
        from router.service import stop_router
    except ImportError:
        from router.__main__ import serve_router as _serve
        from router.__main__ import stop_router
    settings = Settings.from_env(token=read_token_file(token_file) if token_file else None, host=host)
    handle, servicer = _serve(
        prefill=list(prefill),
        decode=list(decode),
        model_dir=model_dir,
        settings=settings,
        host=host,
        port=port,
        ray_namespace=ray_namespace,
        http_port=http_port,
        config=RouterConfig(
            **({"max_inflight": max_inflight} if max_inflight else {}),
            **({"draft_length": draft_length} if draft_length else {}),
            **({"queue_s": queue_s} if queue_s is not None else {}),
            **({"reasoning_parser": reasoning_parser} if reasoning_parser else {}),
            **({"responses_store_mb": responses_store_mb} if responses_store_mb is not None else {}),
        ),
    )
    return RouterHandle(handle, servicer, stop_router)


def _reachable(address: str) -> str:
    """A wildcard bind address ("0.0.0.0:P") as this node's IP, for other nodes to dial."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        import ray

        host = ray.util.get_node_ip_address()
    return f"{host}:{port}"


def make_router_actor_class():
    """A Ray actor hosting the router (placed on the head node, restarted on failure)."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=TASK_RETRIES)
    class RouterActor:
        def __init__(self, **kw):
            self._router = serve_router(**kw)

        def address(self) -> str:
            return _reachable(self._router.address)

        def http_url(self) -> str | None:
            """The OpenAI HTTP API's URL (--http-port), or None when it is off."""
            return getattr(self._router, "http_url", None)

        def stop(self, grace: float = 2.0) -> None:
            self._router.stop(grace)

    return RouterActor


def start_router_actor(*, namespace: str, env: dict[str, str] | None = None, **kw):
    opts = dict(
        name=ROUTER_NAME,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        resources={"node:__internal_head__": 0.001},
    )
    if env:
        opts["runtime_env"] = {"env_vars": dict(env)}
    return make_router_actor_class().options(**opts).remote(**kw)


def ask(address: str, prompt: str, max_new_tokens: int, *, token: str | None, progress) -> None:
    """One Generate through the router (fast mode, the default engine) as a client sends it; prints
    `baton: answer {"prompt", "text", "token_ids", "finish_reason", "seconds"}` on stdout. A failure is
    one progress line; serving goes on either way."""
    import json

    import grpc

    from baton.client import Client

    t0 = time.monotonic()
    try:
        with Client(address, token=token) as c:
            deltas = list(c.generate(prompt, max_new_tokens=max_new_tokens, timeout=120))
    except grpc.RpcError as e:
        progress.say(f"--ask failed: {e.code().name}: {e.details()}")
        return
    out = {
        "prompt": prompt,
        "text": "".join(d.text for d in deltas),
        "token_ids": [t for d in deltas for t in d.token_ids],
        "finish_reason": deltas[-1].finish_reason if deltas else None,
        "seconds": round(time.monotonic() - t0, 3),
    }
    print(f"baton: answer {json.dumps(out)}", flush=True)
