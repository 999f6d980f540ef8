"""`baton serve --processes --mps` (deploy/mps.py): a private MPS control daemon started before the workers,
its pipe folder given to every worker, stopped after them; clear errors when it cannot start. The control
binary here is a stand-in script on PATH that records how it was called and keeps the daemon's `control`
pipe as a plain file (no GPU on CI); sharing_note's line for workers on one GPU."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

import pytest

from deploy.mps import LOG_ENV, PIPE_ENV, MpsDaemon, MpsError, running_daemon
from deploy.processes import sharing_note

FAKE = """#!/bin/sh
# a stand-in for nvidia-cuda-mps-control: -d starts the "daemon" (its control pipe), stdin `quit` stops it
echo "call $* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{record}"
if [ "$1" = "-d" ]; then
  {fail}
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read cmd
echo "stdin $cmd" >> "{record}"
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    def make(fail: str = "") -> str:
        bin_dir, record = tmp_path / "bin", tmp_path / "calls.txt"
        bin_dir.mkdir(exist_ok=True)
        exe = bin_dir / "nvidia-cuda-mps-control"
        exe.write_text(FAKE.format(record=record, fail=fail))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        return str(record)

    return make


def test_the_daemon_is_private_to_this_serve_and_stopped_with_it(fake_control):
    record = fake_control()
    d = MpsDaemon().start()
    pipe, log = d.env[PIPE_ENV], d.env[LOG_ENV]
    folder = d.folder
    assert folder and pipe.startswith(folder) and log.startswith(folder) and os.path.isdir(log)
    assert running_daemon(d.env) == pipe and running_daemon({PIPE_ENV: folder}) is None
    assert open(record).read().splitlines() == [f"call -d pipe={pipe} log={log}"]
    d.stop()
    lines = open(record).read().splitlines()
    assert lines[1:] == [f"call  pipe={pipe} log={log}", "stdin quit"]  # quit sent to the same daemon
    assert not os.path.exists(folder) and running_daemon(d.env) is None
    d.stop()  # idempotent: nothing more is sent
    assert len(open(record).read().splitlines()) == 3


def test_a_daemon_that_fails_to_start_says_why_and_leaves_nothing(fake_control, tmp_path, monkeypatch):
    fake_control(fail='echo "An instance of this daemon is already running" >&2; exit 1')
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the daemon's folder would be made
    d = MpsDaemon()
    with pytest.raises(MpsError, match="already running"):
        d.start()
    assert d.folder is None and os.listdir(temp) == []
    d.stop()  # nothing to stop


def test_no_control_binary_is_a_clear_error():
    with pytest.raises(MpsError, match="not on PATH.*drop --mps"):
        MpsDaemon(binary="no-such-nvidia-cuda-mps-control").start()


def test_workers_sharing_a_gpu_are_told_whether_mps_applies(tmp_path):
    shared = {"BATON_GPU_WORKERS": "2"}
    envs, names = [shared, shared, None], ["prefill-0", "decode-0", "decode-1"]
    note = sharing_note(names, envs, {PIPE_ENV: str(tmp_path)}, mps=False)
    assert note.startswith("prefill-0, decode-0 share a GPU without MPS") and "--mps" in note
    (tmp_path / "control").touch()  # an operator's daemon the workers reach
    assert sharing_note(names, envs, {PIPE_ENV: str(tmp_path)}, mps=False) == (
        f"MPS: prefill-0, decode-0 share a GPU and reach the MPS daemon at {tmp_path}"
    )
    assert sharing_note(names, envs, {}, mps=True) is None  # serve started its own
    assert sharing_note(names, [None, None, None], {}, mps=False) is None  # one GPU each


@pytest.mark.parametrize("argv", [["--mps"], ["--mps", "--processes"], ["--mps", "--device", "cuda"]])
def test_mps_is_refused_outside_cuda_worker_processes(argv):
    got = subprocess.run(
        [sys.executable, "-m", "baton", "serve", *argv], capture_output=True, text=True, timeout=120, cwd=os.getcwd()
    )
    assert got.returncode == 2, got.stderr
    assert "--mps runs CUDA worker processes under an MPS daemon: use it with --processes --device cuda" in got.stderr
