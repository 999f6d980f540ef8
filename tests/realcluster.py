"""Real Baton processes for the reliability tests: prefill / decode workers and a router, each its own
`python -m ...` process on a tiny checkpoint, over loopback with a bearer token, one intra-op thread
each (a shared 2-core box), logs at WARNING. Built on deploy.processes.WorkerProcess (PR_SET_PDEATHSIG,
own process group, "serving on" parsing, health wait).

    c = RealCluster(tmp, prefill=1, decode=2, max_len=256, router_args=("--call-timeout", "3"))
    c.start()                       # every process at once; returns when the router is SERVING
    c.client                        # baton.client.Client to the router (token)
    c.stats("decode-0")             # WorkerStats over GetStats; c.sessions() -> {name: sessions} (live ones)
    c.kill / freeze / thaw(name)    # SIGKILL / SIGSTOP / SIGCONT
    c.restart(name); c.ensure_up()  # a killed worker again on its port (as `baton serve --processes` does)
    c.metric("baton_router_workers_up", role="decode")   # the router's /metrics
    c.close()
`reference(model_dir, max_len)` memoizes `baton complete` (the token-identity oracle).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
from conftest import pick_free_port

from baton.client import Client
from baton.rpc import make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from deploy.processes import WorkerProcess, WorkerSpec

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "reliability-secret"


def child_env(**extra) -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        OMP_NUM_THREADS="1",
        BATON_LOG_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
    )
    for k in ("BATON_TOKEN", "BATON_TOKEN_FILE", "BATON_TLS_CERT", "BATON_TLS_KEY", "BATON_TLS_CA", "BATON_HOST"):
        env.pop(k, None)
    env.update(extra)
    return env


class Cmd:
    """Quacks like WorkerSpec for WorkerProcess: `python -u -m MODULE ARGS` (e.g. the router)."""

    port = 0

    def __init__(self, name: str, module: str, args: list[str]):
        self.name, self.module, self.args = name, module, list(args)

    def argv(self) -> list[str]:
        return [sys.executable, "-u", "-m", self.module, *self.args]


def start_cmd(cmd: Cmd, env: dict | None = None) -> WorkerProcess:
    """Start from the calling (main) thread; .wait_ready(timeout=..., settings=...) -> its address."""
    return WorkerProcess(cmd, env=child_env(**(env or {})), echo=open(os.devnull, "w")).start()


class RealCluster:
    def __init__(
        self,
        tmp: Path,
        *,
        prefill: int = 1,
        decode: int = 2,
        max_len: int = 256,
        model_dir=None,
        worker_args: tuple[str, ...] = (),
        decode_args: tuple[str, ...] = (),
        router_args: tuple[str, ...] = (),
        env: dict | None = None,
        token: str | None = TOKEN,
        client_settings: Settings | None = None,
    ):
        self.tmp, self.max_len, self.token = Path(tmp), max_len, token
        self.model_dir = str(model_dir) if model_dir else None
        self.env = child_env(**(env or {}))
        self.token_file = None
        if token:
            self.token_file = self.tmp / "token"
            self.token_file.write_text(token)

        def pairs(args):  # ("--ttl", "6") -> (("ttl", "6"),): WorkerSpec.extra keys are option names
            return tuple((k.lstrip("-").replace("-", "_"), v) for k, v in zip(args[::2], args[1::2]))

        extra = pairs(worker_args)
        common = dict(
            model_dir=self.model_dir, max_len=max_len, token_file=str(self.token_file) if token else None, grace=0.5
        )
        self.specs = {
            f"prefill-{i}": WorkerSpec("prefill", i, port=pick_free_port(), extra=extra, **common)
            for i in range(prefill)
        }
        dextra = extra + pairs(decode_args)
        self.specs.update(
            {
                f"decode-{i}": WorkerSpec("decode", i, port=pick_free_port(), extra=dextra, **common)
                for i in range(decode)
            }
        )
        self.addr = {n: f"127.0.0.1:{s.port}" for n, s in self.specs.items()}
        self.metrics_port = pick_free_port()
        ra = [
            "--port",
            "0",
            "--prefill",
            ",".join(a for n, a in self.addr.items() if n.startswith("prefill")),
            "--decode",
            ",".join(a for n, a in self.addr.items() if n.startswith("decode")),
            "--metrics-port",
            str(self.metrics_port),
            "--grace",
            "1",
            *router_args,
        ]
        if self.model_dir:
            ra += ["--model", self.model_dir]
        if token:
            ra += ["--token-file", str(self.token_file)]
        self.router_spec = Cmd("router", "router", ra)
        self.procs: dict[str, WorkerProcess] = {}
        self.router: WorkerProcess | None = None
        self.router_addr: str | None = None
        self.client: Client | None = None
        self.frozen: set[str] = set()
        self.settings = client_settings or Settings(token=token)  # clients of every server (TLS files)

    # ---- lifecycle -------------------------------------------------------------------------------
    def _proc(self, spec) -> WorkerProcess:
        return WorkerProcess(spec, env=self.env, echo=open(os.devnull, "w"))

    def start(self, timeout: float = 180.0) -> "RealCluster":
        # NOTE: started from this (the main) thread: PR_SET_PDEATHSIG follows the forking thread
        for name, spec in self.specs.items():
            self.procs[name] = self._proc(spec).start()
        self.router = self._proc(self.router_spec).start()
        for name, p in self.procs.items():
            p.wait_ready(timeout=timeout, settings=self.settings)
        self.router_addr = self.router.wait_ready(timeout=timeout, settings=self.settings)
        self.client = Client(self.router_addr, settings=self.settings)
        return self

    def alive(self, name: str) -> bool:
        return self.procs[name].alive()

    def live(self, role: str | None = None) -> list[str]:
        return [n for n in self.procs if self.alive(n) and (role is None or n.startswith(role))]

    def restart(self, *names: str, timeout: float = 120.0) -> None:
        """Start the named (dead) workers again on their ports, in parallel; wait until SERVING."""
        for n in names:
            self.procs[n].stop(grace=0.5)
            self.frozen.discard(n)
            self.procs[n] = self._proc(replace(self.specs[n])).start()
        for n in names:
            self.procs[n].wait_ready(timeout=timeout, settings=self.settings)

    def ensure_up(self, timeout: float = 10.0) -> None:
        """Every worker alive and unfrozen, the router sees all of them, no session left anywhere."""
        for n in list(self.frozen):
            self.thaw(n)
        dead = [n for n in self.procs if not self.alive(n)]
        if dead:
            self.restart(*dead)
        n_p = sum(1 for n in self.procs if n.startswith("prefill"))
        self.wait_metric("baton_router_workers_up", n_p, timeout, role="prefill")
        self.wait_metric("baton_router_workers_up", len(self.procs) - n_p, timeout, role="decode")
        self.wait_no_sessions(timeout)

    def close(self) -> None:
        for n in list(self.frozen):
            self.thaw(n)
        if self.client is not None:
            self.client.close()
        for p in [self.router, *self.procs.values()]:
            if p is not None:
                p.stop(grace=2.0)

    # ---- signals ---------------------------------------------------------------------------------
    def pid(self, name: str) -> int:
        return (self.router if name == "router" else self.procs[name]).pid

    def kill(self, name: str) -> None:
        p = self.procs[name]
        os.kill(p.pid, signal.SIGKILL)
        p.proc.wait(10)
        self.frozen.discard(name)

    def freeze(self, *names: str) -> None:
        for n in names:
            os.kill(self.pid(n), signal.SIGSTOP)
            self.frozen.add(n)

    def thaw(self, *names: str) -> None:
        for n in names:
            if self.alive(n):
                os.kill(self.pid(n), signal.SIGCONT)
            self.frozen.discard(n)

    # ---- observation -----------------------------------------------------------------------------
    def stats(self, name: str, timeout: float = 5.0) -> common_pb2.WorkerStats:
        stub = prefill_pb2_grpc.PrefillWorkerStub if name.startswith("prefill") else decode_pb2_grpc.DecodeWorkerStub
        with make_channel(self.addr[name], self.settings) as ch:
            return stub(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=timeout)

    def release(self, name: str, session_id: str) -> bool:
        stub = prefill_pb2_grpc.PrefillWorkerStub if name.startswith("prefill") else decode_pb2_grpc.DecodeWorkerStub
        with make_channel(self.addr[name], self.settings) as ch:
            return stub(ch).Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=5).released

    def sessions(self) -> dict[str, int]:
        """Sessions on every live, unfrozen worker."""
        return {n: self.stats(n).sessions for n in self.procs if self.alive(n) and n not in self.frozen}

    def wait_no_sessions(self, timeout: float) -> dict[str, int]:
        end = time.monotonic() + timeout
        while any((left := self.sessions()).values()) and time.monotonic() < end:
            time.sleep(0.05)
        assert not any(left.values()), f"sessions left: {left}"
        return left

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, **labels) -> float:
        """A sample of the router's /metrics (0.0 when absent); labels must match exactly."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        pat = re.compile(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$")
        for line in self.metrics_text().splitlines():
            m = pat.match(line)
            if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
                return float(m.group(2))
        return 0.0

    def wait_metric(self, name: str, value: float, timeout: float, **labels) -> None:
        end = time.monotonic() + timeout
        while (got := self.metric(name, **labels)) != value:
            if time.monotonic() > end:
                raise AssertionError(f"{name}{labels} is {got}, expected {value}")
            time.sleep(0.05)

    def wait_health(self, want: str, timeout: float) -> float:
        """Seconds until the router's health reads `want`."""
        t0 = time.monotonic()
        while (got := self.client.health(timeout=1.0)) != want:
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"router health is {got}, expected {want}")
            time.sleep(0.05)
        return time.monotonic() - t0


_REF: dict = {}


def reference(model_dir, max_len: int):
    """-> get(prompt_or_ids, n, ignore_eos=True, sampling=None): `baton complete` tokens with the workers'
    window (sampling: baton.engine.sampling.Params, e.g. a seeded temperature)."""
    import torch

    from baton.complete import complete
    from baton.loading import load_model, resolve_model_dir
    from baton.tokenizer import Tokenizer

    key = (str(model_dir), max_len)
    if key in _REF:
        return _REF[key]
    d = resolve_model_dir(model_dir)
    lm = load_model(d, dtype="fp32", device="cpu", mtp=False)
    tok = Tokenizer.from_dir(d)
    cache: dict = {}

    def get(prompt, n, ignore_eos=True, sampling=None):
        ids = tuple(tok.encode(prompt) if isinstance(prompt, str) else prompt)
        key = (ids, n, ignore_eos, sampling)
        if key not in cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the workers run single-threaded too
            try:
                cache[key] = complete(
                    d, list(ids), n, max_len=max_len, ignore_eos=ignore_eos, loaded=lm, sampling=sampling
                )
            finally:
                torch.set_num_threads(threads)
        return cache[key]

    get.tokenizer = tok
    _REF[key] = get
    return get


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def grpc_code(fn) -> tuple[grpc.StatusCode, str]:
    try:
        r = fn()
        if hasattr(r, "__iter__") and not hasattr(r, "ByteSize"):
            list(r)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""
