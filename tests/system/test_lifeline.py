"""baton/lifeline.py: a worker process dies with its parent, armed by the child itself (no preexec_fn,
so no real fork running gRPC's fork handlers in the child: grpc/grpc#43055)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton import lifeline
from deploy import processes
from deploy.processes import WorkerProcess, WorkerSpec

ROOT = str(Path(__file__).resolve().parents[2])
CHILD = (
    "import sys, time; sys.path.insert(0, %r); from baton.lifeline import die_with_parent; "
    "print(die_with_parent(), flush=True); time.sleep(60)" % ROOT
)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """True once pid has exited (absent, or a zombie nobody reaped yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@linux
def test_child_gets_sigterm_when_its_parent_is_killed():
    parent_code = (
        "import subprocess, sys; sys.path.insert(0, %r); from baton.lifeline import child_env; "
        "c = subprocess.Popen([sys.executable, '-c', %r], env=child_env(), stdout=subprocess.PIPE, "
        "text=True); print(c.pid, c.stdout.readline().strip(), flush=True); "
        "import time; time.sleep(60)" % (ROOT, CHILD)
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        pid, armed = parent.stdout.readline().split()
        assert armed == "True"
        pid = int(pid)
        assert not _gone(pid, timeout=0.3)  # alive while the parent is
        parent.kill()  # SIGKILL: no clean-up code of the parent runs
        parent.wait(10)
        assert _gone(pid), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(10)


@linux
def test_child_whose_parent_is_already_gone_exits_at_once():
    # BATON_PARENT_PID names another process than the real parent: as if the parent died (and the
    # child was re-parented) before the prctl
    env = dict(os.environ, **{lifeline.PARENT_ENV: "1" if os.getpid() != 1 else "2"})
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == -signal.SIGTERM


def test_without_the_variable_it_does_nothing():
    env = {k: v for k, v in os.environ.items() if k != lifeline.PARENT_ENV}
    code = CHILD.replace("time.sleep(60)", "pass")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert (p.returncode, p.stdout.strip()) == (0, "False")


def test_child_env_names_this_process_and_keeps_the_rest():
    env = lifeline.child_env({"A": "1"})
    assert env == {"A": "1", lifeline.PARENT_ENV: str(os.getpid())}


def test_worker_process_spawns_without_preexec_fn(monkeypatch):
    """A preexec_fn makes CPython fork() instead of vfork(): gRPC's atfork handlers then run in the
    child, which can abort before exec. WorkerProcess names itself in the env instead."""
    seen = {}

    class FakePopen:
        def __init__(self, argv, **kw):
            seen.update(kw, argv=argv)
            self.stdout, self.pid = iter(()), 4242

        def poll(self):
            return 0

    monkeypatch.setattr(processes.subprocess, "Popen", FakePopen)
    WorkerProcess(WorkerSpec("decode", 0), env={"X": "y"}).start()
    assert seen.get("preexec_fn") is None and seen["start_new_session"] is True
    assert seen["env"] == {"X": "y", lifeline.PARENT_ENV: str(os.getpid())}
    assert seen["argv"][1:4] == ["-u", "-m", "decode_worker"]


@linux
def test_grpc_fork_probe_counts_spawns_and_vfork_spawns_stay_clean(tmp_path, capsys):
    """benchmarks/grpc_fork_probe.py (the measurement behind baton/lifeline.py): with gRPC busy in this
    process, spawns without a preexec_fn never run gRPC's fork handlers, so none goes bad."""
    from benchmarks import grpc_fork_probe

    r = grpc_fork_probe.main(["--spawns", "30", "--out", str(tmp_path / "p.json")])
    assert r["preexec_fn"]["spawns"] == r["no_preexec_fn"]["spawns"] == 30
    assert r["no_preexec_fn"]["bad"] == 0
    assert '"grpc_fork_probe"' in (tmp_path / "p.json").read_text()
