"""End to end on CPU: the router, one prefill and two decode workers as SEPARATE PROCESSES on a tiny
checkpoint, over loopback gRPC with a bearer token, checked against `baton complete`.

Order matters (one set of processes per module, three decode workers): token identity (exact fp8 /
exact mtp / fast bf16), bad input + auth, the CLI, cancellation, SIGKILL of the serving decode worker
mid-stream (exact, then fast: each kill leaves one worker fewer), health while the last decode worker
is frozen (SIGSTOP: it cannot answer) and after it is back (SIGCONT), finally SIGTERM of the router.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import pick_free_port
from helpers import make_tiny_dir

from baton.client import Client
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

_MISSING = [
    m
    for m in ("prefill_worker.service", "decode_worker.service", "prefill_worker.__main__", "decode_worker.__main__")
    if importlib.util.find_spec(m) is None
]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"worker services not built yet: {_MISSING}")

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN = 256  # NOTE: the workers' window and complete()'s must agree (exactness contract)
TOKEN = "e2e-secret"
N = 20
DECODE = ("d0", "d1", "d2")
PROMPTS = [
    "def main(",
    "import json",
    "class Counter:",
    "return [e / total",
    "for token in tokens:",
    "@dataclass(frozen=True)",
    "self.seen += len(",
    "values: list[float]",
    "raise ValueError(f\"",
    "x",
]


class Proc:
    """A child process whose stdout lines are collected by a thread."""

    def __init__(self, name: str, args: list[str]):
        # NOTE: one thread per process: five processes share a CI-sized machine
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
        env.pop("BATON_TOKEN", None)
        self.name, self.lines = name, []
        # stderr too: a worker that cannot start says why (the error names it)
        self.p = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line.strip())

    def wait_serving(self, timeout: float = 90.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = next((ln for ln in self.lines if " serving on " in ln), None)
            if hit:
                return hit.rsplit(" ", 1)[-1]
            if self.p.poll() is not None:
                time.sleep(0.2)  # the reader thread's last lines
                raise RuntimeError(f"{self.name} exited with {self.p.returncode}: " + " | ".join(self.lines[-5:]))
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not start in {timeout}s")

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    tiny = make_tiny_dir(tmp)
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    common = ["--model", str(tiny), "--max-len", str(MAX_LEN), "--token-file", str(token_file)]

    def decode(port):
        return Proc(f"decode:{port}", ["-m", "decode_worker", "--port", str(port), "--engine", "fp8", *common])

    ref = _reference(tiny)  # loads the model here (before the processes: a retry need not reload it)
    for attempt in (1, 2):  # NOTE: a port picked free can be taken by another test process before a worker binds it
        try:
            yield from _start(tiny, token_file, common, decode, ref)
            return
        except _PortTaken as e:
            if attempt == 2:
                raise RuntimeError(str(e)) from None


class _PortTaken(Exception):
    pass


def _start(tiny, token_file, common, decode, ref):
    ports = {k: pick_free_port() for k in ("prefill", *DECODE)}
    procs = {"prefill": Proc("prefill", ["-m", "prefill_worker", "--port", str(ports["prefill"]), *common])}
    procs.update({k: decode(ports[k]) for k in DECODE})
    addr = {k: f"127.0.0.1:{p}" for k, p in ports.items()}
    procs["router"] = Proc(
        "router",
        [
            "-m",
            "router",
            "--port",
            "0",
            "--prefill",
            addr["prefill"],
            "--decode",
            ",".join(addr[k] for k in DECODE),
            "--model",
            str(tiny),
            "--token-file",
            str(token_file),
            "--call-timeout",
            "20",
            "--grace",
            "5",
        ],
    )
    ns = type("Env", (), {})()
    ns.tiny, ns.procs, ns.ports, ns.addr, ns.decode = tiny, procs, ports, addr, decode
    try:
        ns.ref = ref
        ns.router = procs["router"].wait_serving()
        for k in ("prefill", *DECODE):
            try:
                procs[k].wait_serving()
            except RuntimeError as e:
                if "address already in use" in str(e).lower() or "failed to bind" in str(e).lower():
                    raise _PortTaken(str(e)) from None
                raise
        ns.client = Client(ns.router, settings=Settings(token=TOKEN))
        _wait_health(ns.client, "SERVING", 10)
        yield ns
        ns.client.close()
    finally:
        for p in procs.values():
            p.kill()


def _reference(tiny):
    """-> get(prompt, n, ignore_eos): `baton complete` tokens with the workers' window (memoized).
    The cases the tests use are computed here, while the worker processes boot."""
    import torch

    from baton.complete import complete
    from baton.loading import load_model
    from baton.tokenizer import Tokenizer

    lm = load_model(tiny, dtype="fp32", device="cpu", mtp=False)
    tok = Tokenizer.from_dir(tiny)
    cache = {}

    def get(prompt, n=N, ignore_eos=False):
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        key = (tuple(ids), n, ignore_eos)
        if key not in cache:
            cache[key] = complete(tiny, ids, n, max_len=MAX_LEN, ignore_eos=ignore_eos, loaded=lm)
        return cache[key]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers run single-threaded too (OMP_NUM_THREADS=1)
    try:
        for p in PROMPTS:
            get(p)
        for args in (("def", 6), ("class Counter:", 8), ("def main(", 64, True), ("import json", 64, True)):
            get(*args)
    finally:
        torch.set_num_threads(threads)
    return get


@pytest.fixture(scope="module")
def ref(env):
    return env.ref


def _wait_health(client, want, timeout):
    end = time.monotonic() + timeout
    while client.health() != want:
        if time.monotonic() > end:
            raise AssertionError(f"router health is {client.health()}, expected {want}")
        time.sleep(0.1)


def _stats(env, key):
    ch = grpc.insecure_channel(env.addr[key])
    stub = (prefill_pb2_grpc.PrefillWorkerStub if key == "prefill" else decode_pb2_grpc.DecodeWorkerStub)(ch)
    try:
        return stub.GetStats(
            common_pb2.WorkerStatsRequest(), timeout=2, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
    finally:
        ch.close()


def _sessions(env):
    """Sessions on every live worker: {name: count}."""
    return {k: _stats(env, k).sessions for k in ("prefill", *DECODE) if env.procs[k].p.poll() is None}


def _tokens(deltas):
    return [t for d in deltas for t in d.token_ids]


# ---- token identity -----------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["fp8", "mtp"])
def test_exact_mode_is_token_identical_to_complete(env, ref, engine):
    def one(prompt):
        return list(env.client.generate(prompt, max_new_tokens=N, mode="exact", engine=engine, timeout=60))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, PROMPTS))
    for prompt, deltas in zip(PROMPTS, results):
        assert _tokens(deltas) == ref(prompt), prompt
        assert deltas[-1].stats["drafted"] > 0 and deltas[-1].stats["bridge_bytes"] > 0
    assert sum(d[-1].stats["accepted"] for d in results) <= sum(d[-1].stats["drafted"] for d in results)


def test_fast_bf16_is_token_identical_to_complete(env, ref):
    for prompt in PROMPTS:
        deltas = list(env.client.generate(prompt, max_new_tokens=N, engine="bf16", timeout=60))
        assert _tokens(deltas) == ref(prompt), prompt
        assert "".join(d.text for d in deltas)  # text deltas come through


def test_bad_input_and_auth(env, ref):
    bad = [
        dict(prompt=""),
        dict(prompt=[1, 512]),
        dict(max_new_tokens=0),
        dict(draft_block=15, mode="exact"),
        dict(prompt=[1] * 250),
        dict(max_new_tokens=250),
    ]
    for kw in bad:
        kw = {"prompt": "def", "max_new_tokens": 4, **kw}
        with pytest.raises(grpc.RpcError) as ei:
            list(env.client.generate(kw.pop("prompt"), timeout=10, **kw))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
    with Client(env.router, settings=Settings()) as anon:
        with pytest.raises(grpc.RpcError) as ei:
            list(anon.generate("def", max_new_tokens=4, timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _tokens(env.client.generate("def", max_new_tokens=6, engine="bf16", timeout=30)) == ref("def", 6)


def test_cli_generate_and_health(env, ref, tmp_path):
    tf = tmp_path / "tok"
    tf.write_text(TOKEN)
    cmd = [sys.executable, "-m", "baton.cli"]
    envv = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        cmd
        + [
            "generate",
            "--addr",
            env.router,
            "--token-file",
            str(tf),
            "--json",
            "--mode",
            "exact",
            "--max-new-tokens",
            "8",
            "class Counter:",
        ],
        env=envv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    import json

    assert json.loads(out.stdout)["token_ids"] == ref("class Counter:", 8)
    h = subprocess.run(
        cmd + ["health", "--addr", env.router], env=envv, cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert h.returncode == 0 and h.stdout.strip() == "SERVING"


# ---- cancellation -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_cancel_after_three_tokens_releases_sessions(env, mode):
    stream = env.client.generate("def main(", max_new_tokens=200, mode=mode, engine="mtp", ignore_eos=True, timeout=60)
    got = [next(stream) for _ in range(3)]
    assert all(g.token_ids for g in got)
    stream.close()
    end = time.monotonic() + 2.0
    while any(_sessions(env).values()) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(_sessions(env).values()), _sessions(env)


# ---- decode worker killed mid-stream ------------------------------------------------------------
def _kill_serving_decode_after(env, stream, n):
    """Reads n deltas, SIGKILLs the decode worker holding the session; -> (deltas read, killed name)."""
    got = [next(stream) for _ in range(n)]
    busy = [k for k in DECODE if env.procs[k].p.poll() is None and _stats(env, k).sessions]
    assert len(busy) == 1, busy
    env.procs[busy[0]].kill()
    return got, busy[0]


def test_sigkill_decode_exact_mode_same_tokens(env, ref):
    want = ref("def main(", 64, ignore_eos=True)
    stream = env.client.generate(
        "def main(", max_new_tokens=64, mode="exact", engine="fp8", ignore_eos=True, timeout=120
    )
    got, killed = _kill_serving_decode_after(env, stream, 5)
    deltas = got + list(stream)
    assert _tokens(deltas) == want
    assert deltas[-1].stats["migrations"] == 1


def test_sigkill_decode_fast_mode_nothing_lost(env, ref):
    want = ref("import json", 64, ignore_eos=True)
    stream = env.client.generate("import json", max_new_tokens=64, engine="bf16", ignore_eos=True, timeout=120)
    got, killed = _kill_serving_decode_after(env, stream, 5)
    deltas = got + list(stream)
    assert _tokens(deltas) == want  # bf16 == complete: no token lost or repeated
    assert deltas[-1].stats["migrations"] == 1 and deltas[-1].usage["completion_tokens"] == 64


def test_health_follows_decode_workers(env, ref):
    (last,) = [k for k in DECODE if env.procs[k].p.poll() is None]
    os.kill(env.procs[last].p.pid, signal.SIGSTOP)  # no decode worker can answer
    try:
        _wait_health(env.client, "NOT_SERVING", 5)
        with pytest.raises(grpc.RpcError) as ei:
            list(env.client.generate("def", max_new_tokens=4, timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        os.kill(env.procs[last].p.pid, signal.SIGCONT)
    _wait_health(env.client, "SERVING", 5)
    assert _tokens(env.client.generate("def", max_new_tokens=6, mode="exact", timeout=30)) == ref("def", 6)


def test_router_sigterm_exits_cleanly(env):
    r = env.procs["router"].p
    t0 = time.monotonic()
    r.send_signal(signal.SIGTERM)
    assert r.wait(15) == 0 and time.monotonic() - t0 < 15
    assert any(ln.startswith("router: serving on 127.0.0.1:") for ln in env.procs["router"].lines)
