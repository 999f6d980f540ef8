"""deploy/launch.py against a real Ray head: launch 1 prefill + 1 decode actor and the router actor (its
OpenAI HTTP door on, --http-port, with --reasoning-parser), generate (fast, exact; a completion over HTTP), kill the decode actor (Ray restarts it on a new port), check the router's
health went NOT_SERVING then SERVING and that it serves through the restarted actor, then stop.

The head is `ray start --head` on loopback with its own temp dir; it is stopped by killing exactly
the processes that carry that temp dir (`ray stop` would stop every Ray instance of the machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import httpx
import pytest
from conftest import pick_free_port
from test_deploy_serve import PROMPT, ROOT, cmdline_matches, generate, port_open

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
NAMESPACE = "baton-deploy-test"


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **extra}


def _stop_head(temp_dir: str) -> None:
    def pids():
        return [int(line.split(":")[0]) for line in cmdline_matches(temp_dir)]

    # 2 s of SIGTERM: the dashboard and log monitor exit at once; gcs_server, raylet and the autoscaler
    # monitor of a `ray start --head` were still up 30 s after SIGTERM here, so a longer wait only waits
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 3.0)):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while pids() and time.monotonic() < end:
            time.sleep(0.2)


@pytest.fixture
def ray_head(one_ray_at_a_time):
    temp_dir = tempfile.mkdtemp(prefix="baton-rt-", dir="/tmp")  # short: Ray's unix sockets live here
    port = pick_free_port()
    # `python -m ray.scripts.scripts` is the `ray` CLI, without relying on PATH
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            f"--port={port}",
            f"--temp-dir={temp_dir}",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        # NOTE: Ray advertises the node's routable IP even when asked for 127.0.0.1.
        addr = next(
            (ln.split("'")[1] for ln in (r.stdout + r.stderr).splitlines() if "ray start --address=" in ln),
            f"127.0.0.1:{port}",
        )
        yield addr, temp_dir
    finally:
        _stop_head(temp_dir)
        left = cmdline_matches(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left: {left}"


def _ray_script(address: str, body: str) -> str:
    """Runs `body` as a Ray driver in a subprocess (keeps Ray out of the pytest process)."""
    code = textwrap.dedent(f"""
        import json, os, time
        from deploy.launch import use_ray_token_if_present
        use_ray_token_if_present()  # token mode only when the head made a token (Ray >= 2.5x may not)
        import ray
        ray.init(address={address!r}, namespace={NAMESPACE!r}, logging_level="WARNING", log_to_driver=False)
    """) + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


class HealthLog(threading.Thread):
    """Polls the router's grpc.health.v1 status every 50 ms and records each change."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address, self.changes, self.done = address, [], threading.Event()

    def run(self):
        from deploy.processes import health_status

        while not self.done.is_set():
            s = health_status(self.address, timeout=1.0)
            if not self.changes or self.changes[-1][1] != s:
                self.changes.append((time.monotonic(), s))
            time.sleep(0.05)

    def wait_for(self, status: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.changes and self.changes[-1][1] == status:
                return True
            time.sleep(0.1)
        return False


def test_launch_on_ray_head_survives_decode_actor_restart(ray_head):
    address, _ = ray_head
    router_port, http_port = pick_free_port(), pick_free_port()
    t0 = time.monotonic()
    launch = subprocess.run(
        [
            sys.executable,
            "deploy/launch.py",
            "--address",
            address,
            "--namespace",
            NAMESPACE,
            "--prefill",
            "1",
            "--decode",
            "1",
            "--gpus-per-worker",
            "0",
            "--worker-host",
            "127.0.0.1",
            "--router-host",
            "127.0.0.1",
            "--router-port",
            str(router_port),
            "--http-port",
            str(http_port),
            "--reasoning-parser",
            "qwen3",
            "--timeout",
            "240",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode == 0, launch.stdout + launch.stderr
    router = f"127.0.0.1:{router_port}"
    assert f"baton: serving on {router}" in launch.stdout.splitlines(), launch.stdout + launch.stderr
    print(f"launch: serving after {time.monotonic() - t0:.1f} s")
    assert f"baton: http on http://127.0.0.1:{http_port}" in launch.stdout.splitlines(), launch.stdout
    try:
        env = _env()
        fast = generate(router, env=env)
        # the router actor's OpenAI door (--http-port): a completion equal to the gRPC one
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as h:
            assert h.get("/health").status_code == 200
            model = h.get("/v1/models").json()["data"][0]["id"]
            got = h.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12})
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == fast["text"]  # greedy: the same 12 tokens' text
        assert generate(router, "--mode", "exact", env=env)["token_ids"] == fast["token_ids"]

        health = HealthLog(router)
        health.start()
        assert health.wait_for("SERVING", 10)
        t_kill = time.monotonic()
        old_addr = _ray_script(
            address,
            """
            a = ray.get_actor("baton-decode-0")
            addr = ray.get(a.address.remote())
            ray.kill(a, no_restart=False)
            print(addr)
        """,
        )
        assert health.wait_for("NOT_SERVING", 30), health.changes
        assert health.wait_for("SERVING", 120), health.changes
        health.done.set()
        seq = [s for _, s in health.changes if s in ("SERVING", "NOT_SERVING")]
        assert seq[-3:] == ["SERVING", "NOT_SERVING", "SERVING"], health.changes
        print(f"decode actor killed: NOT_SERVING -> SERVING again after {time.monotonic() - t_kill:.1f} s")

        again = generate(router, env=env)
        assert again["token_ids"] == fast["token_ids"]
        assert generate(router, "--mode", "exact", env=env)["token_ids"] == fast["token_ids"]
        out = _ray_script(
            address,
            """
            a = ray.get_actor("baton-decode-0")
            print(json.dumps([ray.get(a.address.remote()), ray.get(a.stats.remote())["requests_total"]]))
        """,
        )
        new_addr, served = json.loads(out)
        assert new_addr != old_addr, "the decode actor was not restarted"
        assert served > 0, "the router did not use the restarted decode actor"
        old_host, old_port = old_addr.rsplit(":", 1)
        assert not port_open(old_host, int(old_port)), "the killed actor's port is still open"
    finally:
        stop = subprocess.run(
            [sys.executable, "deploy/launch.py", "--address", address, "--namespace", NAMESPACE, "--stop"],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "stopped 3 actor(s)" in stop.stderr, stop.stderr
    end = time.monotonic() + 10
    while port_open("127.0.0.1", router_port) and time.monotonic() < end:
        time.sleep(0.2)
    assert not port_open("127.0.0.1", router_port), "router port still open after --stop"
