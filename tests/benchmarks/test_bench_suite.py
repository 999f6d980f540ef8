"""baton bench (benchmarks/suite.py): the argv each part runs. The parts themselves need a GPU."""

import argparse

import pytest

from benchmarks import suite


def _args(**kw):
    p = argparse.ArgumentParser()
    suite.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


@pytest.mark.parametrize("gpus,second", [(1, False), (2, True), (8, True)])
def test_ttft_puts_the_decode_worker_on_a_second_gpu_when_there_is_one(monkeypatch, tmp_path, gpus, second):
    monkeypatch.setattr(suite, "_gpus", lambda: gpus)
    argv = suite._script("ttft", _args(), tmp_path / "t.json")
    assert argv[1].endswith("bench_ttft.py") and ("--decode-gpu" in argv) == second
    if second:
        assert argv[argv.index("--decode-gpu") + 1] == "1"


def test_exact_parts_run_the_512_token_sweep(tmp_path):
    argv = suite._script("exact_mtp", _args(runs=3), tmp_path / "e.json")
    assert argv[argv.index("--new") + 1] == "512" and argv[argv.index("--runs") + 1] == "3"
    assert argv[argv.index("--controlled-engine") + 1] == "mtp"
