"""A child process that dies with its parent, without code between fork and exec.

Why not `subprocess.Popen(preexec_fn=prctl(PR_SET_PDEATHSIG))`: a preexec_fn forces a real fork()
(CPython otherwise uses vfork/posix_spawn), so gRPC's pthread_atfork handlers run in the child. With
channels live in the parent (a router, a test, `baton serve --processes` restarting a worker), grpcio
>= 1.80 restarts its poller in that child, which then hits the fds `close_fds` closes before exec:
"eventfd_write: Bad file descriptor" or an epoll_wait EBADF abort (grpc/grpc#43055). Measured with
grpcio 1.85.3 (`benchmarks/grpc_fork_probe.py`, two runs): 14 and 20 of 2000 children spawned with a
preexec_fn aborted before exec (SIGABRT: "epoll_wait error: Bad file descriptor", as a router child once
did in CI, or "Check failed: next_worker->state == KICKED"), 0 of 2000 without. Once, the parent's own
channel also lost a call ("Socket closed") while such children forked.

So the parent only names itself in the environment (`child_env`), and the child, first thing in its
main(), calls `die_with_parent()`:
    prctl(PR_SET_PDEATHSIG, SIGTERM)    the kernel sends SIGTERM when the parent (the forking thread,
                                        see deploy.supervisor.Supervisor) exits, however it dies
    getppid() != BATON_PARENT_PID       the parent died before the prctl: exit now (status 143)
Linux only; elsewhere (or without the variable: started by hand, by Ray) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "BATON_PARENT_PID"
PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) plus BATON_PARENT_PID = this process."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def die_with_parent() -> bool:
    """Arms SIGTERM-on-parent-death for this process when its parent asked for it; -> armed.
    Exits (SIGTERM's status) if that parent is already gone."""
    want = os.environ.pop(PARENT_ENV, "")  # NOTE: popped, so our own children do not inherit it
    if not want or not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return False
    if os.getppid() != int(want):  # re-parented already: the parent died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)
    return True
