"""baton/gpus.py: one GPU per worker process, chosen through CUDA_VISIBLE_DEVICES (no CUDA here)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton.gpus import pin_device, spread, visible_gpus
from deploy import processes
from deploy.processes import Progress, WorkerSpec


def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-ab,GPU-cd"}) == ["GPU-ab", "GPU-cd"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]  # CUDA stops at an invalid entry
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    for i in range(3):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert visible_gpus({}, proc_dir=str(tmp_path)) == ["0", "1", "2"]
    assert visible_gpus({}, proc_dir=str(tmp_path / "absent")) == []


def test_spread_is_round_robin_from_two_gpus():
    assert spread(3, ["0"]) == [None, None, None]
    assert spread(3, ["4", "5"]) == ["4", "5", "4"]
    assert spread(2, ["0", "1", "2", "3"]) == ["0", "1"]


def test_pin_device_narrows_to_the_nth_visible_gpu():
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert pin_device("cuda:1", env) == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "5"
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    for device in ("cpu", "cuda"):
        assert pin_device(device, env) == device and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    with pytest.raises(ValueError, match="2 GPU"):
        pin_device("cuda:2", env)


def test_start_processes_gives_each_gpu_worker_its_own_gpu(monkeypatch):
    started = []

    class FakeWorker:
        def __init__(self, spec, env=None):
            self.spec, self.env, self.pid, self.address = spec, env, 1, "127.0.0.1:1"
            started.append(self)

        def start(self):
            return self

        def wait_ready(self, **kw):
            return self.address

    monkeypatch.setattr(processes, "WorkerProcess", FakeWorker)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    specs = [
        WorkerSpec("prefill", 0, device="cuda"),
        WorkerSpec("decode", 0, device="cuda"),
        WorkerSpec("decode", 1, device="cuda"),
    ]
    processes.start_processes(specs, progress=Progress(), timeout=5)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in started] == ["6", "7", "6"]
    started.clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU: everyone shares it, env inherited
    processes.start_processes(specs[:2], progress=Progress(), timeout=5)
    assert [w.env for w in started] == [None, None]


def test_worker_entry_points_do_not_import_fla(tmp_path):
    """`--device cuda:N` narrows CUDA_VISIBLE_DEVICES in options_from_args, after the entry point's imports;
    importing flash-linear-attention initialises CUDA on device 0, so no entry point may import it then
    (gdn_ops imports it on the first CUDA prefill). A stand-in `fla` package fails loudly if imported."""
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("raise SystemExit('fla imported')\n")
    root = str(Path(__file__).resolve().parents[2])
    code = (
        "import sys; import decode_worker.__main__, prefill_worker.__main__, router.__main__; "
        "from baton.models import gdn_ops; print('fla' in sys.modules)"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{root}:{tmp_path}"},
    )
    assert (p.returncode, p.stdout.strip()) == (0, "False"), p.stderr[-2000:]
