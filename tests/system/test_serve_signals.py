"""`baton serve --processes` stopped by SIGTERM at the moment its workers are ready and its router is still
being started (the router's imports take seconds): the start-up is abandoned cleanly, exit 0, no traceback,
no worker left (it was KeyboardInterrupt's traceback and exit 130 in that window). Stops while serving are
tests/system/test_deploy_serve.py's; those at a request's time tests/router/test_router_shutdown.py's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # not reaped yet by a parent that is itself gone: init reaps it
            return True
        time.sleep(0.05)
    return False


def test_sigterm_between_workers_ready_and_router_serving_cleans_up():
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton", "serve", "--processes", "--port", "0", "--http-port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids, ready, seen = [], 0, []
    try:
        for line in proc.stderr:
            seen.append(line)
            if m := re.search(r"loading \(pid (\d+)\)", line):
                pids.append(int(m.group(1)))
            ready += bool(re.match(r"baton: (prefill|decode)-\d+ ready on ", line))
            if ready == 2:
                proc.send_signal(signal.SIGTERM)  # the router is being imported / started now
                break
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(seen) + err
    assert len(pids) == 2 and ready == 2, err
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "baton: serving on" not in out or "stopping" in err  # served a moment at most, and then stopped
    assert all(_gone(p, 10) for p in pids), err
