"""Does spawning a child with a Popen preexec_fn break it while gRPC is live? (grpc/grpc#43055)

    python benchmarks/grpc_fork_probe.py [--spawns 2000] [--out FILE]

One process serves grpc.health.v1 on loopback and keeps two client threads calling Check. It then
spawns `/bin/true` --spawns times with a preexec_fn (what deploy.processes used to pass: a real fork(),
so gRPC's atfork handlers run in the child before exec) and --spawns times without (CPython uses vfork:
no handlers). A spawn is "bad" when the child exits non-zero or writes anything to stderr (gRPC's
"Kick failed: eventfd_write: Bad file descriptor", or an epoll_wait EBADF abort). parent_rpc_errors
counts the busy client's failed calls during each phase (the parent's own channel). Prints JSON.
Why it matters: baton/lifeline.py.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import faulthandler
import signal
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit, machine  # noqa: E402


class BusyClient:
    """A grpc.health.v1 server on loopback and two client threads calling Check until close(); their
    failed calls are counted per `phase` (which spawns run meanwhile): errors[phase][status name]."""

    def __init__(self):
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub, self.stop = health_pb2_grpc.HealthStub(self.channel), threading.Event()
        self.phase, self.errors = "start", {}
        self.threads = [threading.Thread(target=self._call, daemon=True) for _ in range(2)]
        for t in self.threads:
            t.start()

    def _call(self) -> None:
        while not self.stop.is_set():
            try:
                self.stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.RpcError as e:  # e.g. UNAVAILABLE "Socket closed" while children fork
                by_code = self.errors.setdefault(self.phase, {})
                by_code[e.code().name] = by_code.get(e.code().name, 0) + 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.channel.close()
        self.server.stop(0)


def spawn(n: int, preexec) -> dict:
    """n spawns of /bin/true. A child that crashes in gRPC's fork handlers (before its stderr is the pipe)
    would print faulthandler's dump into this process's stderr, so faulthandler is off while they run;
    the crash still counts (the child's exit status)."""
    bad, example = 0, ""
    dumping = faulthandler.is_enabled()
    faulthandler.disable()
    try:
        for _ in range(n):
            p = subprocess.Popen(
                ["/bin/true"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=preexec,
            )  # fmt: skip
            _, err = p.communicate()
            if p.returncode != 0 or err:
                bad += 1
                example = example or f"rc {p.returncode}: {err.decode(errors='replace').strip()[:300]}"
    finally:
        if dumping:  # back on, to the process's own stderr (sys.stderr may be a capture without a fd)
            faulthandler.enable(file=sys.__stderr__)
    return {"spawns": n, "bad": bad, "example": example}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spawns", type=int, default=2000)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("grpc_fork_probe: Linux only (PR_SET_PDEATHSIG)")
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    client = BusyClient()
    try:
        client.phase = "preexec_fn"
        with_pre = spawn(a.spawns, lambda: prctl(1, signal.SIGTERM))
        client.phase = "no_preexec_fn"
        without = spawn(a.spawns, None)
    finally:
        client.close()
    with_pre["parent_rpc_errors"] = client.errors.get("preexec_fn", {})
    without["parent_rpc_errors"] = client.errors.get("no_preexec_fn", {})
    res = {
        "benchmark": "grpc_fork_probe",
        "command": " ".join(["python", "benchmarks/grpc_fork_probe.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "preexec_fn": with_pre,
        "no_preexec_fn": without,
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
