"""`baton serve`: the whole topology on one machine: N prefill + M decode workers and the router.

Lifecycle:
    check        options, model dir, token file; the router's --port / --http-port bindable (else one line,
                 exit 2, before any worker loads)
    start        Ray (default): join RAY_ADDRESS, or start a private local instance (own temp dir,
                 no dashboard, no usage stats, Ray's token auth); N+M named actors via deploy/launch.py.
                 --processes: N+M worker subprocesses via deploy/processes.py (no Ray at all),
                 restarted on the same port when one exits on its own (as Ray restarts actors); a
                 worker that exits more than --max-restarts times in 10 minutes is given up on: one
                 line naming it, then the same clean-up as a signal's, exit 1.
                 One progress line per worker: loading, then ready with the seconds it took.
    serve        the router in this process, given the workers' addresses (and, with Ray, the
                 namespace, so an actor Ray restarts on a new port is found again); once its health
                 is SERVING, exactly one line on stdout: `baton: serving on HOST:PORT`; then, with the
                 HTTP API on (--http-port, default 8000; 0 = off), `baton: http on http://HOST:PORT`
    --ask TEXT   then one request through the router, as a client sends it (gRPC, the token): its
                 answer is one more stdout line, `baton: answer {json}`; serving goes on
    SIGINT/TERM  router health -> NOT_SERVING and no new RPCs; in-flight ones get `--grace` s (then
                 UNAVAILABLE "router: shutting down", router/drain.py);
                 then workers stop (actors stopped and killed / processes SIGTERM, then SIGKILL,
                 reaped); the Ray instance this command started is shut down and its temp dir
                 removed. Exit 0, within ~10 s. A signal during start-up aborts the start-up and
                 runs the same clean-up.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from baton import stack_sampler
from deploy.processes import (
    Progress,
    StartupError,
    WorkerSpec,
    start_processes,
    stop_processes,
    wait_serving,
)
from deploy.serve_args import ENGINES, add_arguments, prefill_extra  # noqa: F401 (re-exported: bench_serve, tests)
from deploy.serve_args import check as _check
from deploy.supervisor import DEFAULT_MAX_RESTARTS, GaveUp, Supervisor


class _Signals:
    """SIGINT/SIGTERM: during start-up raise KeyboardInterrupt (unwinds into the clean-up); while
    serving set `stop`; while stopping, ignore (the clean-up is already bounded)."""

    def __init__(self):
        self.stop = threading.Event()
        self.phase = "starting"
        self._old = {}

    def _handle(self, signum, frame):
        if self.phase == "starting":
            self.phase = "stopping"
            raise KeyboardInterrupt(signal.Signals(signum).name)
        self.stop.set()

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            old = signal.signal(s, self._handle)
            self._old.setdefault(s, old)
        return self

    def reinstall(self) -> None:
        """After ray.init: its C++ core installs a failure handler that aborts on SIGTERM."""
        self.__enter__()

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def _router_probe_address(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "::", "") else address


def serve_until_signalled(
    start_router: Callable[[], object],
    *,
    cleanup: Callable[[], None],
    progress: Progress,
    grace: float = 2.5,
    sig: _Signals | None = None,
    tick: Callable[[], None] | None = None,
    on_serving: Callable[[str], None] | None = None,
) -> int:
    """Starts the router, prints the serving line once it is SERVING, runs on_serving(address) on a
    thread, calls `tick` every 0.5 s until SIGINT/SIGTERM, then stops the router (grace for in-flight
    RPCs) and runs `cleanup` (the workers)."""
    own = sig is None
    sig = sig or _Signals().__enter__()
    router, rc = None, 0
    try:
        router = start_router()
        wait_serving(_router_probe_address(router.address), timeout=120.0, what="router")
        sig.phase = "serving"
        stack_sampler.start("router")  # BATON_STACK_SAMPLES only (baton/stack_sampler.py)
        print(f"baton: serving on {router.address}", flush=True)
        if getattr(router, "http_url", None):
            print(f"baton: http on {router.http_url}", flush=True)
        if on_serving is not None:
            threading.Thread(
                target=on_serving, args=(_router_probe_address(router.address),), daemon=True, name="baton-ask"
            ).start()
        while not sig.stop.wait(0.5):
            if tick is not None:
                tick()
        progress.say("stopping: router no longer accepts requests")
    except KeyboardInterrupt:
        progress.say("interrupted: stopping")
    except GaveUp as e:  # a worker kept dying (Supervisor): serving stops, the supervisor of this one decides
        progress.say(f"{e}: stopping")
        rc = 1
    except (StartupError, OSError, ValueError, ImportError) as e:
        progress.say(f"router failed to start: {e}")
        rc = 1
    finally:
        sig.phase = "stopping"
        t0 = time.monotonic()
        if router is not None:
            try:
                router.stop(grace)
                progress.say(f"router stopped ({time.monotonic() - t0:.1f} s)")
                stack_sampler.write()
            except Exception as e:  # keep going: the workers must still be stopped
                progress.say(f"router stop failed: {e}")
        try:
            cleanup()
        finally:
            if own:
                sig.__exit__()
        progress.say(f"stopped ({time.monotonic() - t0:.1f} s)")
    return rc


# ------------------------------------------------------------------------------------------- Ray
class _LocalRay:
    """ray.init into RAY_ADDRESS, or a private instance this object also shuts down."""

    def __init__(self, namespace: str | None):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.joined = bool(os.environ.get("RAY_ADDRESS"))
        if self.joined:
            from deploy.launch import use_ray_token_if_present

            use_ray_token_if_present()  # before `import ray`: its config reads RAY_AUTH_MODE
        try:
            import ray
        except ImportError as e:
            raise StartupError(f"Ray is not usable here ({e}): run `baton serve --processes`") from None

        self.ray = ray
        self.temp_dir = None
        self.namespace = namespace or (f"baton-serve-{os.getpid()}" if self.joined else "baton")

    def start(self, num_workers: int) -> None:
        ray = self.ray
        if self.joined:
            ray.init(
                address=os.environ["RAY_ADDRESS"], namespace=self.namespace, log_to_driver=True, logging_level="WARNING"
            )
        else:
            # NOTE: short path: Ray's unix sockets live under it (108-byte limit).
            self.temp_dir = tempfile.mkdtemp(prefix="baton-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
            ray.init(
                address="local",
                namespace=self.namespace,
                include_dashboard=False,
                _temp_dir=self.temp_dir,
                num_cpus=max(os.cpu_count() or 1, num_workers + 1),
                object_store_memory=128 * 1024 * 1024,
                log_to_driver=True,
                logging_level="WARNING",
            )

    def gpu_share(self, names: list[str], device: str):
        """cuda: the workers' GPU placement (deploy/ray_gpus.py: round-robin, a KV plan where they share one),
        its placement group created; None on cpu."""
        if device != "cuda":
            return None
        from deploy.ray_gpus import GpuShare

        gpus = int(self.ray.cluster_resources().get("GPU", 0.0))
        if gpus < 1:
            raise StartupError("--device cuda: Ray sees no GPU on this machine")
        share, root = GpuShare.plan(names, gpus), tempfile.mkdtemp(prefix="baton-gpu-plan-")
        try:
            share.create(self.ray, root)
        except TimeoutError as e:
            shutil.rmtree(root, ignore_errors=True)
            raise StartupError(str(e)) from None
        return share

    def unshare(self, share) -> None:
        share.remove(self.ray)
        shutil.rmtree(share.plan_root, ignore_errors=True)

    def shutdown(self) -> None:
        self.ray.shutdown()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _worker_specs(args) -> list[WorkerSpec]:
    # NOTE: both roles get the same dtype and window (exact mode compares their rows bit for bit)
    common = dict(
        model_dir=args.model,
        host="127.0.0.1",
        device=args.device,
        dtype=args.dtype,
        max_len=args.max_len,
        slots=args.slots,
        kv_pages=getattr(args, "kv_pages", None),  # NOTE: callers may build args without the newer options
        gpu_memory_fraction=getattr(args, "gpu_memory_fraction", None),
        token_file=args.token_file,
        grace=min(args.grace, 1.0),
    )
    extra = prefill_extra(args)
    return [WorkerSpec("prefill", i, extra=extra, **common) for i in range(args.prefill)] + [
        WorkerSpec("decode", i, engine=args.engine, engines=getattr(args, "engines", None), **common)
        for i in range(args.decode)
    ]


def run(args) -> int:
    from baton.logs import setup_logging
    from baton.settings import Settings

    err = _check(args)
    if err:
        print(f"baton serve: {err}", file=sys.stderr)
        return 2
    try:
        settings = Settings.from_env()
    except ValueError as e:  # SettingsError: names the variable
        print(f"baton serve: {e}", file=sys.stderr)
        return 2
    setup_logging(settings)
    host = args.host or settings.host
    from deploy.serve_args import ports_error

    if err := ports_error(host, args.port, args.http_port):
        print(f"baton serve: {err}", file=sys.stderr)
        return 2
    progress = Progress()
    specs = _worker_specs(args)
    cleanups: list[Callable[[], None]] = []

    def cleanup() -> None:
        for fn in reversed(cleanups):
            try:
                fn()
            except Exception as e:
                progress.say(f"clean-up step failed: {e}")

    tick = None
    with _Signals() as sig:
        try:
            if args.processes:
                namespace = None
                place = dict(progress=progress, timeout=args.timeout, stop=sig.stop, colocate=args.colocate)
                if getattr(args, "mps", False):  # stopped last: cleanups run in reverse, after the workers'
                    from deploy.mps import MpsDaemon

                    mps = MpsDaemon().start()
                    cleanups.append(mps.stop)
                    progress.say(mps.describe())
                    place["env"] = mps.env
                procs = start_processes(specs, **place)  # cuda, 2+ GPUs: one each (--colocate: the first)
                # the router has drained by then: a worker gets 1 s to drain, then time to exit
                cleanups.append(lambda: stop_processes(procs, grace=4.0, progress=progress))
                restarts = DEFAULT_MAX_RESTARTS if getattr(args, "max_restarts", None) is None else args.max_restarts
                supervisor = Supervisor(procs, progress=progress, timeout=args.timeout, max_restarts=restarts)
                tick = lambda: supervisor.check(sig.stop)  # noqa: E731
                addresses = {p.spec.name: p.address for p in procs}
            else:
                from deploy import launch

                progress.say("starting Ray" + (" (joining RAY_ADDRESS)" if os.environ.get("RAY_ADDRESS") else ""))
                t0 = time.monotonic()
                ray_ctx = _LocalRay(args.namespace)
                cleanups.append(ray_ctx.shutdown)
                ray_ctx.start(len(specs))
                sig.reinstall()
                progress.say(f"Ray ready ({time.monotonic() - t0:.1f} s, namespace {ray_ctx.namespace!r})")
                namespace = ray_ctx.namespace
                token = os.environ.get("BATON_TOKEN")
                share = ray_ctx.gpu_share([launch.actor_name(s.role, s.index) for s in specs], args.device)
                if share is not None:
                    cleanups.append(lambda: ray_ctx.unshare(share))
                    progress.say(share.describe())
                actors = launch.start_workers(
                    specs,
                    namespace=namespace,
                    env={"BATON_TOKEN": token} if token else None,
                    gpu_share=share,
                    max_restarts=-1 if getattr(args, "max_restarts", None) is None else args.max_restarts,
                )
                cleanups.append(lambda: launch.stop_actors(actors, grace=args.grace))
                got = launch.wait_workers(actors, progress=progress, timeout=args.timeout, stop=sig.stop)
                addresses = {n.removeprefix("baton-"): a for n, a in got.items()}
            # NOTE: in the try: these imports take seconds (torch), and a signal then must still clean up
            from deploy.router_launch import router_kwargs, router_options, serve_router

            kw = router_kwargs(
                host=host,
                port=args.port,
                namespace=namespace,
                prefill=[a for n, a in addresses.items() if n.startswith("prefill-")],
                decode=[a for n, a in addresses.items() if n.startswith("decode-")],
                **router_options(args),
            )
            on_serving = None
            if args.ask is not None:
                token = Path(args.token_file).read_text().strip() if args.token_file else None

                def on_serving(addr):
                    from deploy.router_launch import ask

                    return ask(addr, args.ask, args.ask_tokens, token=token, progress=progress)
        except KeyboardInterrupt:
            progress.say("interrupted while starting: stopping")
            cleanup()
            return 0
        except StartupError as e:
            progress.say(f"start-up failed: {e}")
            cleanup()
            return 1
        except BaseException:
            cleanup()
            raise

        return serve_until_signalled(
            lambda: serve_router(**kw),
            cleanup=cleanup,
            progress=progress,
            grace=args.grace,
            sig=sig,
            tick=tick,
            on_serving=on_serving,
        )
