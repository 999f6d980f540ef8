"""An operator's mistakes at start-up get one line on stderr and a non-zero exit, never a traceback: each
case runs the real entry point in a subprocess (`baton complete`, the workers' `python -m`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "baton" / "assets" / "default-model"


def run(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)


def one_line(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    errors = [line for line in r.stderr.splitlines() if " INFO " not in line]
    assert r.returncode == code and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert len(errors) == 1 and all(w in errors[0] for w in words), r.stderr
    return errors[0]


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "no-tokenizer").mkdir()
    (root / "no-tokenizer" / "config.json").write_text((DEFAULT / "config.json").read_text())
    (root / "no-weights").mkdir()
    for name in ("config.json", "tokenizer.json"):
        (root / "no-weights" / name).write_text((DEFAULT / name).read_text())
    return root


@pytest.mark.parametrize(
    "model, words",
    [("missing", ("no config.json",)), ("no-tokenizer", ("tokenizer.json",)), ("no-weights", ("safetensors",))],
)
def test_complete_with_a_broken_model_dir_is_one_line(broken_models, model, words):
    r = run("-m", "baton", "complete", "--model", str(broken_models / model), "--prompt", "x")
    assert one_line(r, 2, *words).startswith("baton complete: ")


def test_cuda_on_a_machine_without_it_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_line(run("-m", "baton", "complete", "--device", "cuda", "--prompt", "x"), 2, "--device cuda", "CUDA")
    one_line(run("-m", "decode_worker", "--device", "cuda", "--port", "0"), 2, "cannot start", "--device cuda")


@pytest.mark.parametrize(
    "role, flag, value",
    [
        ("prefill_worker", "--slots", "0"),
        ("decode_worker", "--kv-pages", "0"),
        ("decode_worker", "--gpu-memory-fraction", "2"),
        ("prefill_worker", "--ttl", "0"),  # served, and reaped every session at once
        ("decode_worker", "--max-len", "10"),  # served, and refused every request (16 rows reserved)
        ("prefill_worker", "--width", "1"),
    ],
)
def test_a_worker_refuses_a_bad_option_as_argparse_does(role, flag, value):
    one_line(run("-m", role, flag, value, "--port", "0", timeout=30), 2, flag)


ROUTER = ("-m", "router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2")


@pytest.mark.parametrize(
    "argv, says",
    [
        # grpc bound 99999 as 34463 and -1 as 65535 and served there; the HTTP and metrics ports raised OverflowError
        ((*ROUTER, "--port", "99999"), "argument --port: '99999' is not a port (0..65535)"),
        ((*ROUTER, "--port", "-1"), "argument --port: '-1' is not a port (0..65535)"),
        ((*ROUTER, "--http-port", "70000"), "argument --http-port: '70000' is not a port (0..65535)"),
        ((*ROUTER, "--metrics-port", "x"), "argument --metrics-port: 'x' is not a port (0..65535)"),
        # accepted before, then every request refused or timed out
        ((*ROUTER, "--max-inflight", "0"), "--max-inflight must be >= 1"),
        ((*ROUTER, "--call-timeout", "0"), "--call-timeout must be > 0"),
        ((*ROUTER, "--queue-timeout", "-1"), "--queue-timeout must be >= 0"),
        ((*ROUTER, "--max-new-tokens-limit", "0"), "--max-new-tokens-limit must be >= 1"),
        ((*ROUTER, "--responses-store-mb", "-1"), "--responses-store-mb must be >= 0"),
        (("-m", "baton", "serve", "--responses-store-mb", "-1"), "--responses-store-mb must be >= 0"),
        (("-m", "decode_worker", "--port", "99999"), "argument --port: '99999' is not a port (0..65535)"),
        # Ray's max_restarts: -1 is forever, below it nothing (refused before Ray is joined)
        (("deploy/launch.py", "--max-restarts", "-2"), "--max-restarts must be >= -1 (-1: restart forever)"),
        (("-m", "baton", "serve", "--max-restarts", "-2"), "--max-restarts must be >= -1 (-1: restart forever)"),
    ],
)
def test_a_bad_option_is_a_usage_error_before_anything_starts(argv, says):
    r = run(*argv, timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(says) and r.stdout == "", r.stderr


def test_build_server_refuses_a_port_grpc_would_wrap():
    from baton.rpc import build_server

    for port in (65536, -1):
        with pytest.raises(ValueError, match=f"port {port}: must be in 0..65535"):
            build_server([], service_names=[], port=port)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_out_of_gpu_memory_at_start_up_says_which_options_size_it(role, monkeypatch, caplog):
    """A worker that runs out of GPU memory after sizing its KV pages (capturing graphs at a long window, or
    another process on the GPU) exits 2 with one line naming the options that size its memory, not a CUDA
    traceback; any other error keeps its traceback. The worker's own entry point, in this process."""
    import importlib
    import logging

    import torch

    from baton.worker.process import StopSignals

    entry = importlib.import_module(f"{role}_worker.__main__")
    serve = importlib.import_module(f"{role}_worker.serve")

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")

    def other(*a, **k):
        raise RuntimeError("a bug")

    argv = ["--port", "0", "--max-len", "2048", "--slots", "3"]
    extra = (None,) if role == "decode" else ()  # the decode worker's drafter (benchmarks only)
    for fail in (oom, other):
        monkeypatch.setattr(serve, f"serve_{role}", fail)
        signals = StopSignals(role)
        try:
            with caplog.at_level(logging.ERROR, logger=f"baton.{role}"):
                if fail is other:
                    with pytest.raises(RuntimeError, match="a bug"):
                        entry._main(argv, signals, *extra)
                else:
                    assert entry._main(argv, signals, *extra) == 2
        finally:
            signals.restore()
    (line,) = [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]
    assert line.startswith(f"{role}: cannot start: out of GPU memory after sizing the KV pages (CUDA out of memory.")
    assert "--gpu-memory-fraction (now 0.9), --max-len (now 2048) or --slots (now 3)" in line
    assert "more detail" not in line
