"""GIL probe: how long a Python thread of this process waits for the GIL while a state hand-off streams.

A probe thread spins on a tiny Python step (read the clock, note the gap since its last step); every gap
longer than a step is time it could not run Python: the GIL was held by another thread (a C call that
keeps it, e.g. a bytes join or a protobuf parse, or Python code until the switch interval,
sys.getswitchinterval(), forces a hand-over). The probe stands for the prefill worker's compute thread,
which launches thousands of kernels from Python per prefill and so needs the GIL all the time.
Scenarios (the bench_bridge state, --tokens of KV; --streams hand-offs each, back to back):
    idle      the probe alone (its step time and rate: the reference)
    send      this process encodes frames (encode.encode_state_frames, tensors pulled lazily as a running
              prefill gives them: the producer-thread path) and streams them over loopback gRPC to a
              receiver in a child process (`bench_bridge.py --serve`): the prefill worker's process
              with handoff_sender "thread"
    send_process   the same state and receiver, sent by a sender child process (baton/handoff/sender/process.py):
              this process only stages chunks into its shared ring (handoff_sender "process")
              (--sender picks which of the two send scenarios run: thread -> send, process -> send_process)
    receive   a child process sends; this process's gRPC server verifies and places the chunks
              (decode.decode_stream, 2 ahead, chunks verified in the pool): the decode worker's process
    both      sender and receiver in this process (bench_ttft --decode-worker in-process)
Per scenario, over stalls (gaps >= 0.1 ms): their count, p50 / p99 / max (ms), the share of wall time
spent stalled and the part of it the thread waited runnable for a CPU (os_wait_share, from Linux
schedstat; the rest of the stalled share is waiting for the GIL), how many exceeded 5 ms; the probe's step rate relative to idle, and the stream's GB/s.
On a machine with fewer cores than busy threads, part of every stall is the OS scheduler, not the GIL
(the idle scenario shows that floor).

    python benchmarks/gil_probe.py --tokens 4096 --streams 3 [--sender thread,process] [--device cuda] [--out R.json]
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from baton.handoff import (
    decode,
    encode,  # noqa: E402
    wire,  # noqa: E402
)
from baton.handoff.sender.process import SenderProcess  # noqa: E402
from baton.settings import Settings  # noqa: E402
from baton.v1 import common_pb2  # noqa: E402
from benchmarks import bench_bridge  # noqa: E402
from benchmarks.report import emit  # noqa: E402

SCENARIOS = ("idle", "send", "receive", "both")
SENDERS = {"thread": "send", "process": "send_process"}  # --sender -> the send scenario it runs
STALL_S = 100e-6


class Probe:
    """The spinning thread; stop() -> its gaps (seconds between consecutive steps) and its wall time."""

    def __init__(self):
        self._stop = threading.Event()
        self.gaps: list[float] = []
        self._t = threading.Thread(target=self._run, name="gil-probe", daemon=True)
        self._t.start()

    def _run(self) -> None:
        gaps, clock, stop = self.gaps, time.perf_counter, self._stop
        q0 = runqueue_wait()
        self.t0 = last = clock()
        while not stop.is_set():
            now = clock()
            gaps.append(now - last)
            last = now
        self.wall = last - self.t0
        q1 = runqueue_wait()
        self.os_wait = None if q0 is None or q1 is None else q1 - q0

    def stop(self) -> "Probe":
        self._stop.set()
        self._t.join()
        return self


def runqueue_wait() -> float | None:
    """Seconds this thread has waited runnable for a CPU (Linux schedstat); None where unknown."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def summary(p: Probe, idle_rate: float | None) -> dict:
    """Stalls: gaps >= STALL_S (a step takes well under a microsecond when the probe holds the GIL)."""
    g = p.gaps
    stalls = sorted(x for x in g if x >= STALL_S)
    q = (statistics.quantiles(stalls, n=100, method="inclusive") if len(stalls) > 1 else stalls * 99) or [0.0] * 99
    return {
        "steps": len(g),
        "wall_s": round(p.wall, 4),
        "stalls": len(stalls),
        "stall_p50_ms": round(q[49] * 1e3, 3),
        "stall_p99_ms": round(q[98] * 1e3, 3),
        "max_ms": round(max(g, default=0.0) * 1e3, 3),
        "stalled_share": round(sum(stalls) / p.wall, 4),
        # of which waiting for a CPU (the OS), not for the GIL: the rest is the GIL
        "os_wait_share": None if p.os_wait is None else round(p.os_wait / p.wall, 4),
        "gaps_over_5ms": sum(1 for x in stalls if x > 5e-3),
        "rate_vs_idle": round(len(g) / p.wall / idle_rate, 4) if idle_rate else 1.0,
    }


def lazy_frames(tensors, chunk: int, workers: int | None, tokens: int):
    """The prefill worker's path: table up front, tensors pulled as they become final (producer thread)."""
    return encode.encode_state_frames(
        session_id="probe",
        fingerprint=bench_bridge.FINGERPRINT,
        position=tokens,
        next_token=1,
        specs=[wire.TensorDesc.of(t) for t in tensors],
        tensor_source=(t.tensor for t in tensors),
        chunk_bytes=chunk,
        workers=workers,
    )


def lazy_plan(tensors, chunk: int, workers: int | None, tokens: int) -> encode.Plan:
    """lazy_frames' stream as a plan for the sender process."""
    return encode.plan(
        session_id="probe",
        fingerprint=bench_bridge.FINGERPRINT,
        position=tokens,
        next_token=1,
        specs=[wire.TensorDesc.of(t) for t in tensors],
        tensor_source=(t.tensor for t in tensors),
        chunk_bytes=chunk,
        workers=workers,
    )


def process_sender(address: str, tensors, chunk: int, workers: int | None, tokens: int):
    """-> (SenderProcess, load()): one hand-off of the state to ADDR's LoadFrames by the sender process."""
    sp = SenderProcess(slot_bytes=chunk, workers=workers)

    def load():
        rep, _ = sp.start_push(
            address,
            Settings(),
            lazy_plan(tensors, chunk, workers, tokens),
            method="/bench.Bridge/LoadFrames",
            deserialize=common_pb2.BridgeReport.FromString,
            timeout=600,
            position=tokens,
        ).result()
        assert rep.total_bytes == sum(t.tensor.numel() * t.tensor.element_size() for t in tensors), rep

    return sp, load


def sender(address: str):
    ch = grpc.insecure_channel(address, options=bench_bridge.OPTIONS)
    return ch, ch.stream_unary(
        "/bench.Bridge/LoadFrames", request_serializer=None, response_deserializer=common_pb2.BridgeReport.FromString
    )


def child_send(a) -> None:
    """--child-send ADDR: waits for a line on stdin, then sends --streams hand-offs to ADDR."""
    tensors = bench_bridge.make_state(a.tokens, a.device)
    ch, load = sender(a.child_send)
    load(lazy_frames(tensors, int(a.chunk_mib * (1 << 20)), a.workers, a.tokens))  # warm-up, before the probe
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(a.streams):
        load(lazy_frames(tensors, int(a.chunk_mib * (1 << 20)), a.workers, a.tokens))
    ch.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk-mib", type=float, default=wire.DEFAULT_CHUNK_BYTES / (1 << 20))
    ap.add_argument("--streams", type=int, default=3, help="hand-offs per scenario")
    ap.add_argument("--idle-s", type=float, default=1.0, help="seconds of the idle scenario")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--scenarios", type=lambda v: v.split(","), default=list(SCENARIOS))
    ap.add_argument(
        "--sender",
        type=lambda v: v.split(","),
        default=["thread", "process"],
        help="comma-separated: who sends in the send scenario: thread (send) | process (send_process)",
    )
    ap.add_argument("--child-send", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.child_send:
        return child_send(a)
    if set(a.scenarios) - set(SCENARIOS):
        raise SystemExit(f"--scenarios: choose from {', '.join(SCENARIOS)}")
    if not a.sender or set(a.sender) - set(SENDERS):
        raise SystemExit(f"--sender: a comma-separated subset of {', '.join(SENDERS)}")
    chunk = int(a.chunk_mib * (1 << 20))
    tensors = bench_bridge.make_state(a.tokens, a.device)
    total = sum(t.tensor.numel() * t.tensor.element_size() for t in tensors)
    layout = decode.ExpectedLayout.from_tensors(tensors, max_position=a.tokens)
    dev_bufs = {t.name: torch.empty_like(t.tensor) for t in tensors} if a.device != "cpu" else None
    imp = bench_bridge.Importer(layout, total, dev_bufs, workers=a.workers)
    server, port = bench_bridge.serve(imp, imp)
    local = f"127.0.0.1:{port}"
    out: dict[str, dict] = {}
    idle_rate = None

    def run(name: str, work) -> None:
        nonlocal idle_rate
        p = Probe()
        t0 = time.perf_counter()
        work()
        dt = time.perf_counter() - t0
        s = summary(p.stop(), idle_rate)
        if name == "idle":
            idle_rate = s["steps"] / s["wall_s"]
        else:
            s["stream_GBps"] = round(a.streams * total / dt / 1e9, 3)
        out[name] = s
        print(name, s, file=sys.stderr, flush=True)

    def send_to(address: str):
        ch, load = sender(address)
        load(lazy_frames(tensors, chunk, a.workers, a.tokens))  # warm-up
        return ch, lambda: [load(lazy_frames(tensors, chunk, a.workers, a.tokens)) for _ in range(a.streams)]

    try:
        run("idle", lambda: time.sleep(a.idle_s))
        if "send" in a.scenarios:
            rx = bench_bridge.ReceiverProcess(a.tokens, a.chunk_mib, a.device, a.workers)
            try:
                for who in a.sender:
                    if who == "thread":
                        ch, work = send_to(rx.address)
                        run("send", work)
                        ch.close()
                        continue
                    sp, load = process_sender(rx.address, tensors, chunk, a.workers, a.tokens)
                    try:
                        load()  # warm-up (the child starts)
                        run("send_process", lambda: [load() for _ in range(a.streams)])
                    finally:
                        sp.close()
            finally:
                rx.close()
        if "receive" in a.scenarios:
            argv_child = [
                sys.executable,
                "-u",
                str(Path(__file__).resolve()),
                "--child-send",
                local,
                "--tokens",
                str(a.tokens),
                "--chunk-mib",
                str(a.chunk_mib),
                "--streams",
                str(a.streams),
                "--device",
                a.device,
            ] + (["--workers", str(a.workers)] if a.workers is not None else [])
            child = subprocess.Popen(argv_child, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                if child.stdout.readline().strip() != "ready":
                    raise RuntimeError("gil_probe --child-send did not start")

                def go():
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    if child.wait() != 0:
                        raise RuntimeError(f"gil_probe --child-send exited {child.returncode}")

                run("receive", go)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        if "both" in a.scenarios:
            ch, work = send_to(local)
            run("both", work)
            ch.close()
    finally:
        server.stop(None)
    result = {
        "benchmark": "gil_probe",
        "command": shlex.join(["python", "benchmarks/gil_probe.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": bench_bridge.machine(),
        "device": a.device,
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "state": {"tokens": a.tokens, "total_bytes": total, "chunk_bytes": chunk, "streams": a.streams},
        "senders": a.sender,
        "results": out,
    }
    emit(result, a.out)
    return result


if __name__ == "__main__":
    main()
