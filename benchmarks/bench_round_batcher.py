"""What a round of exact-mode calls costs the processes' CPU: one unary Draft call a session against one
DraftMany RPC for the round (router/batcher.py), over loopback gRPC in this process.

A DecodeWorker server whose Draft / DraftMany answer at once (K drafts a session, no model), and S client
threads, each one session: per round every session calls Draft (unary), or submits to a RoundBatcher that
sends the round as one DraftMany. Both sides live in this process, so process_time over the rounds is the
client's and the server's CPU together: what the router and a worker pay a session a round under their
GILs, before any model work.

    python benchmarks/bench_round_batcher.py [--sessions 1,8,32] [--rounds 100] [--out R.json]

Prints JSON: per (mode, sessions): rounds, wall_ms_per_round, cpu_us_per_session_round.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import types
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from baton.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402
from benchmarks.report import emit, header  # noqa: E402
from router import batcher  # noqa: E402

K = 8


class _Drafts(decode_pb2_grpc.DecodeWorkerServicer):
    def Draft(self, request, context):
        return decode_pb2.DraftResponse(draft_tokens=[1] * request.k, position=7)

    def DraftMany(self, request, context):
        return decode_pb2.DraftManyResponse(
            outcomes=[decode_pb2.DraftOutcome(response=self.Draft(r, context)) for r in request.requests]
        )


def _point(stub, mode: str, sessions: int, rounds: int) -> dict:
    w = types.SimpleNamespace(stub=stub, batchers={})
    b = batcher.RoundBatcher(w, "Draft")
    go = threading.Barrier(sessions)

    def session(i):
        sid = f"s{i}"
        for _ in range(rounds):
            go.wait()  # lockstep rounds, as exact sessions merged by the workers' round barrier
            req = decode_pb2.DraftRequest(session_id=sid, k=K, has_verdict=True, accepted=6, next_token=3)
            if mode == "unary":
                stub.Draft(req, timeout=10)
            else:
                b.submit(sid, req, 10.0).result()

    th = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    c0, t0 = time.process_time(), time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(
        mode=mode,
        sessions=sessions,
        rounds=rounds,
        wall_ms_per_round=round(wall / rounds * 1e3, 3),
        cpu_us_per_session_round=round(cpu / (rounds * sessions) * 1e6, 1),
        rpcs_per_round=round(b.batches / rounds, 2) if mode == "batched" else sessions,
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(_Drafts(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    points = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = decode_pb2_grpc.DecodeWorkerStub(ch)
            for n in (int(x) for x in args.sessions.split(",")):
                for mode in ("unary", "batched"):
                    _point(stub, mode, n, max(5, args.rounds // 10))  # warm-up
                    points.append(_point(stub, mode, n, args.rounds))
    finally:
        server.stop(0)
    result = dict(header(__file__, argv), k=K, points=points)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
