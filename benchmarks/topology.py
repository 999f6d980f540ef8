"""Worker processes the benchmarks start themselves (shared by bench_exact.py and bench_serve.py).

    Cmd(name, module, args, device)   `python -u -m MODULE ARGS`, quacking like deploy.processes.WorkerSpec
                                      for deploy.processes.WorkerProcess (start, wait_ready, stop)
    child_env(threads)                this environment for a loopback child: PYTHONPATH with the checkout,
                                      no token / TLS / host variables, OMP_NUM_THREADS when threads > 0
    ControlledServe(ARGS, reference=FILE, draft_p=P, draft_seed=S, mtp_k=K, env=ENV)
        what `baton serve --processes ARGS` starts (deploy/local.py: its option parser and check, its
        worker specs), with one change: every decode worker is the benchmark-only
        `python -m benchmarks.controlled_decode_worker --reference FILE --draft-p P --draft-seed S
        <the decode worker's own options> --mtp-k K --mtp-draft-length fixed|adaptive`, whose drafts are right with probability P
        (benchmarks/controlled_decode_worker.py). Then the router as its own process (`python -m router`
        with the workers' addresses, --token-file, --max-inflight as baton serve sizes it, --draft-length),
        as `baton serve` runs it outside the load generator's process.

ControlledServe quacks like benchmarks/load.py Serve for bench_serve: wait(timeout) -> the router's address
(StartupError, a RuntimeError, when something does not come up), workers() -> {prefill-0: addr, decode-0:
addr, ...}, stop() -> exit code (the first non-zero of the router's and the workers'), err (the progress
lines `baton serve` prints: "baton: decode-0 on GPU 1", "baton: decode-0 ready on ADDR (s)", "baton: NAME
exited with code N", and the children's stdout), label (the commands, one string). Placement is
deploy/processes.py place_workers (start_processes uses it): with two or more GPUs visible each cuda worker gets its own
(prefill-0 the first), with --colocate all the first. The children's stderr (their logs) goes to this
process's stderr. No Supervisor: a worker that dies stays dead (its requests fail, and the point says so).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONTROLLED_MODULE = "benchmarks.controlled_decode_worker"


class Cmd:
    """Quacks like deploy.processes.WorkerSpec for WorkerProcess: `python -u -m MODULE ARGS`."""

    port = 0

    def __init__(self, name: str, module: str, args: list, device: str = "cpu"):
        self.name, self.module, self.args, self.device = name, module, [str(a) for a in args], device

    def argv(self) -> list[str]:
        return [sys.executable, "-u", "-m", self.module, *self.args]


def child_env(threads: int) -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("BATON_LOG_LEVEL", "WARNING")
    for k in ("BATON_TOKEN", "BATON_TOKEN_FILE", "BATON_TLS_CERT", "BATON_TLS_KEY", "BATON_TLS_CA", "BATON_HOST"):
        env.pop(k, None)  # loopback, no auth: this process talks to them with Settings()
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


class _Lines:
    """A text stream that keeps whole lines in a list (Progress and WorkerProcess write to it)."""

    def __init__(self, sink: list[str]):
        self.sink, self._part = sink, ""

    def write(self, text: str) -> int:
        self._part += text
        *done, self._part = self._part.split("\n")
        self.sink.extend(done)
        return len(text)

    def flush(self) -> None:
        pass


def serve_options(args: list[str]) -> argparse.Namespace:
    """`baton serve` ARGS parsed and checked as deploy/local.py does (the model and token paths
    resolved); SystemExit with baton serve's message when they are wrong."""
    from deploy.serve_args import add_arguments, check

    p = argparse.ArgumentParser(prog="baton serve (controlled)")
    add_arguments(p)
    ns = p.parse_args(args)
    ns.processes = True
    if ns.ask is not None:
        raise SystemExit("ControlledServe: --ask is not supported")
    err = check(ns)
    if err:
        raise SystemExit(f"baton serve: {err}")
    return ns


class ControlledServe:
    """prefill worker(s) + controlled decode worker(s) + router, as processes (module doc)."""

    def __init__(
        self,
        args: list[str],
        *,
        reference: str,
        draft_p: float,
        draft_seed: int = 0,
        mtp_k: int = 4,
        mtp_draft_length: str = "fixed",
        env=None,
    ):
        from deploy.local import _worker_specs  # NOTE: the specs `baton serve` builds, so the options match

        self.opts = serve_options(list(args))
        self.env = dict(env if env is not None else os.environ)
        self.err: list[str] = []
        self._stream = _Lines(self.err)
        head = ["--reference", reference, "--draft-p", draft_p, "--draft-seed", draft_seed]
        self.cmds = []
        for s in _worker_specs(self.opts):
            flags = s.argv()[4:]  # [python, -u, -m, ROLE_worker, flags...]
            if s.role == "decode":
                # fixed K by default: a controlled figure is the one at the K asked (the adaptive controller, the
                # worker's default, moves K off it: decode_worker --mtp-draft-length); adaptive: the
                # controller's figure, from the prior mtp_k
                k = ["--mtp-k", mtp_k, "--mtp-draft-length", mtp_draft_length]
                self.cmds.append(Cmd(s.name, CONTROLLED_MODULE, head + flags + k, s.device))
            else:
                self.cmds.append(Cmd(s.name, f"{s.role}_worker", flags, s.device))
        self.procs: list = []
        self.router = None
        self.addresses: dict[str, str] = {}

    def router_pid(self) -> int | None:
        """The router's process, once started."""
        return self.router.pid if self.router is not None else None

    @property
    def label(self) -> str:
        """The commands, `;`-separated (the router's addresses once the workers are up)."""
        router = self._router_cmd().args if self.addresses else ["--prefill", "ADDR", "--decode", "ADDR", "..."]
        return " ; ".join(
            shlex.join(["python", "-m", c.module, *c.args]) for c in [*self.cmds, Cmd("router", "router", router)]
        )

    def _say(self, text: str) -> None:
        self._stream.write(f"baton: {text}\n")

    def _router_cmd(self) -> Cmd:
        from baton.worker.options import DEFAULT_SLOTS

        o = self.opts
        pre = [a for n, a in self.addresses.items() if n.startswith("prefill-")]
        dec = [a for n, a in self.addresses.items() if n.startswith("decode-")]
        inflight = o.max_inflight or max(64, (o.slots or DEFAULT_SLOTS) * o.decode)  # as deploy/local.py
        args = ["--host", o.host or "127.0.0.1", "--port", o.port, "--prefill", ",".join(pre)]
        args += ["--decode", ",".join(dec), "--model", o.model, "--max-inflight", inflight, "--grace", "2"]
        if o.token_file:
            args += ["--token-file", o.token_file]
        if o.http_port:
            args += ["--http-port", o.http_port]
        if o.draft_length:
            args += ["--draft-length", o.draft_length]
        return Cmd("router", "router", args)

    def wait(self, timeout: float = 300.0) -> str:
        """Starts the workers (placed as start_processes places them), then the router; -> its address."""
        from deploy.processes import WorkerProcess, place_workers, stop_processes

        t0 = time.monotonic()
        left = lambda: max(1.0, timeout - (time.monotonic() - t0))  # noqa: E731
        # placed as `baton serve` places them: on one GPU they are told so (BATON_GPU_WORKERS: their KV
        # budgets agree, exact mode's gathers merge). Until 2026-12-06 they were not, so every controlled
        # run on one GPU (spec-*) served its exact sessions with pipelined gathers
        c = self.cmds
        envs = place_workers(
            [x.device for x in c], [x.name for x in c], [None] * len(c), self.env, self.opts.colocate, self._say
        )
        envs = [e if e is not None else dict(self.env) for e in envs]
        self.procs = [WorkerProcess(c, env=e, echo=self._stream) for c, e in zip(self.cmds, envs)]
        try:
            for w in self.procs:
                w.start()
                self._say(f"{w.spec.name} loading (pid {w.pid})")
            for w in self.procs:
                self.addresses[w.spec.name] = w.wait_ready(timeout=left())
                self._say(f"{w.spec.name} ready on {self.addresses[w.spec.name]} ({time.monotonic() - t0:.1f} s)")
            self.router = WorkerProcess(self._router_cmd(), env=dict(self.env), echo=self._stream).start()
            return self.router.wait_ready(timeout=left())
        except BaseException:
            stop_processes(([self.router] if self.router else []) + self.procs, grace=2.0)
            raise

    def workers(self) -> dict[str, str]:
        return dict(self.addresses)

    def stop(self) -> int:
        from deploy.processes import Progress, stop_processes

        codes = [self.router.stop(grace=5.0)] if self.router is not None else []
        stop_processes(self.procs, grace=4.0, progress=Progress(self._stream))
        codes += [w.proc.returncode for w in self.procs if w.proc is not None]
        return next((c for c in codes if c), 0)
