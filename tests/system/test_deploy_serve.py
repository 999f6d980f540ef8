"""`baton serve` end to end: start it in a subprocess on the embedded default model, wait for the
serving line, `baton generate` against it (fast and exact; a call without the token is refused),
SIGTERM it while a request is in flight (that request completes), then check it exited 0 within 10 s, that no process it started is left, and that no port
it opened is still open. In --processes mode the decode worker is also SIGKILLed once: it must come
back on its port (health NOT_SERVING, then SERVING) and serve again.

The process-tree helpers read /proc (psutil is not a dependency)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVING_RE = re.compile(r"^baton: serving on (\S+):(\d+)$")
READY_RE = re.compile(r"ready on (\S+):(\d+)")
PROMPT = "def fibonacci(n):"


# ---------------------------------------------------------------------------------- /proc helpers
def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of a live pid, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
                starts[int(entry)] = st[2]
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = starts[c]
            todo.append(c)
    return out


def cmdlines(pids) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass
    return out


def survivors(procs: dict[int, int]) -> list[str]:
    """Those of `procs` (pid -> start time) still running (a zombie counts as gone)."""
    left = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
            except OSError:
                cmd = "?"
            left.append(f"{pid}: {cmd}")
    return left


def cmdline_matches(text: str) -> list[str]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            st = _stat(int(entry))
            if text in cmd and st is not None and st[1] != "Z" and int(entry) != os.getpid():
                out.append(f"{entry}: {cmd[:160]}")
    return out


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


# ---------------------------------------------------------------------------------- the server
class Served:
    """`baton serve ...` in its own session; stderr lines are collected, stdout scanned."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", "serve", *args],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr, False), daemon=True).start()

    def _pump(self, stream, sink, to_queue):
        for line in stream:
            sink.append(line.rstrip("\n"))
            if to_queue:
                self.lines.put(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(["--- stdout"] + self.stdout + ["--- stderr"] + self.stderr[-60:])

    def wait_serving(self, timeout: float) -> tuple[str, int]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None and self.lines.empty():
                pytest.fail(f"baton serve exited with {self.proc.returncode}\n{self.log()}")
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            m = SERVING_RE.match(line)
            if m:
                return m.group(1), int(m.group(2))
        self.kill()
        pytest.fail(f"no serving line in {timeout} s\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in descendants(self.proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait()

    def worker_ports(self) -> list[int]:
        return [int(m.group(2)) for line in self.stderr if line.startswith("baton: ") and (m := READY_RE.search(line))]


def generate(addr: str, *extra: str, env=None) -> dict:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "baton.cli",
            "generate",
            "--addr",
            addr,
            "--max-new-tokens",
            "12",
            "--json",
            *extra,
            PROMPT,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"baton generate {extra} failed ({r.returncode}): {r.stderr}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["token_ids"], out
    return out


def wait_health(addr: str, status: str, timeout: float) -> bool:
    from deploy.processes import health_status

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if health_status(addr, timeout=1.0) == status:
            return True
        time.sleep(0.05)
    return False


def kill_decode_worker(srv: Served, addr: str, env: dict) -> None:
    """SIGKILL the decode worker: health goes NOT_SERVING, the supervisor restarts it on its port,
    health SERVING again, and generation still works."""
    pids = [p for p, c in cmdlines(descendants(srv.proc.pid)).items() if "-m decode_worker" in c]
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    assert wait_health(addr, "NOT_SERVING", 15), srv.log()
    assert wait_health(addr, "SERVING", 120), srv.log()
    generate(addr, env=env)
    assert any("decode-0 ready again" in ln for ln in srv.stderr), srv.log()


def answer_line(srv: Served, timeout: float = 60) -> dict:
    """The `baton: answer {json}` line `baton serve --ask` prints once serving."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = [ln for ln in srv.stdout if ln.startswith("baton: answer ")]
        if got:
            assert len(got) == 1, srv.log()
            return json.loads(got[0].removeprefix("baton: answer "))
        time.sleep(0.1)
    pytest.fail(f"no answer line in {timeout} s\n{srv.log()}")


def serve_generate_stop(
    tmp_path, *args: str, start_timeout: float, kill_decode: bool = False
) -> tuple[Served, dict[int, str], float]:
    """Serve, check fast + exact generation, SIGTERM. Returns (server, pid -> cmdline of the process tree
    it had started, seconds to exit). With `--ask PROMPT --ask-tokens 12` in args, its answer must be the
    fast generation's."""
    token_file = tmp_path / "token"
    token_file.write_text("deploy-test-token\n")
    srv = Served("--port", "0", "--http-port", "0", "--token-file", str(token_file), "--grace", "5", *args)
    try:
        host, port = srv.wait_serving(start_timeout)
        addr = f"{host}:{port}"
        assert sum(1 for ln in srv.stdout if SERVING_RE.match(ln)) == 1
        env = {**srv.env, "BATON_TOKEN_FILE": str(token_file)}
        fast = generate(addr, env=env)
        exact = generate(addr, "--mode", "exact", env=env)
        assert exact["token_ids"] == fast["token_ids"], "exact mode must equal the bf16 fast path"
        if "--ask" in args:
            ans = answer_line(srv)
            assert (ans["prompt"], ans["token_ids"], ans["text"]) == (PROMPT, fast["token_ids"], fast["text"]), ans
        no_token = subprocess.run(
            [sys.executable, "-m", "baton.cli", "generate", "--addr", addr, PROMPT],
            cwd=ROOT,
            env={**srv.env, "BATON_TOKEN": "", "BATON_TOKEN_FILE": ""},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert no_token.returncode != 0 and "UNAUTHENTICATED" in no_token.stderr
        if kill_decode:
            kill_decode_worker(srv, addr, env)
        tree = descendants(srv.proc.pid)
        assert tree, "serve started no process"
        cmds = cmdlines(tree)
        ports = [port] + srv.worker_ports()
        # A request in flight at SIGTERM finishes within the grace period.
        from baton.client import Client

        with Client(addr, token="deploy-test-token") as client:
            stream = client.generate(PROMPT, max_new_tokens=64, ignore_eos=True, timeout=30)
            got = list(next(stream).token_ids)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            deltas = list(stream)
        got += [t for d in deltas for t in d.token_ids]
        assert len(got) == 64 and deltas[-1].finish_reason == "LENGTH", deltas
        try:
            rc = srv.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"baton serve still running 15 s after SIGTERM\n{srv.log()}")
        took = time.monotonic() - t0
        assert rc == 0, f"exit code {rc}\n{srv.log()}"
        assert took < 10.0, f"took {took:.1f} s to exit\n{srv.log()}"
        time.sleep(0.5)  # init reaps re-parented children
        assert not survivors(tree), f"left behind: {survivors(tree)}"
        assert not [p for p in ports if port_open(host, p)], f"ports still open: {ports}"
        stop_at = next(i for i, ln in enumerate(srv.stderr) if "stopping: router" in ln)
        overlapped = any('"tokens": 64' in ln for ln in srv.stderr[stop_at:])
        print(f"in-flight request finished after the router stopped accepting: {overlapped}")
        return srv, cmds, took
    finally:
        srv.kill()


# ---------------------------------------------------------------------------------- tests
@pytest.mark.timeout(300)
def test_serve_processes_generate_and_sigterm(tmp_path, monkeypatch):
    # the workers inherit the environment: with BATON_STACK_SAMPLES each writes its stack samples on its clean
    # stop (baton/stack_sampler.py)
    monkeypatch.setenv("BATON_STACK_SAMPLES", str(tmp_path / "stacks-{role}-{pid}.txt"))
    srv, tree, took = serve_generate_stop(
        tmp_path, "--processes", "--ask", PROMPT, "--ask-tokens", "12", start_timeout=180, kill_decode=True
    )
    written = {p.name.split("-")[1]: p.read_text() for p in tmp_path.glob("stacks-*.txt")}
    # both workers' (the restarted decode worker's) and the router's, in `baton serve`'s own process
    assert set(written) == {"prefill", "decode", "router"}, (written.keys(), srv.log())
    assert all(t.startswith("# stack samples every 10 ms") and "## " in t for t in written.values())
    assert len(srv.worker_ports()) == 2, srv.log()
    # the prefill worker's hand-off sender process (baton/handoff/sender/process.py) is part of its tree
    assert sorted(c.split(" -m ")[1].split()[0] for c in tree.values()) == [
        "baton.handoff.sender.child",
        "decode_worker",
        "prefill_worker",
    ]
    assert not any("ray" in line.lower() for line in srv.stderr if line.startswith("baton:")), srv.log()
    print(f"processes mode: exit {took:.1f} s after SIGTERM, {len(tree)} processes")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("one_ray_at_a_time")
def test_serve_ray_generate_and_sigterm(tmp_path):
    env_addr = os.environ.pop("RAY_ADDRESS", None)
    try:
        srv, tree, took = serve_generate_stop(tmp_path, start_timeout=240)
    finally:
        if env_addr is not None:
            os.environ["RAY_ADDRESS"] = env_addr
    assert any("raylet" in c for c in tree.values()) and any("gcs_server" in c for c in tree.values())
    temp_dirs = {m.group(1) for c in tree.values() for m in [re.search(r"(/tmp/baton-ray-[\w]+)", c)] if m}
    assert temp_dirs, "expected the Ray processes to use a baton-ray-* temp dir"
    for d in temp_dirs:
        assert not cmdline_matches(d), f"Ray processes of {d} left: {cmdline_matches(d)}"
        assert not Path(d).exists(), f"temp dir {d} not removed"
    print(f"ray mode: exit {took:.1f} s after SIGTERM")


def test_cpu_workers_split_the_cores_unless_the_caller_set_omp_threads():
    from deploy.processes import WorkerSpec, worker_env

    cpu = WorkerSpec("prefill", 0)
    gpu = WorkerSpec("decode", 0, device="cuda:0")
    assert worker_env(cpu, 2, {"PATH": "/bin"}, 16) == {"PATH": "/bin", "OMP_NUM_THREADS": "8"}
    assert worker_env(cpu, 3, {}, 2) == {"OMP_NUM_THREADS": "1"}
    assert worker_env(cpu, 2, {"OMP_NUM_THREADS": "4"}, 16) is None  # the caller's choice stands
    assert worker_env(cpu, 1, {}, 16) is None  # a lone worker keeps every core
    assert worker_env(gpu, 2, {}, 16) is None


def test_slots_reach_every_worker_process_and_actor():
    """`baton serve --slots N` sets each worker's session slots, as a process flag and as an actor
    keyword; without it the workers keep their own default."""
    import argparse

    from deploy.local import _worker_specs

    base = dict(model=None, device="cpu", dtype=None, max_len=None, token_file=None, grace=1.0, engine=None)
    specs = _worker_specs(argparse.Namespace(**base, slots=16, prefill=1, decode=2))
    assert [s.options()["slots"] for s in specs] == [16, 16, 16]
    assert all(s.argv()[s.argv().index("--slots") + 1] == "16" for s in specs)
    unset = _worker_specs(argparse.Namespace(**base, slots=None, prefill=1, decode=1))
    assert all("slots" not in s.options() and "--slots" not in s.argv() for s in unset)


def test_kv_page_options_reach_every_worker_process_and_actor():
    """`baton serve --kv-pages N --gpu-memory-fraction F` reach each worker as flags and actor keywords
    (the workers' own command line and actors take them); unset, the workers size their pools."""
    import argparse
    import inspect

    from decode_worker.actor import DecodeActor
    from deploy.local import _worker_specs
    from prefill_worker.actor import PrefillActor

    base = dict(model=None, device="cpu", dtype=None, max_len=None, token_file=None, grace=1.0, engine=None)
    specs = _worker_specs(
        argparse.Namespace(**base, slots=None, prefill=1, decode=1, kv_pages=64, gpu_memory_fraction=0.4)
    )
    for s in specs:
        argv = s.argv()
        assert argv[argv.index("--kv-pages") + 1] == "64" and argv[argv.index("--gpu-memory-fraction") + 1] == "0.4"
        assert s.options()["kv_pages"] == 64
    unset = _worker_specs(argparse.Namespace(**base, slots=None, prefill=1, decode=1))
    assert all("--kv-pages" not in s.argv() and "--gpu-memory-fraction" not in s.argv() for s in unset)
    for actor in (DecodeActor, PrefillActor):
        params = inspect.signature(actor.__init__).parameters
        assert {"kv_pages", "gpu_memory_fraction"} <= set(params)
    from decode_worker.__main__ import build_parser

    a = build_parser().parse_args(["--kv-pages", "9", "--gpu-memory-fraction", "0.5"])
    assert (a.kv_pages, a.gpu_memory_fraction) == (9, 0.5)


def test_prefill_budget_reaches_the_prefill_workers_only(tmp_path):
    """`baton serve --prefill-budget N`: the prefill workers' flag and actor keyword (the decode workers
    have no prefill); the worker's ExactEngine then cuts its batched passes at N tokens."""
    import argparse
    import inspect

    from helpers import make_tiny_dir

    from deploy.local import _worker_specs
    from deploy.serve_args import check
    from prefill_worker.actor import PrefillActor
    from prefill_worker.serve import serve_prefill

    base = dict(model=None, device="cpu", dtype=None, max_len=None, token_file=None, grace=1.0, engine=None)
    specs = _worker_specs(argparse.Namespace(**base, slots=None, prefill=1, decode=1, prefill_budget=300))
    pre, dec = specs
    assert pre.argv()[pre.argv().index("--prefill-budget") + 1] == "300" and pre.options()["prefill_budget"] == "300"
    assert "--prefill-budget" not in dec.argv()
    assert "prefill_budget" in inspect.signature(PrefillActor.__init__).parameters
    bad = argparse.Namespace(prefill=1, decode=1, port=0, http_port=0, ask_tokens=1, slots=None, prefill_budget=0)
    assert check(bad) == "--prefill-budget must be >= 1"
    handle, svc = serve_prefill(make_tiny_dir(tmp_path), max_len=64, slots=2, prefill_budget=300)
    try:
        assert svc.engine.prefills.budget == 300
    finally:
        handle.stop(0)


def test_prefill_piece_reaches_the_prefill_workers_and_is_checked(tmp_path):
    """`baton serve --prefill-piece N`: the prefill workers' flag and actor keyword; the worker takes it after
    its start-up cut check (the tiny model passes at a page), and its prefix cache keeps N-token boundaries."""
    import argparse
    import inspect

    from helpers import make_tiny_dir

    from deploy.local import _worker_specs
    from deploy.serve_args import check
    from prefill_worker.actor import PrefillActor
    from prefill_worker.serve import serve_prefill

    base = dict(model=None, device="cpu", dtype=None, max_len=None, token_file=None, grace=1.0, engine=None)
    pre, dec = _worker_specs(argparse.Namespace(**base, slots=None, prefill=1, decode=1, prefill_piece=512))
    assert pre.argv()[pre.argv().index("--prefill-piece") + 1] == "512" and pre.options()["prefill_piece"] == "512"
    assert (
        "--prefill-piece" not in dec.argv() and "prefill_piece" in inspect.signature(PrefillActor.__init__).parameters
    )
    bad = argparse.Namespace(prefill=1, decode=1, port=0, http_port=0, ask_tokens=1, slots=None, prefill_piece=300)
    assert check(bad) == "--prefill-piece must be a positive multiple of 256"
    handle, svc = serve_prefill(make_tiny_dir(tmp_path), max_len=1536, slots=2, prefill_piece=512)
    try:
        assert svc.engine.runner.prefill_chunk == 512 and svc.engine.prefix.chunk == 512
    finally:
        handle.stop(0)


def test_draft_length_reaches_the_router():
    """`baton serve --draft-length adaptive` sets the router's exact-mode K policy (baton/engine/draft_length.py);
    unset, the router keeps its default (fixed)."""
    import argparse

    from deploy.router_launch import router_kwargs, serve_router
    from deploy.serve_args import add_arguments
    from router.service import RouterConfig

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--draft-length", "adaptive"]).draft_length == "adaptive"
    assert p.parse_args([]).draft_length is None
    kw = router_kwargs(host="127.0.0.1", port=0, namespace=None, draft_length="adaptive")
    r = serve_router(**kw)
    try:
        assert r._servicer.config.draft_length == "adaptive"
    finally:
        r.stop(0)
    d = serve_router(**router_kwargs(host="127.0.0.1", port=0, namespace=None))
    try:
        assert d._servicer.config.draft_length == RouterConfig.draft_length == "fixed"
    finally:
        d.stop(0)


def test_engines_reach_the_decode_workers_only():
    """`baton serve --engines bf16,mtp` (and deploy/launch.py's) reaches each decode worker as its --engines flag
    and actor keyword; unset, the workers offer all they can; a bad list or an --engine outside it is refused
    before anything starts."""
    import argparse
    import inspect

    from decode_worker.__main__ import build_parser
    from decode_worker.actor import DecodeActor
    from deploy.launch import add_arguments as launch_arguments
    from deploy.launch import specs_from_args
    from deploy.local import _worker_specs
    from deploy.serve_args import add_arguments, check

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--engines", " mtp, bf16,mtp", "--decode", "2"])
    assert check(args) is None and args.engines == "mtp,bf16"
    pre, *dec = _worker_specs(args)
    assert "--engines" not in pre.argv() and "engines" not in pre.options()
    for s in dec:
        assert s.argv()[s.argv().index("--engines") + 1] == "mtp,bf16" and s.options()["engines"] == "mtp,bf16"
    assert build_parser().parse_args(["--engines", "mtp,bf16"]).engines == "mtp,bf16"
    assert "engines" in inspect.signature(DecodeActor.__init__).parameters
    unset = p.parse_args([])
    assert check(unset) is None and all("--engines" not in s.argv() for s in _worker_specs(unset))
    for argv, msg in (
        (["--engines", "bf16,fp9"], "--engines: fp9: give one or more of bf16, fp8, mtp, comma-separated"),
        (["--engines", ","], "--engines: empty: give one or more of bf16, fp8, mtp, comma-separated"),
        (["--engines", "bf16", "--engine", "fp8"], "--engine fp8 is not among --engines bf16"),
    ):
        assert check(p.parse_args(argv)) == msg
    lp = argparse.ArgumentParser()
    launch_arguments(lp)
    la = lp.parse_args(["--engines", "bf16", "--gpus-per-worker", "0"])
    assert [s.options().get("engines") for s in specs_from_args(la)] == [None, "bf16"]
