"""Launch Baton on a Ray cluster: prefill and decode actors, found by the router by name.

    python deploy/launch.py --address HEAD:6379 --model DIR --prefill 2 --decode 2 [--foreground]
    python deploy/launch.py --address HEAD:6379 --stop

Lifecycle:
    connect(address, namespace)     ray.init(address=...) into `namespace` (default "baton")
    start_workers(specs, ...)       one actor per WorkerSpec, named `baton-<role>-<i>`, with resource
                                    requests (num_gpus per worker, or a custom resource such as
                                    {"prefill_node": 1} that only one node type offers), max_restarts
                                    (--max-restarts: -1, forever, by default; N: at most N over the actor's
                                    life) and max_task_retries; detached when the launcher is to exit
    wait_workers(actors, ...)       address() -> grpc.health.v1 SERVING; one progress line each
    router                          --foreground: serve_router() in this process until SIGINT/SIGTERM;
                                    default: a detached `baton-router` actor pinned to the head node
                                    (on --router-host:--router-port; --http-port: its OpenAI HTTP
                                    door) and this process exits
    discovery                       the router re-lists `baton-{prefill,decode}-*` in the namespace,
                                    so an actor that Ray restarted (on a new port) is picked up again
    stop_actors(...) / --stop       stop() each (graceful), then ray.kill(no_restart=True)

Reused by `baton serve` (deploy/local.py) for its local Ray instance. Only plain str/int/float
options cross into Ray (Ray pickles actor arguments itself; Baton never does).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python deploy/launch.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.rpc import port_arg  # noqa: E402
from deploy.processes import Progress, StartupError, WorkerSpec, wait_serving  # noqa: E402
from deploy.router_launch import (  # noqa: E402
    TASK_RETRIES,
    router_kwargs,
    router_options,
    serve_router,
    start_router_actor,
)
from deploy.serve_args import add_prefill_options, add_router_options, options_error, prefill_extra  # noqa: E402

DEFAULT_NAMESPACE = "baton"


def actor_name(role: str, index: int) -> str:
    return f"baton-{role}-{index}"


def use_ray_token_if_present() -> None:
    """Ray >= 2.5x clusters use token auth by default, but a driver given an explicit address only
    sends the token when RAY_AUTH_MODE=token: set it when a token is at hand (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and the mode was not chosen explicitly."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        os.environ["RAY_AUTH_MODE"] = "token"


def connect(address: str | None, namespace: str) -> None:
    """Joins the Ray cluster at `address` ("auto" = RAY_ADDRESS or the local head)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    use_ray_token_if_present()
    import ray

    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=True, logging_level=logging.WARNING)


def _actor_class(role: str, *, num_gpus: float, resources: dict[str, float] | None, max_restarts: int = -1):
    if role == "prefill":
        from prefill_worker.actor import make_actor_class
    elif role == "decode":
        from decode_worker.actor import make_actor_class
    else:
        raise ValueError(f"role: {role!r} is not prefill or decode")
    return make_actor_class(num_gpus=num_gpus, resources=resources or None, max_restarts=max_restarts)


def start_workers(
    specs: list[WorkerSpec],
    *,
    namespace: str,
    num_gpus: float = 0.0,
    resources: dict[str, dict[str, float]] | None = None,
    detached: bool = False,
    num_cpus: float = 1.0,
    env: dict[str, str] | None = None,
    gpu_share=None,
    max_restarts: int = -1,
) -> dict[str, object]:
    """Creates one named actor per spec (or reuses a live one of that name); returns name -> handle.

    resources: role -> custom resource request, e.g. {"decode": {"decode_node": 1}}.
    env: extra environment for the actor processes (e.g. BATON_TOKEN).
    gpu_share: a created deploy.ray_gpus.GpuShare: each actor in its GPU bundle, with the KV plan of the
    actors that share it (num_gpus is then the share's). max_restarts: Ray's, each actor's restarts over its
    life (-1: forever; deploy/launch.py and `baton serve` --max-restarts)."""
    resources = resources or {}
    actors: dict[str, object] = {}
    for spec in specs:
        cls = _actor_class(spec.role, num_gpus=num_gpus, resources=resources.get(spec.role), max_restarts=max_restarts)
        opts = dict(
            name=actor_name(spec.role, spec.index),
            namespace=namespace,
            get_if_exists=True,
            max_task_retries=TASK_RETRIES if max_restarts else 0,  # Ray: none without restarts
            num_cpus=num_cpus,
        )
        if detached:
            opts["lifetime"] = "detached"
        actor_env = dict(env or {})
        if gpu_share is not None:
            placed, plan_env = gpu_share.actor_options(opts["name"])
            opts.update(placed)
            actor_env.update(plan_env)
        if actor_env:
            opts["runtime_env"] = {"env_vars": actor_env}
        # NOTE: get_if_exists: a second launch reuses live actors (and ignores new options: --stop first)
        actors[opts["name"]] = cls.options(**opts).remote(**spec.options())
    return actors


def wait_workers(
    actors: dict[str, object], *, progress: Progress, timeout: float, stop=None, settings=None
) -> dict[str, str]:
    """Waits until every actor answers address() and its server is SERVING; returns name -> address."""
    import ray

    t0 = time.monotonic()
    for name in actors:
        progress.say(f"{name.removeprefix('baton-')} loading (Ray actor)")
    pending = {actors[n].address.remote(): n for n in actors}
    addresses: dict[str, str] = {}
    while pending:
        if stop is not None and stop.is_set():
            raise StartupError("interrupted while workers were loading")
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            raise StartupError(f"{', '.join(sorted(pending.values()))} not ready after {timeout:.0f} s")
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(0.5, left))
        for ref in done:
            name = pending.pop(ref)
            try:
                addr = str(ray.get(ref))
            except Exception as e:
                raise StartupError(f"{name} failed to start: {e}") from e
            wait_serving(
                addr, timeout=max(1.0, timeout - (time.monotonic() - t0)), stop=stop, settings=settings, what=name
            )
            addresses[name] = addr
            progress.say(f"{name.removeprefix('baton-')} ready on {addr} ({time.monotonic() - t0:.1f} s)")
    return addresses


def stop_actors(actors, *, grace: float = 2.0) -> None:
    """Graceful stop() on each actor (up to `grace` s in all), then kill without restart."""
    import ray

    handles = list(actors.values()) if isinstance(actors, dict) else list(actors)
    refs = []
    for a in handles:
        try:
            refs.append(a.stop.remote(grace))
        except Exception:
            pass
    if refs:
        try:
            ray.wait(refs, num_returns=len(refs), timeout=grace)
        except Exception:
            pass
    for a in handles:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass


def named_actors(namespace: str) -> dict[str, object]:
    """Live `baton-*` actors of `namespace` (workers and router)."""
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == namespace and entry["name"].startswith("baton-"):
            try:
                out[entry["name"]] = ray.get_actor(entry["name"], namespace=namespace)
            except ValueError:
                continue
    return out


# ------------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="Ray cluster address (default: RAY_ADDRESS / local head)")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Ray namespace of the named actors")
    p.add_argument(
        "--model", default=None, help="checkpoint dir, the same path on every node (default: the embedded model)"
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill actors")
    p.add_argument("--decode", type=int, default=1, help="decode actors")
    p.add_argument("--engine", default=None, choices=("bf16", "fp8", "mtp"), help="decode engine")
    p.add_argument(
        "--engines",
        default=None,
        metavar="LIST",
        help="engines each decode actor offers, comma-separated (default: all the checkpoint supports; "
        "without fp8 no FP8 weight copy is made)",
    )
    p.add_argument(
        "--device", default=None, choices=("cpu", "cuda"), help="default: cuda when --gpus-per-worker > 0, else cpu"
    )
    p.add_argument(
        "--dtype", default=None, choices=("bf16", "fp32"), help="worker dtype (default: bf16 on cuda, fp32 on cpu)"
    )
    p.add_argument("--max-len", type=int, default=None, help="context window per worker")
    p.add_argument(
        "--gpus-per-worker",
        type=float,
        default=1.0,
        help="num_gpus of each worker actor; F < 1: floor(1 / F) workers share a GPU, in placement-group bundles, "
        "and agree on their KV budgets (deploy/ray_gpus.py)",
    )
    p.add_argument("--slots", type=int, default=None, help="concurrent sessions per worker (default: the workers')")
    p.add_argument(
        "--kv-pages", type=int, default=None, help="KV pages of 256 tokens per worker runner (default: sized)"
    )
    p.add_argument(
        "--gpu-memory-fraction", type=float, default=None, help="cuda KV sizing: share of GPU memory (default 0.9)"
    )
    add_prefill_options(p)  # --prefill-budget, --prefix-cache
    p.add_argument("--prefill-resource", default=None, help='custom resource for prefill actors (e.g. prefill_node)')
    p.add_argument("--decode-resource", default=None, help='custom resource for decode actors (e.g. decode_node)')
    p.add_argument("--worker-host", default="0.0.0.0", help="bind host of the worker servers")
    p.add_argument("--router-host", default="0.0.0.0", help="bind host of the router")
    p.add_argument("--router-port", type=port_arg, default=50051, help="the router's gRPC port (default 50051)")
    add_router_options(p, http_port=0)  # --http-port (off unless given), --reasoning-parser, --draft-length
    p.add_argument("--token-file", default=None, help="bearer token file (the same path on every node)")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        metavar="N",
        help="Generate calls the router admits at once (default: the larger of 64 and the decode actors' sessions)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a new request waits in line while the session slots are full (default 30; 0: refused at once)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the workers")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=-1,
        metavar="N",
        help="each worker actor is restarted at most N times over its life (Ray's max_restarts), then stays dead "
        "and the router serves with the others (default -1: forever; 0: never)",
    )
    p.add_argument(
        "--foreground",
        action="store_true",
        help="run the router in this process until signalled (the actors then live only as long as this process)",
    )
    p.add_argument("--stop", action="store_true", help="stop every baton-* actor of the namespace and exit")


def specs_from_args(args) -> list[WorkerSpec]:
    device = args.device or ("cuda" if args.gpus_per_worker > 0 else "cpu")
    common = dict(
        model_dir=args.model,
        host=args.worker_host,
        device=device,
        dtype=args.dtype,
        max_len=args.max_len,
        token_file=args.token_file,
        slots=getattr(args, "slots", None),
        kv_pages=getattr(args, "kv_pages", None),
        gpu_memory_fraction=getattr(args, "gpu_memory_fraction", None),
    )
    return [WorkerSpec("prefill", i, extra=prefill_extra(args), **common) for i in range(args.prefill)] + [
        WorkerSpec("decode", i, engine=args.engine, engines=args.engines, **common) for i in range(args.decode)
    ]


def _group_name(namespace: str) -> str:
    return f"{namespace}-gpu-bundles"


def _gpu_share(args, specs, resources, progress):
    """--gpus-per-worker F < 1: the workers in GPU bundles with the KV plan of those that share one
    (deploy/ray_gpus.py; plan folders under /tmp on each node, one per launch); None otherwise, or with a
    custom resource (a bundle holds GPU and CPU only: the workers then size their KV alone, give each
    --kv-pages)."""
    if not 0 < args.gpus_per_worker < 1:
        return None
    if resources:
        progress.say("--gpus-per-worker < 1 with a custom resource: no shared-GPU KV plan (give --kv-pages)")
        return None
    import uuid

    import ray

    from deploy.ray_gpus import GpuShare

    share = GpuShare.for_fraction([actor_name(s.role, s.index) for s in specs], args.gpus_per_worker)
    root = f"/tmp/baton-gpu-plan-{args.namespace}-{uuid.uuid4().hex[:8]}"
    try:
        share.create(ray, root, timeout=args.timeout, name=_group_name(args.namespace), detached=not args.foreground)
    except TimeoutError as e:
        raise StartupError(str(e)) from None
    progress.say(share.describe())
    return share


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploy/launch.py", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if err := options_error(args):
        p.error(err)
    progress = Progress()
    connect(args.address, args.namespace)
    import ray

    # NOTE: after ray.init: Ray's core installs a SIGTERM handler that aborts; make it an interrupt
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    if args.stop:
        found = named_actors(args.namespace)
        stop_actors(found)
        from deploy.ray_gpus import remove_named

        gone = remove_named(_group_name(args.namespace))
        progress.say(
            f"stopped {len(found)} actor(s) in namespace {args.namespace!r}" + (" and its GPU bundles" if gone else "")
        )
        return 0
    res = {r: {name: 1.0} for r, name in (("prefill", args.prefill_resource), ("decode", args.decode_resource)) if name}
    token = os.environ.get("BATON_TOKEN")
    env = {"BATON_TOKEN": token} if token else None  # the actors' runtime_env; or --token-file
    specs = specs_from_args(args)
    share = _gpu_share(args, specs, res, progress)
    actors = start_workers(
        specs,
        namespace=args.namespace,
        num_gpus=args.gpus_per_worker,
        resources=res,
        detached=not args.foreground,
        env=env,
        gpu_share=share,
        max_restarts=args.max_restarts,
    )
    try:
        addrs = wait_workers(actors, progress=progress, timeout=args.timeout)
    except (KeyboardInterrupt, StartupError) as e:
        progress.say(f"start-up failed: {e or 'interrupted'}; stopping the actors")
        stop_actors(actors)
        if share is not None:
            share.remove(ray)
        return 1
    pre = [a for n, a in addrs.items() if "-prefill-" in n]
    dec = [a for n, a in addrs.items() if "-decode-" in n]
    kw = router_kwargs(
        host=args.router_host, port=args.router_port, namespace=args.namespace, prefill=pre, decode=dec,
        **router_options(args),
    )  # fmt: skip
    if args.foreground:
        from deploy.local import serve_until_signalled

        def cleanup():
            stop_actors(actors)
            if share is not None:
                share.remove(ray)

        return serve_until_signalled(lambda: serve_router(**kw), cleanup=cleanup, progress=progress)
    router = start_router_actor(namespace=args.namespace, env=env, **kw)
    address = ray.get(router.address.remote(), timeout=args.timeout)
    wait_serving(address, timeout=60.0, what="router")
    print(f"baton: serving on {address}", flush=True)
    if args.http_port and (url := ray.get(router.http_url.remote(), timeout=args.timeout)):
        print(f"baton: http on {url}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
