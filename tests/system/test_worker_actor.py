"""The workers as processes (`python -m prefill_worker|decode_worker`) and as Ray actors, over real gRPC."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import local_ray, make_tiny_dir

from baton.rpc import make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN, T = 256, 30
PROMPT = [9, 8, 7, 6, 5]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _roundtrip(prefill_addr: str, decode_addr: str, settings: Settings, n: int = 12) -> list[int]:
    """Prefill with hand-off to the decode worker, then Decode: the tokens of one FAST request."""
    with make_channel(prefill_addr, settings) as pc, make_channel(decode_addr, settings) as dc:
        r = prefill_pb2_grpc.PrefillWorkerStub(pc).Prefill(
            prefill_pb2.PrefillRequest(session_id="r", prompt_ids=PROMPT, decode_target=decode_addr), timeout=T
        )
        out = [r.first_token]
        for m in decode_pb2_grpc.DecodeWorkerStub(dc).Decode(
            decode_pb2.DecodeRequest(session_id="r", max_new_tokens=n - 1, ignore_eos=True, release_at_end=True),
            timeout=T,
        ):
            out += m.token_ids
        return out


def _health(address: str, settings: Settings) -> str:
    with make_channel(address, settings) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _reference(model_dir, n=12):
    import torch

    from baton.complete import complete

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same as the workers (OMP_NUM_THREADS=1)
    try:
        return complete(model_dir, PROMPT, n, max_len=MAX_LEN, ignore_eos=True)
    finally:
        torch.set_num_threads(threads)


def _serving_line(proc: subprocess.Popen, role: str, timeout: float = 120) -> str:
    t0 = time.monotonic()
    for line in proc.stdout:
        if line.startswith(f"{role}: serving on "):
            return line.split()[-1]
        assert time.monotonic() - t0 < timeout, f"{role}: no serving line"
    raise AssertionError(f"{role} exited with {proc.wait()} before serving")


@pytest.mark.slow
def test_entry_points_serve_and_stop_on_sigterm(tmp_path):
    model = make_tiny_dir(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    common = [
        "--model",
        str(model),
        "--port",
        "0",
        "--max-len",
        str(MAX_LEN),
        "--slots",
        "2",
        "--token-file",
        str(token_file),
    ]
    procs = {
        role: subprocess.Popen(
            [sys.executable, "-m", f"{role}_worker", *common, *extra],
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for role, extra in (("prefill", []), ("decode", ["--engine", "mtp", "--engines", "bf16,mtp"]))
    }
    try:
        addr = {role: _serving_line(p, role) for role, p in procs.items()}
        settings = Settings(token="s3cret")
        assert {_health(a, settings) for a in addr.values()} == {"SERVING"}
        assert _roundtrip(addr["prefill"], addr["decode"], settings) == _reference(model)
        with make_channel(addr["decode"], Settings()) as ch:  # the token file is in force
            with pytest.raises(grpc.RpcError) as ei:
                decode_pb2_grpc.DecodeWorkerStub(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=30) for p in procs.values()] == [0, 0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.usefixtures("one_ray_at_a_time")
def test_ray_actors_serve_over_grpc(tmp_path):
    ray = pytest.importorskip("ray")
    from decode_worker.actor import make_actor_class as decode_actor
    from prefill_worker.actor import make_actor_class as prefill_actor

    model = str(make_tiny_dir(tmp_path))
    local_ray(
        ray,
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    try:
        opts = dict(model_dir=model, port=0, max_len=MAX_LEN, slots=2)
        p = prefill_actor(num_gpus=0, max_restarts=1).options(num_cpus=0).remote(**opts)
        d = decode_actor(num_gpus=0, max_restarts=1).options(num_cpus=0).remote(engine="bf16", **opts)
        pa, da = ray.get([p.address.remote(), d.address.remote()], timeout=120)
        assert ray.get([p.health.remote(), d.health.remote()]) == ["SERVING", "SERVING"]
        assert _roundtrip(pa, da, Settings()) == _reference(model)
        ps, dst = ray.get([p.stats.remote(), d.stats.remote()])
        assert (ps["role"], ps["sessions"], ps["address"], ps["max_len"]) == ("prefill", 0, pa, MAX_LEN)
        assert (dst["role"], dst["sessions"], dst["engine"].split(",")[0]) == ("decode", 0, "bf16")
        assert ray.get([p.stop.remote(), d.stop.remote()]) == [True, True]
        assert ray.get(p.health.remote()) == "UNREACHABLE"
    finally:
        ray.shutdown()


def test_worker_actors_take_the_restarts_asked_for():
    """deploy/launch.py and `baton serve` --max-restarts N: each worker actor class gets Ray's max_restarts N
    (-1 by default: forever), and no task retries where it never restarts (Ray has none to give)."""
    from deploy import launch

    for role in ("prefill", "decode"):
        assert launch._actor_class(role, num_gpus=0, resources=None)._default_options["max_restarts"] == -1
        cls = launch._actor_class(role, num_gpus=0, resources=None, max_restarts=3)
        assert cls._default_options["max_restarts"] == 3
        never = launch._actor_class(role, num_gpus=0, resources=None, max_restarts=0)._default_options
        assert never["max_restarts"] == 0 and never["max_task_retries"] == 0
