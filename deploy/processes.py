"""Plain-process topology (no Ray): worker subprocesses, plus the helpers both topologies share.

Lifecycle of one worker process (`baton serve --processes`, and the GPU machine, which has no Ray):
    WorkerProcess.start()   `python -m prefill_worker|decode_worker ... --port 0` in its own process
                            group (a Ctrl-C in the terminal reaches only `baton serve`, which then
                            stops things in order); the child arms PR_SET_PDEATHSIG=SIGTERM first
                            thing (baton/lifeline.py), so a parent killed with SIGKILL still leaves
                            no worker behind
    reader thread           drains the child's stdout; parses "<role>: serving on HOST:PORT"
    wait_ready()            address known -> grpc.health.v1 polled until SERVING (weights loaded,
                            graphs captured) -> one "ready" progress line with the seconds it took
    stop(grace)             SIGTERM -> up to `grace` s -> SIGKILL -> reaped (never left a zombie)
    (deploy/supervisor.py)  a worker that exits on its own is started again on the same port

Shared helpers: `health_status(address)` (grpc.health.v1 probe), `Progress` (one stderr line per
worker state change), `WorkerSpec` (role + plain options -> CLI argv or actor kwargs).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from baton.gpus import spread, visible_gpus
from baton.lifeline import child_env

SERVING_RE = re.compile(r"^(?P<role>\w+): serving on (?P<addr>\S+:\d+)\s*$")
ROLES = ("prefill", "decode")


class StartupError(RuntimeError):
    """A worker or the router did not come up (the message says which and why)."""


@dataclass(frozen=True)
class WorkerSpec:
    """Plain options for one worker; the same for a subprocess and for a Ray actor."""

    role: str  # "prefill" | "decode"
    index: int
    model_dir: str | None = None  # None = the embedded default model
    host: str = "127.0.0.1"
    port: int = 0  # 0 = a free port, reported in the "serving on" line
    device: str = "cpu"
    dtype: str | None = None  # None = the worker's default
    engine: str | None = None  # decode only
    engines: str | None = None  # decode only: "bf16,mtp" (None = the worker's default, every engine)
    max_len: int | None = None
    slots: int | None = None  # session slots (None = the worker's default)
    kv_pages: int | None = None  # KV pages per runner (None = the worker's sizing)
    gpu_memory_fraction: float | None = None  # cuda KV sizing (None = the worker's default)
    token_file: str | None = None
    grace: float | None = None  # subprocess only: the worker's own drain time on SIGTERM
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # more --flag value pairs

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def options(self) -> dict[str, object]:
        """Non-empty options by their CLI/keyword name (model_dir, host, port, device, ...)."""
        opts = {
            "model_dir": self.model_dir,
            "host": self.host,
            "port": self.port,
            "device": self.device,
            "dtype": self.dtype,
            "max_len": self.max_len,
            "slots": self.slots,
            "kv_pages": self.kv_pages,
            "gpu_memory_fraction": self.gpu_memory_fraction,
            "token_file": self.token_file,
        }
        if self.role == "decode":
            opts["engine"] = self.engine
            opts["engines"] = self.engines
        opts.update(dict(self.extra))
        return {k: v for k, v in opts.items() if v is not None}

    def argv(self) -> list[str]:
        flags = {"model_dir": "--model"}
        out = [sys.executable, "-u", "-m", f"{self.role}_worker"]
        opts = self.options()
        if self.grace is not None:
            opts["grace"] = self.grace
        for key, value in opts.items():
            out += [flags.get(key, "--" + key.replace("_", "-")), str(value)]
        return out


class Progress:
    """One line per worker state change on stderr: `baton: decode-0 ready on 127.0.0.1:4242 (3.1 s)`."""

    def __init__(self, stream=None):
        self._stream = stream or sys.stderr
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        with self._lock:
            print(f"baton: {text}", file=self._stream, flush=True)


def health_status(address: str, service: str = "", timeout: float = 2.0, settings=None) -> str:
    """grpc.health.v1 status of `address`: SERVING, NOT_SERVING, ... or UNREACHABLE."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from baton.rpc import make_channel

    channel = make_channel(address, settings, attach_token=False)
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError:
        return "UNREACHABLE"
    finally:
        channel.close()


def wait_serving(
    address: str,
    *,
    timeout: float,
    stop: threading.Event | None = None,
    settings=None,
    alive=lambda: True,
    what: str = "server",
) -> None:
    """Poll health until SERVING; StartupError on timeout, on `stop`, or when `alive()` turns False."""
    deadline = time.monotonic() + timeout
    while True:
        if health_status(address, settings=settings) == "SERVING":
            return
        if not alive():
            raise StartupError(f"{what} exited before it was serving")
        if stop is not None and stop.is_set():
            raise StartupError(f"{what}: interrupted while starting")
        if time.monotonic() > deadline:
            raise StartupError(f"{what} at {address} not SERVING after {timeout:.0f} s")
        time.sleep(0.1)


class WorkerProcess:
    """A worker subprocess: start, wait until ready, stop."""

    def __init__(self, spec: WorkerSpec, *, env: dict[str, str] | None = None, echo=None):
        self.spec = spec
        self.address: str | None = None
        self.proc: subprocess.Popen | None = None
        self._env = env
        self._echo = echo if echo is not None else sys.stderr  # where the child's stdout goes
        self._addr_ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._terminated = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "WorkerProcess":
        # NOTE: no preexec_fn (a real fork runs gRPC's fork handlers): the child arms PR_SET_PDEATHSIG
        # itself, from BATON_PARENT_PID (baton/lifeline.py)
        self.proc = subprocess.Popen(
            self.spec.argv(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            bufsize=1,
            env=child_env(self._env),
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._drain, name=f"{self.spec.name}-stdout", daemon=True)
        self._reader.start()
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            m = SERVING_RE.match(line.strip())
            if m and self.address is None:
                self.address = m.group("addr")
                self._addr_ready.set()
            else:
                try:
                    self._echo.write(f"[{self.spec.name}] {line}")
                    self._echo.flush()
                except ValueError:  # echo stream closed during interpreter shutdown
                    return
        self._addr_ready.set()  # EOF: the process is gone

    def wait_ready(self, *, timeout: float, stop: threading.Event | None = None, settings=None) -> str:
        """Blocks until the worker's health is SERVING; returns its address."""
        deadline = time.monotonic() + timeout
        while not self._addr_ready.wait(0.1):
            if stop is not None and stop.is_set():
                raise StartupError(f"{self.spec.name}: interrupted while starting")
            if time.monotonic() > deadline:
                raise StartupError(f"{self.spec.name} printed no 'serving on' line in {timeout:.0f} s")
        if self.address is None:
            raise StartupError(f"{self.spec.name} exited (code {self.proc.wait()}) before serving")
        wait_serving(
            self.address,
            timeout=max(1.0, deadline - time.monotonic()),
            stop=stop,
            settings=settings,
            alive=self.alive,
            what=self.spec.name,
        )
        return self.address

    def terminate(self) -> None:
        """SIGTERM once (a second one could land while the worker is already exiting)."""
        if self.alive() and not self._terminated:
            self._terminated = True
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group: anything the worker forked
            except (ProcessLookupError, PermissionError):
                self.proc.terminate()

    def stop(self, grace: float = 3.0) -> int | None:
        """SIGTERM, wait up to `grace` s, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        return self.proc.returncode


def stop_processes(workers: list[WorkerProcess], grace: float = 3.0, progress: Progress | None = None) -> None:
    """Stops all workers in parallel: SIGTERM to each, then one shared grace period, then SIGKILL."""
    for w in workers:
        w.terminate()
    deadline = time.monotonic() + grace
    for w in workers:
        code = w.stop(grace=max(0.0, deadline - time.monotonic()))
        if code and progress is not None:
            progress.say(f"{w.spec.name} exited with code {code}")


def worker_env(spec: WorkerSpec, n_cpu_workers: int, base: dict[str, str], cpus: int) -> dict[str, str] | None:
    """The environment of one worker process. CPU workers share the machine's cores: each gets
    OMP_NUM_THREADS = cpus // n_cpu_workers (at least 1) unless the caller's environment already sets
    it; without that, every worker's torch uses every core and they slow each other down. GPU workers
    (and an explicit OMP_NUM_THREADS) inherit the environment unchanged (None)."""
    if spec.device != "cpu" or "OMP_NUM_THREADS" in base or n_cpu_workers < 2:
        return None
    return {**base, "OMP_NUM_THREADS": str(max(1, cpus // n_cpu_workers))}


def place_workers(devices: list[str], names: list[str], envs: list, base: dict[str, str], colocate: bool, say) -> list:
    """Each worker's environment (envs[i], None: base unchanged) with its GPU placement: with two or more
    GPUs visible each cuda worker gets one (round-robin in order), with `colocate` every cuda worker gets
    the first; workers that share a GPU get BATON_GPU_WORKERS (how many share it: their KV budgets agree,
    and exact mode's gathers merge, baton/engine/exact_rounds.py rounds_share_a_device) and BATON_GPU_PLAN
    (where they agree: baton/engine/gpu_plan.py), one plan folder per GPU. The launchers' one placement:
    start_processes (`baton serve --processes`) and the benchmarks' controlled topology."""
    envs = list(envs)
    gpu_workers = [i for i, d in enumerate(devices) if d == "cuda"]
    placed = spread(len(gpu_workers), visible_gpus(base), colocate)
    plans: dict[str | None, str] = {}  # GPU (None: the one the environment gives) -> its plan folder
    for i, gpu in zip(gpu_workers, placed):
        if gpu is not None:  # round-robin: prefill and decode workers on their own GPUs (colocate: one)
            envs[i] = {**(envs[i] or base), "CUDA_VISIBLE_DEVICES": gpu}
            say(f"{names[i]} on GPU {gpu}")
        sharing = placed.count(gpu)
        if sharing > 1:  # they agree on their KV budgets (gpu_plan.py): each its own file, so an inherited
            # BATON_GPU_PLAN (one path for all) is replaced: the workers would overwrite one file and wait
            if gpu not in plans:
                plans[gpu] = tempfile.mkdtemp(prefix="baton-gpu-plan-")
                atexit.register(shutil.rmtree, plans[gpu], True)  # restarts reread it until the launcher ends
            folder = plans[gpu]
            plan = {"BATON_GPU_WORKERS": str(sharing), "BATON_GPU_PLAN": os.path.join(folder, names[i])}
            envs[i] = {**(envs[i] or base), **plan}
    return envs


def sharing_note(names: list[str], envs: list, base: dict[str, str], mps: bool) -> str | None:
    """A line for workers placed on a shared GPU (BATON_GPU_WORKERS in their environment, place_workers) when
    serve did not start MPS for them (mps False): whether they reach an MPS daemon already (an operator's,
    deploy/mps.py running_daemon) or run their kernels in turns; None when no GPU is shared or mps."""
    shared = [n for n, e in zip(names, envs) if e is not None and "BATON_GPU_WORKERS" in e]
    if not shared or mps:
        return None
    from deploy.mps import running_daemon

    pipe = running_daemon(base)
    if pipe:
        return f"MPS: {', '.join(shared)} share a GPU and reach the MPS daemon at {pipe}"
    return (
        f"{', '.join(shared)} share a GPU without MPS: their kernels run in turns; --mps runs them side by side "
        "(exact mode at 32 streams 1.085x on an H100)"
    )


def start_processes(
    specs: list[WorkerSpec],
    *,
    progress: Progress,
    timeout: float,
    stop: threading.Event | None = None,
    settings=None,
    colocate: bool = False,
    env: dict[str, str] | None = None,
) -> list[WorkerProcess]:
    """Starts every worker at once and waits until all are SERVING (one progress line each). With two or
    more GPUs visible each cuda worker gets one (round-robin in spec order: prefill-0 the first, decode-0
    the next); with `colocate` every cuda worker gets the first. Workers that share a GPU are told how
    many they are and where they agree on their KV budgets (BATON_GPU_WORKERS, BATON_GPU_PLAN:
    baton/engine/gpu_plan.py). env: variables every worker gets on top of ours (--mps: the daemon's pipe).
    Workers sharing a GPU without an MPS daemon they reach get a line that says so (deploy/mps.py)."""
    n_cpu = sum(s.device == "cpu" for s in specs)
    base, cpus = {**os.environ, **(env or {})}, os.cpu_count() or 1
    envs = [worker_env(s, n_cpu, base, cpus) or (base if env else None) for s in specs]
    envs = place_workers([s.device for s in specs], [s.name for s in specs], envs, base, colocate, progress.say)
    if note := sharing_note([s.name for s in specs], envs, base, mps=bool(env)):
        progress.say(note)
    workers = [WorkerProcess(s, env=e) for s, e in zip(specs, envs)]
    t0 = time.monotonic()
    try:
        for w in workers:
            w.start()
            progress.say(f"{w.spec.name} loading (pid {w.pid})")
        for w in workers:
            addr = w.wait_ready(timeout=max(1.0, timeout - (time.monotonic() - t0)), stop=stop, settings=settings)
            progress.say(f"{w.spec.name} ready on {addr} ({time.monotonic() - t0:.1f} s)")
    except BaseException:
        stop_processes(workers, grace=2.0)
        raise
    return workers
