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
    ],
)
def test_a_worker_refuses_a_bad_option_as_argparse_does(role, flag, value):
    one_line(run("-m", role, flag, value, "--port", "0", timeout=30), 2, flag)
