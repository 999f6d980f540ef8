"""State-bridge throughput: encode, decode, and end-to-end over a real loopback gRPC connection.

State: the Qwen3.5-9B shape (random values), 32 layers = 24 GDN + 8 full attention:
    GDN  layers.{i}.conv       [8192, 3]          bf16    (48 KiB)
         layers.{i}.recurrent  [32, 128, 128]     fp32    (2 MiB)
    attn layers.{i}.key/value  [4, L, 256]        bf16    (2 KiB per token each)
    hidden                     [4096]             bf16
Paths measured (GB/s = raw tensor bytes / wall seconds; best and median of --repeats). Chunks are hashed
and verified by the wire's thread pool with --workers chunks in flight per stream (format 4; --tail-chunk-mib:
its tail segment, the last --tail-layers layers' bytes and hidden in chunks of that size, as the prefill worker's
handoff_tail_chunk_bytes setting cuts them; 0, the default: none):
    encode_proto / encode_frames   encode_state -> StateChunk objects / encode_state_frames -> bytes
    decode_proto / decode_frames   StateReceiver over pre-encoded StateChunks / serialized frames,
                                   into fresh buffers (decode_frames_reused_buffers: a reused pool)
    e2e_proto / e2e_frames         pipelined(encode) -> loopback gRPC -> server decode_stream (pulls
                                   messages 2 ahead) -> BridgeReport back
    e2e_frames_not_pipelined       the same with no pull-ahead helper thread on either side
    e2e_frames_inline_hashing      e2e_frames with workers=0: every chunk hashed on the sending and the
                                   receiving thread (what one serial digest per side costs)
    ceiling_grpc_raw_frames        the same frames, pre-built; the server only counts bytes
    e2e_frames_receiver_in_process e2e_frames with the server in this process (--receiver process only)
    e2e_frames_sender_process      e2e_frames sent by a hand-off sender child process (baton/handoff/sender/process.py,
                                   handoff_sender "process"): this process stages chunks into its shared ring,
                                   the child frames, hashes and streams them (--sender picks which of e2e_frames
                                   [thread] and this path run when --paths is not given; both by default)
--receiver process (the default, the deployed topology): the gRPC server of the e2e and raw-frame paths
runs in a child process (`bench_bridge.py --serve`, same --tokens/--chunk-mib/--workers/--device), so
sender and receiver do not share one GIL; in-process: the server runs in this process.
    ceiling_sha256_one_core        hashlib.sha256 on one core (each side hashes every byte once)
    ceiling_sha256_pool            SHA-256 of 4 MiB chunks through the wire's pool (all its threads)
--device cuda: source tensors live on the GPU (device->host inside encode: staged per chunk into reused
pinned buffers on a copy stream) and the server copies each verified tensor into preallocated device
buffers as soon as its chunks verified, on a side stream, synchronized before answering (host->device
included, overlapped with receiving).

    python benchmarks/bench_bridge.py --out benchmarks/results/bridge-cpu-DATE.json
    python benchmarks/bench_bridge.py --device cuda --out $OUT/bridge-cuda-DATE.json   # on the GPU host
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from baton.handoff import (
    decode,
    encode,  # noqa: E402
    wire,  # noqa: E402
)
from baton.handoff.progress import tail_offset  # noqa: E402
from baton.handoff.sender.process import SenderProcess  # noqa: E402
from baton.settings import Settings  # noqa: E402
from baton.v1 import common_pb2, state_pb2  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from benchmarks.report import machine as base_machine

MSG_LIMIT = 64 << 20
OPTIONS = [("grpc.max_receive_message_length", MSG_LIMIT), ("grpc.max_send_message_length", MSG_LIMIT)]
FINGERPRINT = "sha256:bench"


def make_state(L: int, device: str) -> list[wire.WireTensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(32):
        if i % 4 == 3:
            for kind, n in ((state_pb2.ATTN_KEY, "key"), (state_pb2.ATTN_VALUE, "value")):
                out.append(wire.WireTensor(f"layers.{i}.{n}", kind, torch.randn(4, L, 256, generator=g).bfloat16()))
        else:
            out.append(
                wire.WireTensor(f"layers.{i}.conv", state_pb2.GDN_CONV, torch.randn(8192, 3, generator=g).bfloat16())
            )
            out.append(
                wire.WireTensor(
                    f"layers.{i}.recurrent", state_pb2.GDN_RECURRENT, torch.randn(32, 128, 128, generator=g)
                )
            )
    out.append(wire.WireTensor("hidden", state_pb2.HIDDEN, torch.randn(4096, generator=g).bfloat16()))
    return [wire.WireTensor(t.name, t.kind, t.tensor.to(device)) for t in out]


class Importer:
    """Receive side: StateReceiver into fresh CPU buffers (pinned when a device is involved, or a
    reused pool with reuse=True), then, with device buffers, H2D into those static buffers."""

    def __init__(self, layout, max_total, device_buffers=None, reuse=False, workers=None):
        self.layout, self.max_total, self.device_buffers = layout, max_total, device_buffers
        self.workers = workers
        pin = device_buffers is not None
        self.pool: dict[tuple, list] = {}
        self.reuse = reuse
        self._handed: dict[tuple, int] = {}

        def alloc(shape, dtype):
            if not self.reuse:
                return torch.empty(shape, dtype=dtype, pin_memory=pin)
            key = (shape, dtype)  # hand out the pool's buffers in order, growing it on first use
            i = self._handed.get(key, 0)
            self._handed[key] = i + 1
            bufs = self.pool.setdefault(key, [])
            if i == len(bufs):
                bufs.append(torch.empty(shape, dtype=dtype, pin_memory=pin))
            return bufs[i]

        self.alloc = alloc

    def __call__(self, chunks, ahead=0):
        self._handed.clear()
        on_tensor, stream = None, None
        if self.device_buffers is not None:  # H2D of each tensor as soon as it verified, as LoadState does
            stream = torch.cuda.Stream()

            def on_tensor(name, t):
                with torch.cuda.stream(stream):
                    self.device_buffers[name].copy_(t, non_blocking=True)

        st = decode.decode_stream(
            chunks,
            self.layout,
            FINGERPRINT,
            self.max_total,
            alloc=self.alloc,
            ahead=ahead,
            workers=self.workers,
            on_tensor=on_tensor,
        )
        if stream is not None:
            stream.synchronize()
        return st

    def load(self, request_iterator, context):  # the default: messages pulled 2 ahead
        return self(request_iterator, ahead=2).stats.to_proto()

    def load_inline(self, request_iterator, context):
        return self(request_iterator, ahead=0).stats.to_proto()

    @staticmethod
    def count(request_iterator, context):
        return common_pb2.BridgeReport(total_bytes=sum(len(m) for m in request_iterator))


def serve(imp: Importer, inline: Importer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    report = common_pb2.BridgeReport.SerializeToString
    handlers = {
        "LoadProto": grpc.stream_unary_rpc_method_handler(
            imp.load, request_deserializer=state_pb2.StateChunk.FromString, response_serializer=report
        ),
        "LoadFrames": grpc.stream_unary_rpc_method_handler(imp.load, response_serializer=report),
        "LoadFramesInline": grpc.stream_unary_rpc_method_handler(imp.load_inline, response_serializer=report),
        "LoadFramesInlineHashing": grpc.stream_unary_rpc_method_handler(inline.load, response_serializer=report),
        "Count": grpc.stream_unary_rpc_method_handler(imp.count, response_serializer=report),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bridge", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def serve_forever(a) -> None:
    """--serve: the receiving server alone; prints "bridge: serving on ADDR", stops at EOF on stdin."""
    tensors = make_state(a.tokens, a.device)
    total = sum(t.tensor.numel() * t.tensor.element_size() for t in tensors)
    layout = decode.ExpectedLayout.from_tensors(tensors, max_position=a.tokens)
    dev_bufs = {t.name: torch.empty_like(t.tensor) for t in tensors} if a.device != "cpu" else None
    workers = wire.default_workers() if a.workers is None else a.workers
    server, port = serve(
        Importer(layout, total, dev_bufs, workers=workers), Importer(layout, total, dev_bufs, workers=0)
    )
    print(f"bridge: serving on 127.0.0.1:{port}", flush=True)
    sys.stdin.read()
    server.stop(None)


class ReceiverProcess:
    """`bench_bridge.py --serve` as a child process: .address; close() ends it (EOF on its stdin)."""

    def __init__(self, tokens: int, chunk_mib: float, device: str, workers: int | None):
        argv = [
            sys.executable,
            "-u",
            str(Path(__file__).resolve()),
            "--serve",
            "--tokens",
            str(tokens),
            "--chunk-mib",
            str(chunk_mib),
            "--device",
            device,
        ]
        argv += ["--workers", str(workers)] if workers is not None else []
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("bridge: serving on "):
            self.close()
            raise RuntimeError(f"bench_bridge --serve did not start: {line!r}")
        self.address = line.rsplit(" ", 1)[1]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def timed(fn, repeats: int, nbytes: int) -> dict:
    fn()  # warm-up (allocator, connection, caches)
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t0)
    return {
        "best_GBps": round(nbytes / min(secs) / 1e9, 3),
        "median_GBps": round(nbytes / statistics.median(secs) / 1e9, 3),
        "seconds": [round(s, 4) for s in secs],
    }


def machine() -> dict:
    return base_machine(wire_pool_threads=max(1, wire.default_workers()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="context length L of the KV part")
    ap.add_argument("--chunk-mib", type=float, default=wire.DEFAULT_CHUNK_BYTES / (1 << 20))
    ap.add_argument(
        "--tail-chunk-mib",
        type=float,
        default=Settings().handoff_tail_chunk_bytes / (1 << 20),
        help="tail segment chunk size, MiB (<= --chunk-mib; 0: no tail segment; default: the "
        "handoff_tail_chunk_bytes setting's default)",
    )
    ap.add_argument(
        "--tail-layers",
        type=int,
        default=Settings().handoff_tail_layers,
        help="layers the tail segment covers, counted from the last",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="chunks hashed in parallel per stream (default: wire.default_workers())",
    )
    ap.add_argument(
        "--paths",
        type=lambda v: v.split(","),
        default=None,
        help="comma-separated subset of the paths to time (default: all)",
    )
    ap.add_argument(
        "--receiver",
        default="process",
        choices=["process", "in-process"],
        help="where the e2e paths' gRPC server runs (default: a child process, as deployed)",
    )
    ap.add_argument(
        "--sender",
        type=lambda v: v.split(","),
        default=["thread", "process"],
        help="comma-separated: thread (e2e_frames) | process (e2e_frames_sender_process)",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child of --receiver process
    ap.add_argument("--machine-note", default="", help="free text describing the machine")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.serve:
        return serve_forever(a)
    chunk = int(a.chunk_mib * (1 << 20))
    tensors = make_state(a.tokens, a.device)
    specs = [wire.TensorDesc.of(t) for t in tensors]
    total = sum(s.nbytes for s in specs)
    layout = decode.ExpectedLayout.from_tensors(tensors, max_position=a.tokens)
    workers = wire.default_workers() if a.workers is None else a.workers
    tail = round(a.tail_chunk_mib * (1 << 20))
    if not 0 <= tail <= chunk:
        raise SystemExit(f"--tail-chunk-mib: in 0..--chunk-mib ({a.chunk_mib:g}), got {a.tail_chunk_mib:g}")
    enc = dict(
        session_id="bench",
        fingerprint=FINGERPRINT,
        position=a.tokens,
        next_token=1,
        tensors=tensors,
        chunk_bytes=chunk,
        workers=workers,
        tail_chunk_bytes=tail,
        tail_from=tail_offset(specs, a.tail_layers) if tail else 0,
    )
    proto_msgs = list(encode.encode_state(**enc))
    frames = list(encode.encode_state_frames(**enc))
    assert frames[1] == proto_msgs[1].SerializeToString()  # hand framing == protobuf framing

    dev_bufs = None
    if a.device != "cpu":
        dev_bufs = {t.name: torch.empty_like(t.tensor) for t in tensors}
    imp = Importer(layout, total, dev_bufs, workers=workers)
    reuse = Importer(layout, total, dev_bufs, reuse=True, workers=workers)
    inline = Importer(layout, total, dev_bufs, workers=0)
    server, port = serve(imp, inline)
    rx = ReceiverProcess(a.tokens, a.chunk_mib, a.device, a.workers) if a.receiver == "process" else None
    local = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
    channel = grpc.insecure_channel(rx.address, options=OPTIONS) if rx else local
    rep = common_pb2.BridgeReport.FromString
    load_proto = channel.stream_unary(
        "/bench.Bridge/LoadProto", response_deserializer=rep, request_serializer=state_pb2.StateChunk.SerializeToString
    )
    load_frames = channel.stream_unary("/bench.Bridge/LoadFrames", response_deserializer=rep)
    load_frames_local = local.stream_unary("/bench.Bridge/LoadFrames", response_deserializer=rep)
    load_frames_inline = channel.stream_unary("/bench.Bridge/LoadFramesInline", response_deserializer=rep)
    load_frames_inline_hashing = channel.stream_unary(
        "/bench.Bridge/LoadFramesInlineHashing", response_deserializer=rep
    )
    count = channel.stream_unary("/bench.Bridge/Count", response_deserializer=rep)
    sp = SenderProcess(slot_bytes=chunk, workers=workers)
    target = rx.address if rx else f"127.0.0.1:{port}"

    def sender_process():
        p = encode.plan(**enc)
        return sp.start_push(
            target, Settings(), p, method="/bench.Bridge/LoadFrames", deserialize=rep, timeout=600, position=a.tokens
        ).result()[0]

    def check(report):
        assert report.total_bytes == total, report
        return report

    blob = os.urandom(64 << 20)
    blob_chunks = [(memoryview(blob)[i : i + (4 << 20)],) for i in range(0, len(blob), 4 << 20)]

    def sha256_pool():
        for _ in wire.ordered_map(lambda b: hashlib.sha256(b).digest(), blob_chunks, max(1, wire.default_workers())):
            pass

    loadavg_before = os.getloadavg()
    n = a.repeats
    paths = {
        "encode_proto": (lambda: sum(1 for _ in encode.encode_state(**enc)), total),
        "encode_frames": (lambda: sum(1 for _ in encode.encode_state_frames(**enc)), total),
        "decode_proto": (lambda: imp(proto_msgs), total),
        "decode_frames": (lambda: imp(frames), total),
        "decode_frames_reused_buffers": (lambda: reuse(frames), total),
        "e2e_proto": (lambda: check(load_proto(wire.pipelined(encode.encode_state(**enc)))), total),
        "e2e_frames": (lambda: check(load_frames(wire.pipelined(encode.encode_state_frames(**enc)))), total),
        "e2e_frames_not_pipelined": (lambda: check(load_frames_inline(encode.encode_state_frames(**enc))), total),
        "e2e_frames_inline_hashing": (
            lambda: check(
                load_frames_inline_hashing(wire.pipelined(encode.encode_state_frames(**(enc | {"workers": 0}))))
            ),
            total,
        ),
        "ceiling_grpc_raw_frames": (lambda: count(iter(frames)), sum(map(len, frames))),
        **(
            {
                "e2e_frames_receiver_in_process": (
                    lambda: check(load_frames_local(wire.pipelined(encode.encode_state_frames(**enc)))),
                    total,
                )
            }
            if rx
            else {}
        ),
        "e2e_frames_sender_process": (lambda: check(sender_process()), total),
        "ceiling_sha256_one_core": (lambda: hashlib.sha256(blob).digest(), len(blob)),
        "ceiling_sha256_pool": (sha256_pool, len(blob)),
    }
    unknown = set(a.paths or ()) - set(paths)
    if unknown:
        raise SystemExit(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(paths)}")
    if set(a.sender) - {"thread", "process"}:
        raise SystemExit("--sender: a comma-separated subset of thread, process")
    if not a.paths:  # --sender: which e2e sender paths run
        for who, path in (("thread", "e2e_frames"), ("process", "e2e_frames_sender_process")):
            if who not in a.sender:
                paths.pop(path)
    r = {k: timed(fn, n, nbytes) for k, (fn, nbytes) in paths.items() if not a.paths or k in a.paths}
    loadavg_after = os.getloadavg()
    # bitwise check of one end-to-end transfer (outside the timed loops)
    got = imp(iter(frames))
    src = {t.name: t.tensor for t in tensors}
    for name, t in got.tensors.items():
        assert torch.equal(t.view(torch.uint8), src[name].cpu().view(torch.uint8)), name
        if dev_bufs is not None:
            assert torch.equal(dev_bufs[name].view(torch.uint8), src[name].view(torch.uint8)), name
    report = check(load_frames(wire.pipelined(encode.encode_state_frames(**enc))))
    sp.close()
    channel.close()
    local.close()
    server.stop(None)
    if rx:
        rx.close()
    result = {
        "benchmark": "bridge",
        "command": shlex.join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine() | ({"note": a.machine_note} if a.machine_note else {}),
        "device": a.device,
        "format_version": wire.FORMAT_VERSION,
        "workers": workers,
        "receiver": a.receiver,
        "senders": a.sender,
        "loadavg_1_5_15": {
            "before": [round(x, 2) for x in loadavg_before],
            "after": [round(x, 2) for x in loadavg_after],
        },
        "state": {
            "tokens": a.tokens,
            "total_bytes": total,
            "bytes_by_kind": dict(report.bytes_by_kind),
            "tensors": len(specs),
            "data_chunks": report.chunks,
            "chunk_bytes": chunk,
            "tail_from": proto_msgs[0].header.tail_from,
            "tail_chunk_bytes": proto_msgs[0].header.tail_chunk_bytes,
        },
        "results": r,
    }
    emit(result, a.out)
    return result


if __name__ == "__main__":
    main()
