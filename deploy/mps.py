"""NVIDIA MPS for worker processes that share a GPU (`baton serve --processes --mps`).

Two CUDA processes on one GPU run their kernels in turns, one context's time slice at a time. Under an MPS
server they run side by side: on an H100 exact mode at 32 streams went 1.085x (its round 97 -> 86 ms) with
the prefill and decode workers on one GPU (benchmarks/results/gpu-h100-2026-12-06-mps.md).

Lifecycle of the daemon `baton serve --mps` starts (MpsDaemon):
    start()   `nvidia-cuda-mps-control -d` with a private pipe and log folder (CUDA_MPS_PIPE_DIRECTORY,
              CUDA_MPS_LOG_DIRECTORY), so it is this launcher's alone and another user's daemon is neither
              reached nor stopped; the daemon starts its server when the first worker connects. A missing
              binary or a daemon that does not start raises MpsError with the reason (its log's tail)
    env       those two variables: every worker process gets them (a restarted worker too)
    stop()    after the workers have stopped: `quit` to the daemon (it stops its server), then the folder
              is removed. Idempotent.
The GPU's settings (compute mode, clocks) are never touched. running_daemon() finds one the environment
already reaches (an operator's, started by hand as the README says), so `baton serve` can say which applies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from deploy.processes import StartupError

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
DEFAULT_PIPE = "/tmp/nvidia-mps"  # where clients look when CUDA_MPS_PIPE_DIRECTORY is unset


class MpsError(StartupError):
    """MPS could not be started (no control binary, or the daemon failed): the message says why (`baton serve`:
    start-up failed, exit 1)."""


def running_daemon(env: dict[str, str] | None = None) -> str | None:
    """The pipe folder of an MPS control daemon that processes with this environment reach, or None: the
    folder CUDA_MPS_PIPE_DIRECTORY names (else the default) holding the daemon's `control` pipe."""
    env = os.environ if env is None else env
    pipe = env.get(PIPE_ENV) or DEFAULT_PIPE
    return pipe if os.path.exists(os.path.join(pipe, "control")) else None


class MpsDaemon:
    """One private MPS control daemon (module doc)."""

    def __init__(self, binary: str = CONTROL, timeout: float = 15.0):
        self.binary, self.timeout = binary, timeout
        self.path: str | None = None  # the binary found on PATH by start()
        self.folder: str | None = None
        self.env: dict[str, str] = {}

    def start(self) -> "MpsDaemon":
        path = self.path = shutil.which(self.binary)
        if path is None:
            raise MpsError(f"{self.binary} is not on PATH (it comes with the NVIDIA driver's utilities): drop --mps")
        self.folder = tempfile.mkdtemp(prefix="baton-mps-")
        pipe, log = os.path.join(self.folder, "pipe"), os.path.join(self.folder, "log")
        os.makedirs(pipe)
        os.makedirs(log)
        self.env = {PIPE_ENV: pipe, LOG_ENV: log}
        try:
            got = subprocess.run(
                [path, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True, timeout=self.timeout
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            self._remove()
            raise MpsError(f"{self.binary} -d: {e}") from e
        if got.returncode != 0:
            why = (got.stderr or got.stdout).strip() or self._log_tail() or f"exit status {got.returncode}"
            self._remove()
            raise MpsError(f"{self.binary} -d failed: {why}")
        return self

    def stop(self) -> None:
        """quit to the daemon (its server stops with it), then the folder goes; idempotent."""
        if self.folder is None:
            return
        try:
            subprocess.run(
                [self.path or self.binary],
                input="quit\n",
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
                timeout=self.timeout,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass  # the daemon is gone or stuck: nothing more to do from here
        finally:
            self._remove()

    def describe(self) -> str:
        return (
            f"MPS: a daemon of this serve's own (pipe {self.env.get(PIPE_ENV)}): the workers' kernels run side by side"
        )

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.env[LOG_ENV], "control.log")) as f:
                return " | ".join(f.read().strip().splitlines()[-3:])
        except OSError:
            return ""

    def _remove(self) -> None:
        folder, self.folder = self.folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
