"""Long subprocess runs that a test (or its module fixture) only waits for and checks, started in the
background as soon as pytest has collected a test that needs one (conftest.py pytest_collection_finish),
at nice 19: they run on the CPU the rest of the suite leaves idle (the gRPC and process tests of a 2-core
CI box wait on sockets and sleeps much of the time) and yield it to everything else. The command, its
environment and working directory, the test's timeout (counted from when the test asks) and every check
are as before; only the start moves earlier. A run that was not prestarted, or whose command or
environment differ at the time of the test, runs in the foreground then, as before.

A test module declares its runs: PRESTART = {name: make_job}, name the fixture or test that calls
prestart.run(make_job(), timeout); make_job() -> Job (output files: under prestart.workdir(job.name)).
BATON_PRESTART=0 turns the background starts off; so does pytest-xdist (the suite's default, -n 2): each
worker collects every test but runs only some, and the two workers already keep CI's two cores busy, so
each run goes in the foreground of the worker that runs its test."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# The child lowers its own priority, then becomes the command (no preexec_fn in a threaded pytest). It runs in
# its own session, so in its own scheduler autogroup (Linux, kernel.sched_autogroup_enabled), whose nice it sets
# to 19 too: CPU time is shared between autogroups first, and nice only counts inside one. In the tests'
# autogroup at nice 19, the runs still took half the CPU from every process a test starts in a new session
# (baton serve --processes' workers, start_new_session=True), whenever pytest itself was waiting on them.
_NICE = (
    "import os, sys\n"
    "os.nice(19)\n"
    "try:\n"
    "    with open('/proc/self/autogroup', 'w') as f:\n"
    "        f.write('19')\n"
    "except OSError:\n"
    "    pass\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


@dataclass
class Job:
    name: str  # unique in the session: its workdir and its key
    argv: list[str]
    cwd: str | None = None
    env: dict[str, str] | None = None


_root: Path | None = None
_running: dict[str, tuple[Job, subprocess.Popen]] = {}


def workdir(name: str) -> Path:
    """A directory for the run `name`'s files, the same for the prestart and the test; removed by stop_all."""
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="baton-prestart-"))
        atexit.register(stop_all)
    d = _root / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def _out(job: Job) -> tuple[Path, Path]:
    d = workdir(job.name) / ".run"
    d.mkdir(exist_ok=True)
    return d / "stdout", d / "stderr"


def start(job: Job) -> None:
    if job.name in _running or os.environ.get("BATON_PRESTART") == "0" or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under xdist (pyproject's -n 2) every worker collects every test: each run in its test's worker
    out, err = _out(job)
    with open(out, "wb") as o, open(err, "wb") as e:
        p = subprocess.Popen(
            [sys.executable, "-c", _NICE, *job.argv],
            cwd=job.cwd,
            env=job.env,
            stdin=subprocess.DEVNULL,
            stdout=o,
            stderr=e,
            start_new_session=True,  # its own group, to kill; its own autogroup, at nice 19 (see _NICE)
        )
    _running[job.name] = (job, p)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, 9)
        except ProcessLookupError:
            pass
    p.wait()


def _key(job: Job) -> tuple:
    """What must be the same: the command, its directory and environment but for pytest's PYTEST_CURRENT_TEST
    (the test of the moment, which no run reads)."""
    env = None if job.env is None else {k: v for k, v in job.env.items() if k != "PYTEST_CURRENT_TEST"}
    return job.argv, job.cwd, env


def run(job: Job, timeout: float) -> subprocess.CompletedProcess:
    """What subprocess.run(job.argv, cwd, env, capture_output=True, text=True, timeout=timeout) gives: the
    prestarted run of the same job if there is one (waited for up to `timeout` from now), else run now."""
    got = _running.pop(job.name, None)
    if got is not None and _key(got[0]) != _key(job):  # another command or environment by now: run it afresh
        _kill(got[1])
        got = None
    if got is None:
        return subprocess.run(job.argv, cwd=job.cwd, env=job.env, capture_output=True, text=True, timeout=timeout)
    p = got[1]
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(p)
        raise
    out, err = _out(job)
    return subprocess.CompletedProcess(job.argv, p.returncode, out.read_text(), err.read_text())


def stop_all() -> None:
    """Kills the runs no test waited for (deselected, or the session stopped early); removes the files."""
    global _root
    while _running:
        _kill(_running.popitem()[1][1])
    if _root is not None:
        shutil.rmtree(_root, ignore_errors=True)
        _root = None
