"""baton/gpus.py: one GPU per worker process, chosen through CUDA_VISIBLE_DEVICES (no CUDA here)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton import gpus
from baton.gpus import pin_device, spread, visible_gpus
from deploy import local, processes
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
    assert spread(3, ["4", "5"], colocate=True) == ["4", "4", "4"]
    assert spread(2, ["0"], colocate=True) == [None, None]  # one GPU: inherited, as without colocate


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
    # GPU 6 holds two workers: each is told so, with its file in that GPU's plan folder; GPU 7 one
    assert [w.env.get("BATON_GPU_WORKERS") for w in started] == ["2", None, "2"]
    plans = [w.env.get("BATON_GPU_PLAN") for w in started]
    assert plans[1] is None and os.path.dirname(plans[0]) == os.path.dirname(plans[2])
    assert [os.path.basename(p) for p in (plans[0], plans[2])] == ["prefill-0", "decode-1"]
    assert os.path.isdir(os.path.dirname(plans[0]))
    started.clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU: everyone shares it, its index inherited
    processes.start_processes(specs[:2], progress=Progress(), timeout=5)
    assert [w.env.get("CUDA_VISIBLE_DEVICES") for w in started] == ["0", "0"]
    assert [w.env["BATON_GPU_WORKERS"] for w in started] == ["2", "2"]
    assert os.path.dirname(started[0].env["BATON_GPU_PLAN"]) != os.path.dirname(plans[0])  # a new folder
    started.clear()
    processes.start_processes(specs[1:2], progress=Progress(), timeout=5)  # alone on its GPU
    assert [w.env for w in started] == [None]
    started.clear()
    monkeypatch.setenv("BATON_GPU_PLAN", "/x/mine")  # inherited, one path for all: each gets its own file
    processes.start_processes(specs[:2], progress=Progress(), timeout=5)
    mine = [w.env["BATON_GPU_PLAN"] for w in started]
    assert "/x/mine" not in mine and len(set(mine)) == 2


class _FakePopen:
    """A worker process that printed its serving line and exited: records the argv and environment
    `baton serve` gave it (nothing is spawned, no signal is sent: poll() is never None)."""

    spawned: list = []

    def __init__(self, argv, *, env, **kw):
        # NOTE: a pid past any pid_max (2**22): even a stray killpg would find no such group
        self.argv, self.env, self.pid, self.returncode = list(argv), dict(env), 2**30, 0
        role = argv[argv.index("-m") + 1].removesuffix("_worker")
        self.stdout = iter([f"{role}: serving on 127.0.0.1:{4000 + len(self.spawned)}\n"])
        self.spawned.append(self)

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0

    def terminate(self):
        pass

    kill = terminate


def _serve_cuda(monkeypatch, tmp_path, n_gpus: int, *flags: str) -> dict[str, tuple[str | None, str]]:
    """`baton serve --processes --device cuda FLAGS` with n_gpus fake driver entries (baton/gpus.py's
    /proc/driver/nvidia/gpus) and no CUDA_VISIBLE_DEVICES: worker name -> (its CUDA_VISIBLE_DEVICES,
    its --device), as launched. Only the spawn, the health wait and the router are faked."""
    proc_dir = tmp_path / f"gpus{n_gpus}"
    for i in range(n_gpus):
        (proc_dir / f"0000:0{i}:00.0").mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(gpus, "_PROC_GPUS", str(proc_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(processes.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(processes, "wait_serving", lambda *a, **kw: None)
    routed = {}

    def serve(start_router, *, cleanup, **kw):  # the router is not started: the launch is what is tested
        routed["yes"] = True
        cleanup()
        return 0

    monkeypatch.setattr(local, "serve_until_signalled", serve)
    _FakePopen.spawned = []
    p = argparse.ArgumentParser()
    local.add_arguments(p)
    assert local.run(p.parse_args(["--processes", "--device", "cuda", "--port", "0", "--http-port", "0", *flags])) == 0
    assert routed
    out = {}
    for w in _FakePopen.spawned:
        role = w.argv[w.argv.index("-m") + 1].removesuffix("_worker")
        out[f"{role}-{sum(k.startswith(role) for k in out)}"] = (
            w.env.get("CUDA_VISIBLE_DEVICES"),
            w.argv[w.argv.index("--device") + 1],
        )
    return out


def test_baton_serve_puts_prefill_on_gpu_0_and_decode_on_gpu_1(monkeypatch, tmp_path):
    """Two visible GPUs: the disaggregated split, each worker process sees only its own GPU as "cuda"
    (cuda:0 and cuda:1 of the machine); --colocate: both see GPU 0; one GPU: both inherit it."""
    assert _serve_cuda(monkeypatch, tmp_path, 2) == {"prefill-0": ("0", "cuda"), "decode-0": ("1", "cuda")}
    assert _serve_cuda(monkeypatch, tmp_path, 2, "--colocate") == {
        "prefill-0": ("0", "cuda"),
        "decode-0": ("0", "cuda"),
    }
    assert _serve_cuda(monkeypatch, tmp_path, 1) == {"prefill-0": (None, "cuda"), "decode-0": (None, "cuda")}
    three = _serve_cuda(monkeypatch, tmp_path, 2, "--decode", "2")  # round-robin past two workers
    assert three == {"prefill-0": ("0", "cuda"), "decode-0": ("1", "cuda"), "decode-1": ("0", "cuda")}


def test_colocate_needs_processes(capsys):
    p = argparse.ArgumentParser()
    local.add_arguments(p)
    assert local.run(p.parse_args(["--device", "cuda", "--colocate"])) == 2
    assert "--colocate places worker processes: use it with --processes" in capsys.readouterr().err


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
