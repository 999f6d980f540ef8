"""`baton serve --processes` gives up on a worker that keeps dying: a real serve on a copy of the embedded
model; once it serves, the copy's weights are removed and the decode worker SIGKILLed, so each restart
fails. With --max-restarts 1: one restart (it fails: no weights), then one line naming the worker, its exits
and the option, the usual clean-up, exit 1, and no process left. (Restarts that succeed:
tests/system/test_deploy_serve.py.) And the Supervisor alone, on real child processes that exit at once:
-1 restarts forever, 0 gives up at the first exit."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.processes import Progress, WorkerProcess, WorkerSpec
from deploy.supervisor import GaveUp, Supervisor

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "baton" / "assets" / "default-model"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_serve_gives_up_on_a_worker_that_keeps_dying(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_DIR, model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = ["serve", "--processes", "--model", str(model), "--port", "0", "--http-port", "0", "--max-restarts", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids, seen = {}, []
    try:
        for line in proc.stdout:
            if line.startswith("baton: serving on "):
                break
        else:
            pytest.fail("no serving line: " + proc.stderr.read())
        for line in proc.stderr:  # the loading lines came first
            seen.append(line)
            if m := re.search(r"(\w+-\d) loading \(pid (\d+)\)", line):
                pids[m.group(1)] = int(m.group(2))
            if len(pids) == 2:
                break
        (model / "model.safetensors").unlink()  # every restart now fails at start-up
        os.kill(pids["decode-0"], signal.SIGKILL)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(seen) + err
    assert proc.returncode == 1, err
    assert "decode-0 exited (code -9): restarting in 1 s" in err and "decode-0 restart failed" in err, err
    give_up = [line for line in err.splitlines() if "giving up" in line]
    assert give_up == [
        "baton: decode-0: 2 exits within 600 s (the last with code 2), more than --max-restarts 1: giving up: stopping"
    ], err
    assert "baton: stopped (" in err and "Traceback" not in err, err
    assert took < 60, took
    assert not any(_alive(p) for p in pids.values()), err


class _Quits(WorkerSpec):
    """A worker that exits at once with code 3 (a real child process, no model)."""

    def argv(self) -> list[str]:
        return [sys.executable, "-c", "import sys; sys.exit(3)"]


def _supervise(max_restarts: int, seconds: float) -> tuple[int, list[str], BaseException | None]:
    """Runs check() for `seconds` (or until GaveUp) on one worker that always quits -> (starts, lines, error)."""
    lines: list[str] = []

    class _Lines:
        def write(self, text):
            lines.append(text.strip())

        def flush(self):
            pass

    w = WorkerProcess(_Quits("decode", 0), echo=_Lines())
    workers = [w.start()]
    sup = Supervisor(workers, progress=Progress(_Lines()), timeout=5.0, max_restarts=max_restarts)
    sup._failures[0] = -10  # NOTE: back-off 2 ** -10 s: restarts at once, the counting is what is tested
    starts, error, end = 1, None, time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            before = workers[0]
            sup.check()
            starts += workers[0] is not before
            time.sleep(0.05)
    except GaveUp as e:
        error = e
    finally:
        for p in workers:
            p.stop(1.0)
    return starts, lines, error


def test_supervisor_counts_exits_in_its_window():
    starts, lines, error = _supervise(0, 5.0)
    assert starts == 1 and isinstance(error, GaveUp), lines
    assert str(error) == "decode-0: 1 exits within 600 s (the last with code 3), more than --max-restarts 0: giving up"
    starts, lines, error = _supervise(2, 20.0)
    assert starts == 3 and "3 exits within 600 s" in str(error), (lines, error)
    starts, lines, error = _supervise(-1, 3.0)  # forever: restarted until the test stops
    assert error is None and starts >= 3, lines
