"""A hand-off's timeline: when each step of one request's state hand-off happened, to explain the TTFT
tail (the time from the prefill's end to the decode worker holding the state; benchmarks/bench_ttft.py
prints it). Asked for per request (PrefillRequest.timeline; the prefill worker asks the decode worker with
LoadState metadata `baton-timeline: 1`), answered in the PrefillResponse's BridgeReport.timeline
(common.proto HandoffTimeline). No pickle: the sender child reports its marks in its DONE JSON.

Clock: time.monotonic_ns, which on Linux is clock_gettime(CLOCK_MONOTONIC): time since boot, one clock
for every process of a host (not per process; never stepped by NTP or settimeofday). So the prefill's
process, its sender child and a decode worker on the same host stamp marks that compare directly, and the
transit between processes (sender child -> receiver) is measured with no clock sync and no offsets to
estimate. Each process reports its clock's id (CLOCK_ID: the implementation and the kernel's boot_id):
marks of processes with equal ids compare; a decode worker on another host has another id, and then only
the intervals inside it mean anything (offsets_ms drops the marks of another clock).

Marks ("<process>.<mark>"), the order one hand-off passes them; `last chunk` = the last data chunk:
    prefill.rpc_start              the Prefill handler started (the stream starts right after, the compute next)
    prefill.last_layer_enqueued    the last decoder layer's kernels queued and its progress event recorded
                                   (CUDA: host time; the device runs later)
    prefill.compute_end            the prefill has the first token (logits on the host; the MTP layer's
                                   kernels queued behind them) and marks the last stage final
                                   (PrefillProgress.finish): the tail's reference (bench_ttft's tail_ms)
    prefill.last_chunk_ready       process sender: the stager pulled the last chunk's tensors (stages marked)
    prefill.last_chunk_slot        ... it got a free ring slot for it (a wait here: the ring was full, i.e.
                                   the child or the receiver is behind)
    prefill.last_chunk_staged      ... its bytes are in the ring (CUDA: the D2H copy completed, which waited on
                                   the copy stream for the device to finish the last stage); CHUNK goes next
    prefill.end_posted             ... END (next_token) goes to the child: the stager is done
    sender.last_chunk_in           the sender child read the last chunk's CHUNK message
    sender.last_chunk_submitted    ... handed it to its framing pool (a wait before: gRPC's window was full)
    sender.last_chunk_framed       ... its frame was made and hashed
    sender.last_chunk_handed       the last chunk handed to gRPC (its request iterator yielded it)
    sender.last_chunk_sent         gRPC asked for the next message: the last chunk's send completed
    sender.end_in                  the sender child read END
    sender.trailer_handed          the trailer handed to gRPC
    sender.trailer_sent            its send completed (the stream half-closes next)
    decode.first_message           LoadState got the header
    decode.last_chunk_received     the last chunk came out of gRPC on the receiving side
    decode.last_chunk_fed          the receiver took it (index and size checked, its hash queued in the pool)
    decode.trailer_received        the trailer came out of gRPC
    decode.verified                the trailer checked: every chunk's SHA-256 verified and its bytes in
                                   host buffers, then the manifest
    decode.stream_closed           the sender half-closed the stream (receive_state returns after that)
    decode.last_tensor_placed      the last tensor's H2D into the reserved slot queued (each tensor goes as
                                   soon as its chunks verified)
    decode.received                receive_state returned the verified state
    decode.loaded                  the state is in its slot (commit done) and, on CUDA, its copies completed
                                   (LoadState waits for them only when the timeline was asked for)
    decode.reply                   LoadState about to answer
    sender.reply                   the answer reached the sender (the child's done callback; thread: = the next)
    prefill.reply_received         ... the prefill's process (process sender: the child's DONE read)
    prefill.rpc_reply              the Prefill handler about to answer (a FAST session released)
    client.reply                   (bench_ttft, not in the service) the Prefill answer back at the client
With the thread sender, prefill.last_chunk_* / end_posted and sender.last_chunk_in / submitted / framed /
end_in do not exist (the frames come out of the wire's pool straight into gRPC); the rest do.
Series (one reading per data chunk, chunk order): prefill.staged (process sender: as last_chunk_staged),
sender.handed (to gRPC), decode.received (out of gRPC on the receiving side): how many chunks were still
behind each stage when the prefill ended (bench_ttft's tail_backlog). CHAINS lists the orders causality
imposes on the marks; violations() checks a timeline against them (bench_ttft: tail_ordered).

Cost: not asked for, a few monotonic_ns calls per hand-off and nothing per chunk; asked for, a few per
chunk, and on CUDA the decode worker waits for the slot's copies before answering.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator, Mapping

from baton.v1 import common_pb2

MARKS = (
    "prefill.rpc_start",
    "prefill.last_layer_enqueued",
    "prefill.compute_end",
    "prefill.last_chunk_ready",
    "prefill.last_chunk_slot",
    "prefill.last_chunk_staged",
    "prefill.end_posted",
    "sender.last_chunk_in",
    "sender.last_chunk_submitted",
    "sender.last_chunk_framed",
    "sender.last_chunk_handed",
    "sender.last_chunk_sent",
    "sender.end_in",
    "sender.trailer_handed",
    "sender.trailer_sent",
    "decode.first_message",
    "decode.last_chunk_received",
    "decode.last_chunk_fed",
    "decode.trailer_received",
    "decode.verified",
    "decode.stream_closed",
    "decode.last_tensor_placed",
    "decode.received",
    "decode.loaded",
    "decode.reply",
    "sender.reply",
    "prefill.reply_received",
    "prefill.rpc_reply",
)
PROCESS_SENDER_ONLY = frozenset(
    {
        "prefill.last_chunk_ready",
        "prefill.last_chunk_slot",
        "prefill.last_chunk_staged",
        "prefill.end_posted",
        "sender.last_chunk_in",
        "sender.last_chunk_submitted",
        "sender.last_chunk_framed",
        "sender.end_in",
    }
)
# Chains of marks that causality orders: each happens before the next (a message sent before it is read, a
# stamp taken before its message goes, a stage waited for), so on one clock they are non-decreasing along
# a chain; a mark the timeline lacks (the thread sender's) is skipped. client.reply: bench_ttft's.
CHAINS = (
    (
        "prefill.rpc_start",
        "prefill.last_layer_enqueued",
        "prefill.compute_end",
        "prefill.last_chunk_ready",
        "prefill.last_chunk_slot",
        "prefill.last_chunk_staged",
        "sender.last_chunk_in",
        "sender.last_chunk_submitted",
        "sender.last_chunk_framed",
        "sender.last_chunk_handed",
        "sender.last_chunk_sent",
        "sender.trailer_handed",
        "sender.trailer_sent",
        "decode.stream_closed",
        "decode.received",
        "decode.loaded",
        "decode.reply",
        "sender.reply",
        "prefill.reply_received",
        "prefill.rpc_reply",
        "client.reply",
    ),
    (
        "prefill.compute_end",
        "prefill.end_posted",
        "sender.end_in",
        "sender.trailer_handed",
        "decode.trailer_received",
        "decode.verified",
        "decode.received",
    ),
    (
        "prefill.rpc_start",
        "decode.first_message",
        "decode.last_chunk_received",
        "decode.last_chunk_fed",
        "decode.last_tensor_placed",
        "decode.received",
    ),
    ("sender.last_chunk_handed", "decode.last_chunk_received", "decode.trailer_received"),
    ("decode.last_chunk_fed", "decode.verified"),
)
SERIES_CHAIN = ("prefill.staged", "sender.handed", "decode.received")  # per chunk, in this order

METADATA_KEY = "baton-timeline"  # LoadState call metadata: "1" = report the receiver's marks
METADATA = ((METADATA_KEY, "1"),)
REFERENCE = "prefill.compute_end"
now = time.monotonic_ns


def _clock_id() -> str:
    impl = time.get_clock_info("monotonic").implementation
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # no boot id (not Linux): this process's clock compares with no other process's
        import os
        import socket

        boot = f"{socket.gethostname()}/pid {os.getpid()}"
    return f"{impl} boot_id={boot}"


CLOCK_ID = _clock_id()


def asked(context) -> bool:
    """Whether a LoadState call (its grpc.ServicerContext) asked for the receiver's timeline."""
    return any(k == METADATA_KEY and v == "1" for k, v in context.invocation_metadata() or ())


class Timeline:
    """One hand-off's marks, clocks and series, gathered from the processes it crosses."""

    def __init__(self, clocks: Mapping[str, str] | None = None):
        self.marks: dict[str, int] = {}
        self.clocks: dict[str, str] = dict(clocks or {})
        self.series: dict[str, list[int]] = {}

    def mark(self, name: str, t: int | None = None) -> None:
        self.marks[name] = now() if t is None else int(t)

    def update(
        self, marks: Mapping[str, int] = (), clocks: Mapping[str, str] = (), series: Mapping[str, Iterable[int]] = ()
    ) -> "Timeline":
        self.marks.update({k: int(v) for k, v in dict(marks).items()})
        self.clocks.update(dict(clocks))
        self.series.update({k: [int(x) for x in v] for k, v in dict(series).items()})
        return self

    def merge_proto(self, pb: common_pb2.HandoffTimeline) -> "Timeline":
        return self.update(pb.marks_ns, pb.clocks, {k: v.ns for k, v in pb.series_ns.items()})

    def to_json(self) -> dict:
        return {"marks": self.marks, "clocks": self.clocks, "series": self.series}

    def merge_json(self, d: Mapping) -> "Timeline":
        return self.update(d.get("marks", {}), d.get("clocks", {}), d.get("series", {}))

    def to_proto(self) -> common_pb2.HandoffTimeline:
        return common_pb2.HandoffTimeline(
            marks_ns=self.marks,
            clocks=self.clocks,
            series_ns={k: common_pb2.MarkSeries(ns=v) for k, v in self.series.items()},
        )


class Arrivals:
    """Wraps a receiving request iterator: each message's arrival time (the thread pulling it) and the end
    of the stream (the sender half-closed)."""

    def __init__(self, it: Iterable):
        self.it, self.ns, self.closed = iter(it), [], 0

    def __iter__(self) -> Iterator:
        for m in self.it:
            self.ns.append(now())
            yield m
        self.closed = now()


def _process(name: str) -> str:
    return name.split(".", 1)[0]


def offsets_ms(pb: common_pb2.HandoffTimeline, ref: str = REFERENCE) -> dict[str, float]:
    """mark -> ms after the reference mark (negative: before), for the marks read on the reference's clock
    (a process without a clocks entry is taken to share it: the caller put its marks there)."""
    if ref not in pb.marks_ns:
        return {}
    clock = pb.clocks.get(_process(ref))
    t0 = pb.marks_ns[ref]
    return {k: (v - t0) / 1e6 for k, v in pb.marks_ns.items() if pb.clocks.get(_process(k), clock) == clock}


def shared_clock(pb: common_pb2.HandoffTimeline) -> bool:
    """Whether every process of the timeline read one clock."""
    return len(set(pb.clocks.values())) <= 1


def behind_at(pb: common_pb2.HandoffTimeline, ref: str = REFERENCE) -> dict[str, int]:
    """series -> data chunks not yet past that stage at the reference mark (series on its clock only)."""
    if ref not in pb.marks_ns:
        return {}
    clock, t0 = pb.clocks.get(_process(ref)), pb.marks_ns[ref]
    return {
        k: sum(1 for t in v.ns if t > t0) for k, v in pb.series_ns.items() if pb.clocks.get(_process(k), clock) == clock
    }


def violations(pb: common_pb2.HandoffTimeline) -> list[str]:
    """What breaks causality in a timeline (empty: nothing): a CHAINS link whose later mark reads earlier,
    a per-chunk series that goes back, a chunk that reaches a SERIES_CHAIN stage before the one before it.
    Only marks of one clock are compared (the reference's; see offsets_ms): on a shared clock a violation
    means the clocks are not one after all, or a mark is misplaced."""
    off = offsets_ms(pb)
    out = []
    for chain in CHAINS:
        got = [k for k in chain if k in off]
        out += [f"{a} {off[a]:.3f} > {b} {off[b]:.3f} ms" for a, b in zip(got, got[1:]) if off[a] > off[b]]
    clock = pb.clocks.get(_process(REFERENCE))
    series = [
        (k, list(pb.series_ns[k].ns))
        for k in SERIES_CHAIN
        if k in pb.series_ns and pb.clocks.get(_process(k), clock) == clock
    ]
    for k, v in series:
        out += [f"{k}[{i + 1}] before [{i}]" for i in range(len(v) - 1) if v[i + 1] < v[i]]
    for (a, x), (b, y) in zip(series, series[1:]):
        if len(x) != len(y):
            out.append(f"{a} has {len(x)} chunks, {b} {len(y)}")
        out += [f"chunk {i}: {b} before {a}" for i, (s, t) in enumerate(zip(x, y)) if t < s]
    return out
