"""The decode worker's host under many streams, without a GPU: how many steps a second it keeps up when the
device would allow 1 / --device-ms.

The real serving path of a token, all but the model: a DecodeEngine (the embedded model's runner, N loaded
sessions), its StepScheduler, DecodeServicer.Decode (the message, the message budget of
decode_worker/pacing.py), a gRPC server on loopback, and N Decode streams read by a client in a child
process (its own GIL). Only the step's compute is replaced: `ar_batch_launch` returns at once and its
collect sleeps until the "device" is done (steps back to back, --device-ms each; the sleep gives up the GIL
as a CUDA event wait does). So the step thread competes for this process's GIL with N gRPC threads, as on
the H200, where at 64 streams it spent 57% of its time in launch (benchmarks/results/gpu-h200-2026-12-03-phases.md).

    python benchmarks/bench_decode_host.py [--streams 8,32,64] [--device-ms 8] [--tokens 300] [--pace 2000,0]

Prints JSON: per (pace, streams) point: steps_per_s against device_steps_per_s (1 / device-ms), tok_s,
messages, tokens_per_message, the step thread's phase shares (decode_phase_share_*: idle, held, gather,
lock, launch, collect, deliver, other), server_cpu_s, thread_cpu (the server process's CPU seconds per wall
second by thread group, baton/thread_cpu.py: the step thread, the gRPC handlers of the Decode streams).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from baton import thread_cpu  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from baton.loading import load_model  # noqa: E402
from baton.rpc import build_server  # noqa: E402
from baton.settings import Settings  # noqa: E402
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc  # noqa: E402
from benchmarks.report import emit, machine  # noqa: E402
from decode_worker.engine import DecodeEngine  # noqa: E402
from decode_worker.service import SERVICE, DecodeServicer, add_to_server  # noqa: E402
from prefill_worker.engine import ExactEngine  # noqa: E402

DEFAULT_MODEL = ROOT / "baton" / "assets" / "default-model"
PROMPT = [11, 22, 33, 44, 55]


class FakeDevice:
    """A runner's ar_batch_launch whose steps take `seconds` each on a serial "device", back to back. Its
    launch makes LAUNCH_CALLS small torch calls, as BatchedAR.launch does (the slots' copy, two event
    records, the replay, the tokens' copy): each gives up the GIL and takes it back."""

    LAUNCH_CALLS = 5

    def __init__(self, seconds: float):
        self.seconds, self.free_at = seconds, 0.0
        self.src, self.dst = torch.zeros(128, dtype=torch.long), torch.zeros(128, dtype=torch.long)

    def launch(self, slots: list[int]):
        for _ in range(self.LAUNCH_CALLS):
            self.dst.copy_(self.src)
        done = self.free_at = max(time.monotonic(), self.free_at) + self.seconds
        toks = [7] * len(slots)

        def collect():
            left = done - time.monotonic()
            if left > 0:
                time.sleep(left)
            return toks

        return collect


def _client(port: int, sids: list[str], tokens: int) -> None:
    """The child: one thread a session, each reading one Decode stream; prints "ready" once connected,
    starts on a line from stdin, then prints the messages and tokens it got."""
    counts = []
    go = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        stub = decode_pb2_grpc.DecodeWorkerStub(ch)

        def read(sid):
            req = decode_pb2.DecodeRequest(session_id=sid, max_new_tokens=tokens, ignore_eos=True, release_at_end=True)
            go.wait()
            msgs = [len(m.token_ids) for m in stub.Decode(req, timeout=600)]
            counts.append((len(msgs), sum(msgs)))

        th = [threading.Thread(target=read, args=(s,)) for s in sids]
        for t in th:
            t.start()
        print("ready", flush=True)
        sys.stdin.readline()
        go.set()
        for t in th:
            t.join()
    print(json.dumps({"messages": sum(m for m, _ in counts), "tokens": sum(t for _, t in counts)}), flush=True)


def point(engine: DecodeEngine, state, pace: int, streams: int, tokens: int, device_s: float) -> dict:
    host, pos, nxt = state
    sids = [
        engine.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt).id for _ in range(streams)
    ]
    svc = DecodeServicer(engine, fingerprint="bench", settings=Settings(stream_messages_per_s=pace))
    h = build_server(
        [(add_to_server, svc)], service_names=[SERVICE], port=0, settings=Settings(), max_workers=streams + 8
    )
    argv = [sys.executable, __file__, "--client", str(h.port), "--tokens", str(tokens), "--sids", ",".join(sids)]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("bench_decode_host --client did not start")
        before = common_pb2.WorkerStats()
        engine.fill_step_stats(before, reset=True)
        t0, c0, th0 = time.monotonic(), time.process_time(), thread_cpu.read()
        child.stdin.write("go\n")
        child.stdin.flush()
        got = json.loads(child.stdout.readline())
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
        threads = thread_cpu.share(th0, thread_cpu.read(), wall)
        st = common_pb2.WorkerStats()
        engine.fill_step_stats(st)
        if child.wait(60) != 0:
            raise RuntimeError(f"bench_decode_host --client exited {child.returncode}")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        h.stop(0)
        super(DecodeServicer, svc).close()  # its reaper; DecodeServicer.close would stop the shared engine
    shares = {p: s / st.step_phase_window_s for p, s in st.step_phase_s.items()} if st.step_phase_window_s else {}
    out = {
        "pace_messages_per_s": pace,
        "streams": streams,
        "tokens": got["tokens"],
        "messages": got["messages"],
        "tokens_per_message": round(got["tokens"] / got["messages"], 3),
        "wall_s": round(wall, 3),
        "tok_s": round(got["tokens"] / wall, 1),
        "steps": st.steps - before.steps,
        "mean_rows": round((st.step_rows - before.step_rows) / (st.steps - before.steps), 2),
        "steps_per_s": round((st.steps - before.steps) / wall, 1),
        "device_steps_per_s": round(1 / device_s, 1),
        "server_cpu_s": round(cpu, 3),
        "thread_cpu": threads,
    }
    out |= {f"decode_phase_share_{p}": round(v, 4) for p, v in sorted(shares.items())}
    if shares:
        out["decode_phase_share_other"] = round(max(0.0, 1 - sum(shares.values())), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="8,32,64")
    ap.add_argument("--device-ms", type=float, default=8.0, help="one step's device time")
    ap.add_argument("--tokens", type=int, default=300, help="tokens a stream")
    ap.add_argument("--pace", default="2000,0", help="BATON_STREAM_MESSAGES_PER_S values (0: off)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--out", default=None)
    ap.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)  # the child's side
    ap.add_argument("--sids", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.client is not None:
        _client(a.client, a.sids.split(","), a.tokens)
        return 0
    torch.set_num_threads(1)
    streams = [int(x) for x in a.streams.split(",")]
    lm = load_model(a.model, dtype="fp32", mtp=False)
    max_len = len(PROMPT) + a.tokens + 16
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=max_len))
    s, _ = exact.prefill(PROMPT)
    tensors, pos, nxt = exact.export(s.id)
    state = ({t.name: t.tensor.clone() for t in tensors}, pos, nxt)
    exact.release(s.id)
    runner = ModelRunner(lm.model, slots=max(streams) + 1, max_len=max_len)
    runner.ar_batch_launch = FakeDevice(a.device_ms / 1e3).launch
    engine = DecodeEngine({"bf16": runner}, default_engine="bf16")
    try:
        points = [
            point(engine, state, int(p), n, a.tokens, a.device_ms / 1e3) for p in a.pace.split(",") for n in streams
        ]
    finally:
        engine.close()
    res = {
        "benchmark": "bench_decode_host",
        "command": " ".join(
            ["python", "benchmarks/bench_decode_host.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "device_ms": a.device_ms,
        "points": points,
    }
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
