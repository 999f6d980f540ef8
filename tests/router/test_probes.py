"""Probes an operator points at a router: liveness apart from readiness, and `baton health`'s answers.

A real router in this process (serve_router, its HTTP API on a loopback port) whose workers never come up
(nothing listens on port 9): readiness (HTTP /health, gRPC health "" and baton.v1.Router) is 503 /
NOT_SERVING, while liveness (HTTP /live, gRPC health "liveness") answers 200 / SERVING, without the token;
after stop_router both are gone. `baton health` runs as a subprocess (`python -m baton health`): its stdout
status, its stderr reason and its distinct exit codes for serving, not serving, unreachable (refused, and a
socket that never answers) and another RPC error (health guarded by the token).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import pick_free_port  # noqa: E402
from helpers import router_without_workers  # noqa: E402

from baton.client_cli import HEALTH_EXIT  # noqa: E402
from baton.settings import Settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "baton" / "assets" / "default-model"
TOKEN = "probe-token"


def baton_health(addr: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "baton", "health", "--addr", addr, "--timeout", "1", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def router():
    from router.__main__ import stop_router

    handle, servicer = router_without_workers(TOKEN, pick_free_port())
    yield handle, servicer
    stop_router(handle, servicer, 0.2)


def test_liveness_answers_while_readiness_is_not_serving(router):
    handle, servicer = router
    url = servicer.http.url
    r = httpx.get(url + "/health", timeout=10)  # readiness: no worker up
    assert (r.status_code, r.json()) == (503, {"status": "NOT_SERVING"})
    r = httpx.get(url + "/live", timeout=10)  # liveness: no token, workers down or not
    assert (r.status_code, r.json()) == (200, {"status": "ALIVE"})
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401  # the rest still needs the token
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    assert 'baton_router_http_requests_total{endpoint="/live",status="200"} 1.0' in metrics


def test_baton_health_statuses_and_exit_codes(router):
    handle, _ = router
    r = baton_health(handle.address)  # readiness: answered, NOT_SERVING
    assert (r.returncode, r.stdout.strip()) == (HEALTH_EXIT["not_serving"], "NOT_SERVING"), r
    assert "answered: the server is NOT_SERVING" in r.stderr
    r = baton_health(handle.address, "--service", "liveness")
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "SERVING", ""), r
    r = baton_health(handle.address, "--service", "baton.v1.Nothing")
    assert (r.returncode, r.stdout.strip()) == (HEALTH_EXIT["not_serving"], "SERVICE_UNKNOWN"), r
    assert "no health service 'baton.v1.Nothing'" in r.stderr


def test_baton_health_unreachable_says_why_with_its_own_code():
    r = baton_health(f"127.0.0.1:{pick_free_port()}")  # nothing listens: refused
    assert (r.returncode, r.stdout.strip()) == (HEALTH_EXIT["unreachable"], "UNAVAILABLE"), r
    assert " unreachable: UNAVAILABLE: " in r.stderr and "refused" in r.stderr.lower(), r.stderr
    with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts connections, never speaks HTTP/2
        r = baton_health(f"127.0.0.1:{mute.getsockname()[1]}")
    assert r.returncode == HEALTH_EXIT["unreachable"] and r.stdout.strip() in ("DEADLINE_EXCEEDED", "UNAVAILABLE")
    assert " unreachable: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len({0, 1, 2, 3, 4} & set(HEALTH_EXIT.values())) == 5


def test_baton_health_refused_by_a_guarded_server_is_an_rpc_error():
    from baton.rpc import build_server

    handle = build_server(
        [], service_names=[], port=0, settings=Settings(token=TOKEN), protect_health=True, serving=True
    )
    try:
        r = baton_health(handle.address)
        assert (r.returncode, r.stdout.strip()) == (HEALTH_EXIT["rpc_error"], "UNAUTHENTICATED"), r
        assert "health check failed: UNAUTHENTICATED" in r.stderr
    finally:
        handle.stop(0)


def test_liveness_goes_with_the_router():
    from router.__main__ import serve_router, stop_router

    handle, servicer = serve_router(
        prefill=["127.0.0.1:9"],
        decode=["127.0.0.1:9"],
        model_dir=str(DEFAULT_DIR),
        port=0,
        settings=Settings(),
        http_port=pick_free_port(),
    )
    url, addr = servicer.http.url, handle.address
    assert httpx.get(url + "/live", timeout=10).status_code == 200
    stop_router(handle, servicer, 0.2)
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/live", timeout=2)
    assert baton_health(addr, "--service", "liveness").returncode == HEALTH_EXIT["unreachable"]
