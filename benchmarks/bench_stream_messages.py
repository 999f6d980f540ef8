"""What one Decode stream message costs the serving process: CPU time per DecodeResponse sent.

A DecodeWorker server in this process whose Decode yields --messages messages of T token ids each, as fast
as grpc takes them, on S concurrent streams read by a client in a child process (its own GIL). The
server's CPU time per message (process_time over the run, divided by the messages) is, nearly all of it,
time under this process's GIL: the budget decode_worker/pacing.py shares out (a decode worker's step
thread needs the same GIL for every step's launch). Also the messages/s one process reaches.

--servers sync,aio also runs each point against a grpc.aio server (one event loop thread, the Decode
handler an async generator) in the same process: what the same messages cost a server without a thread a
stream (the decode worker's is grpc's sync server, one handler thread a Decode stream).

    python benchmarks/bench_stream_messages.py [--streams 8,32,64] [--tokens 1,4] [--messages 500]
                                               [--servers sync[,aio]] [--out R.json]

Prints JSON: per (server, streams, tokens a message) point: messages (as the client counted them), wall_s, server_cpu_s,
cpu_us_per_message, messages_per_s, tokens_per_s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from baton.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402
from benchmarks.report import emit, machine  # noqa: E402


def _client(port: int, streams: int) -> None:
    """The child: `streams` threads, each reading one Decode stream to its end; prints the messages read."""
    got = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = decode_pb2_grpc.DecodeWorkerStub(ch)

        def read():
            got.append(sum(1 for _ in stub.Decode(decode_pb2.DecodeRequest(session_id="s"), timeout=600)))

        th = [threading.Thread(target=read) for _ in range(streams)]
        for t in th:
            t.start()
        for t in th:
            t.join()
    print(sum(got))


class _Streams(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, messages: int, tokens: int):
        self.messages, self.ids = messages, list(range(tokens))

    def Decode(self, request, context):
        for _ in range(self.messages):
            yield decode_pb2.DecodeResponse(token_ids=self.ids)


class _AioStreams(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, messages: int, tokens: int):
        self.messages, self.ids = messages, list(range(tokens))

    async def Decode(self, request, context):
        for _ in range(self.messages):
            yield decode_pb2.DecodeResponse(token_ids=self.ids)


class _AioServer:
    """A grpc.aio server on its own event loop thread: start() -> port; stop()."""

    def __init__(self, servicer):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.servicer = servicer

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def start(self) -> int:
        self.thread.start()

        async def up():
            self.server = grpc.aio.server()
            decode_pb2_grpc.add_DecodeWorkerServicer_to_server(self.servicer, self.server)
            port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            return port

        return self._run(up())

    def stop(self) -> None:
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def point(streams: int, tokens: int, messages: int, server_kind: str = "sync") -> dict:
    if server_kind == "aio":
        aio = _AioServer(_AioStreams(messages, tokens))
        port, stop = aio.start(), aio.stop
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=streams + 4))
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(_Streams(messages, tokens), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stop = lambda: server.stop(0)  # noqa: E731
    try:
        t0, c0 = time.monotonic(), time.process_time()
        child = [sys.executable, __file__, "--client", str(port), "--streams", str(streams)]
        n = int(subprocess.run(child, check=True, capture_output=True, text=True).stdout.split()[-1])
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
    finally:
        stop()
    if n != streams * messages:
        raise RuntimeError(f"the client read {n} messages of {streams * messages} sent")
    return {
        "server": server_kind,
        "streams": streams,
        "tokens_per_message": tokens,
        "messages": n,
        "wall_s": round(wall, 3),
        "server_cpu_s": round(cpu, 3),
        "cpu_us_per_message": round(1e6 * cpu / n, 1),
        "messages_per_s": round(n / wall),
        "tokens_per_s": round(n * tokens / wall),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="8,32,64")
    ap.add_argument("--tokens", default="1,4", help="token ids a message")
    ap.add_argument("--messages", type=int, default=500, help="messages a stream")
    ap.add_argument("--servers", default="sync", help="sync (grpc's thread-per-stream server), aio, or both")
    ap.add_argument("--out", default=None)
    ap.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)  # the child's side
    a = ap.parse_args(argv)
    if a.client is not None:
        _client(a.client, int(a.streams))
        return 0
    res = {
        "benchmark": "bench_stream_messages",
        "command": " ".join(["python", "benchmarks/bench_stream_messages.py", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "points": [
            point(s, t, a.messages, kind)
            for kind in a.servers.split(",")
            for s in map(int, a.streams.split(","))
            for t in map(int, a.tokens.split(","))
        ],
    }
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
