"""`baton serve` with its router's port or HTTP port taken: one line, exit 2, before any worker starts
(before: the workers loaded the checkpoint first, minutes for a large one, then the router failed to bind)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.serve_args import ports_error

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_taken_port_stops_serve_before_the_workers_load(flag):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        other = "--http-port" if flag == "--port" else "--port"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "baton", "serve", "--processes", flag, str(port), other, "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 2 and time.monotonic() - t0 < 15, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"baton serve: {flag} {port}: cannot listen on 127.0.0.1:{port}: Address already in use (pass another {flag})"
    ]
    assert "loading" not in r.stderr and r.stdout == ""


def test_ports_error_names_a_host_it_cannot_bind():
    assert ports_error("127.0.0.1", 0, 0) is None
    err = ports_error("192.0.2.1", 50051, 0)  # TEST-NET-1: never this machine's address
    assert err.startswith("--port 50051: cannot listen on 192.0.2.1:50051: ") and "check --host" in err
