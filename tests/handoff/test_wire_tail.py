"""baton.handoff.wire format 4: the two-segment chunk plan (head in chunk_bytes, tail from tail_from in
tail_chunk_bytes). Round trips bitwise with and without a tail, format 3 still read, every bad plan refused
before allocation (INVALID_ARGUMENT), every stream cut otherwise than its header says DATA_LOSS, and a fuzz
of header plans. Each test runs with chunks verified inline and in the pool, as tests/handoff/test_wire.py."""

from __future__ import annotations

import hashlib
import itertools
import random

import pytest
import torch
from test_wire import (
    FP,
    LAYOUT,
    POS,
    TENSORS,
    TOTAL,
    assert_bitwise,
    copied,
    decode,
    encode,
    expect,
    invalid_before_alloc,
    with_header,
)

from baton.handoff import decode as wire_decode
from baton.handoff import encode as wire_encode
from baton.handoff import wire
from baton.handoff.progress import tail_offset
from baton.v1 import state_pb2 as pb


@pytest.fixture(autouse=True, params=["inline", "pool"])
def hashing(request, monkeypatch):
    monkeypatch.setattr(wire, "PARALLEL_MIN_BYTES", 1 if request.param == "pool" else 1 << 40)
    return request.param


def sizes(chunks) -> list[int]:
    return [len(c.data) for c in chunks[1:-1]]


def planned(plan: wire.ChunkPlan) -> list[int]:
    """Chunk sizes from first principles: the head in chunk_bytes pieces, then the tail in its own."""
    split = plan.tail_from if plan.tail_chunk_bytes else plan.total
    head = [min(plan.chunk_bytes, split - a) for a in range(0, split, plan.chunk_bytes)]
    tail = [min(plan.tail_chunk_bytes, plan.total - a) for a in range(split, plan.total, plan.tail_chunk_bytes or 1)]
    return head + tail


# ---- the plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "total,cb,tail,tcb",
    [
        (398, 64, 0, 0),
        (398, 64, 320, 16),
        (398, 64, 0, 7),
        (398, 64, 384, 64),
        (398, 64, 384, 1),
        (398, 64, 256, 200),
        (0, 64, 0, 0),
        (0, 64, 0, 5),
        (128, 64, 128, 10),
        (1, 1, 1, 1),
    ],
)
def test_chunk_plan_spans_tile_the_bytes(total, cb, tail, tcb):
    p = wire.ChunkPlan(total, cb, tail, tcb)
    want = planned(p)
    ends = list(itertools.accumulate(want))
    assert p.count == len(want) and [p.span(i)[1] for i in range(p.count)] == want
    assert [sum(p.span(i)) for i in range(p.count)] == ends and 0 not in want
    for end in range(total + 1):  # chunks covering [0, end): up to the first that ends at or past it
        assert p.chunks_to(end) == (0 if end == 0 else 1 + next(i for i, e in enumerate(ends) if e >= end))


def test_sender_plan_rounds_tail_from_down_and_drops_useless_tails():
    assert wire_encode.chunk_plan(398, 64, 330, 16) == wire.ChunkPlan(398, 64, 320, 16)
    assert wire_encode.chunk_plan(398, 64, 63, 16) == wire.ChunkPlan(398, 64, 0, 16)  # all tail
    assert wire_encode.chunk_plan(398, 64, 330, 0) == wire.ChunkPlan(398, 64)  # off
    assert wire_encode.chunk_plan(398, 64, 330, 64) == wire.ChunkPlan(398, 64)  # nothing smaller
    assert wire_encode.chunk_plan(398, 64, 5000, 16) == wire.ChunkPlan(398, 64, 384, 16)  # past the end: clamped
    assert wire_encode.chunk_plan(384, 64, 5000, 16) == wire.ChunkPlan(384, 64)  # an empty tail: none
    with pytest.raises(ValueError, match="tail_chunk_bytes"):
        encode(64, tail_chunk_bytes=-1)
    with pytest.raises(ValueError, match="tail_chunk_bytes"):
        encode(64, tail_chunk_bytes=wire.MAX_CHUNK_BYTES + 1)


def test_tail_offset_is_the_start_of_the_last_layers_in_the_table():
    specs = [wire.TensorDesc.of(t) for t in TENSORS]  # layers.0.conv 30, .recurrent 128, layers.1.* 224, hidden 16
    assert [tail_offset(specs, k) for k in (0, 1, 2, 3)] == [TOTAL - 16, 158, 0, 0]
    with pytest.raises(ValueError):
        tail_offset(specs, -1)


# ---- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cb,tail_from,tcb",
    [(64, 158, 16), (64, 158, 1), (64, 0, 7), (100, 399, 30), (50, 382, 13), (7, 158, 3), (64, 158, 0), (64, 158, 64)],
)
def test_round_trip_bitwise_with_a_tail_and_sizes_as_planned(cb, tail_from, tcb):
    chunks = encode(cb, tail_from=tail_from, tail_chunk_bytes=tcb)
    h = chunks[0].header
    plan = wire_encode.chunk_plan(TOTAL, cb, tail_from, tcb)
    assert (h.format_version, h.chunk_bytes, h.tail_from, h.tail_chunk_bytes) == (
        4,
        cb,
        plan.tail_from,
        plan.tail_chunk_bytes,
    )
    assert sizes(chunks) == planned(plan) and sum(sizes(chunks)) == TOTAL
    if 0 < tcb < cb and tail_from < TOTAL:
        assert plan.tail_chunk_bytes == tcb and plan.tail_from == tail_from // cb * cb
        assert len(sizes(chunks)) > -(-TOTAL // cb)
    assert [c.chunk_index for c in chunks[1:-1]] == list(range(plan.count))
    assert [c.chunk_sha256 for c in chunks[1:-1]] == [hashlib.sha256(c.data).digest() for c in chunks[1:-1]]
    assert chunks[-1].trailer.data_chunks == plan.count
    frames = list(
        wire_encode.encode_state_frames(
            session_id="s1",
            fingerprint=FP,
            position=POS,
            next_token=11,
            tensors=TENSORS,
            chunk_bytes=cb,
            tail_from=tail_from,
            tail_chunk_bytes=tcb,
        )
    )
    assert frames == [c.SerializeToString() for c in chunks]
    placed = []
    st = decode(frames, on_tensor=lambda name, t: placed.append(name))
    assert_bitwise(st)
    assert placed == [t.name for t in TENSORS] and st.stats.chunks == plan.count and st.next_token == 11


def test_no_tail_is_format_3_bytes_apart_from_the_version(monkeypatch):
    """Format 4 without a tail: the tail fields are absent from the header (proto3 defaults), the data
    frames are those of format 3; a format 3 stream (as an older sender makes it) is still accepted."""
    v4 = list(
        wire_encode.encode_state_frames(
            session_id="s1", fingerprint=FP, position=POS, next_token=11, tensors=TENSORS, chunk_bytes=64
        )
    )
    monkeypatch.setattr(wire_encode, "FORMAT_VERSION", 3)
    v3 = list(
        wire_encode.encode_state_frames(
            session_id="s1", fingerprint=FP, position=POS, next_token=11, tensors=TENSORS, chunk_bytes=64
        )
    )
    h3, h4 = (pb.StateChunk.FromString(f[0]).header for f in (v3, v4))
    assert (h3.format_version, h4.tail_from, h4.tail_chunk_bytes) == (3, 0, 0) and len(v4[0]) == len(v3[0])
    h3.format_version = 4
    assert h3.SerializeToString() == h4.SerializeToString() and v3[1:-1] == v4[1:-1]
    assert_bitwise(decode(v3))


def test_format_3_with_tail_fields_is_invalid(monkeypatch):
    monkeypatch.setattr(wire_encode, "FORMAT_VERSION", 3)
    chunks = encode(64)
    invalid_before_alloc(with_header(chunks, tail_from=128, tail_chunk_bytes=16), "format_version 3 header")
    invalid_before_alloc(with_header(chunks, tail_chunk_bytes=16), "a tail segment is format 4")


# ---- bad plans: INVALID_ARGUMENT before allocation ----------------------------------------------
@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(tail_from=128, tail_chunk_bytes=0), "tail_from 128 without a tail segment"),
        (dict(tail_from=100, tail_chunk_bytes=16), "tail_from 100 is not a multiple of chunk_bytes 64"),
        (dict(tail_from=448, tail_chunk_bytes=16), "tail_from 448 exceeds total_bytes 398"),
        (dict(tail_from=1 << 62, tail_chunk_bytes=16), "exceeds total_bytes"),
        (dict(tail_from=128, tail_chunk_bytes=65), r"tail_chunk_bytes 65 not in 1..chunk_bytes 64"),
        (dict(tail_from=128, tail_chunk_bytes=(1 << 32) - 1), "not in 1..chunk_bytes"),
    ],
)
def test_bad_tail_fields_are_refused_before_allocation(fields, match):
    invalid_before_alloc(with_header(encode(64), **fields), match)


def test_too_many_chunks_is_refused_before_allocation(monkeypatch):
    monkeypatch.setattr(wire_decode, "MAX_DATA_CHUNKS", 10)
    chunks = encode(64, tail_from=0, tail_chunk_bytes=16)  # 25 chunks
    invalid_before_alloc(chunks, "25 data chunks")
    assert_bitwise(decode(encode(64)))  # 7 chunks: fine


# ---- streams cut otherwise than the header says: DATA_LOSS -------------------------------------
def test_tail_chunks_of_the_wrong_size_or_count_are_data_loss():
    good = encode(64, tail_from=158, tail_chunk_bytes=16)  # head 2 x 64, tail 270 bytes: 16 x 16 + 14
    assert sizes(good) == [64, 64] + [16] * 16 + [14]
    # the header says a tail segment, the chunks have none (and the other way round)
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        good[:1] + encode(64)[1:],
        match=r"data chunk 2: 64 bytes, expected 16 \(tail segment; chunk_bytes 64, total_bytes 398, "
        r"tail from 128 in tail_chunk_bytes 16\)",
    )
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        encode(64)[:1] + good[1:],
        match=r"data chunk 2: 16 bytes, expected 64 \(head segment",
    )
    # another tail chunk size, another tail start
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        good[:1] + encode(64, tail_from=158, tail_chunk_bytes=32)[1:],
        match="data chunk 2: 32 bytes, expected 16",
    )
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        good[:1] + encode(64, tail_from=64, tail_chunk_bytes=16)[1:],
        match="data chunk 1: 16 bytes, expected 64",
    )
    # one byte short, a chunk dropped, a chunk added, the last one missing
    short = list(good)
    short[5] = copied(short[5], data=short[5].data[:-1])
    expect(wire.StateCorrupt, "DATA_LOSS", short, match="data chunk 4: 15 bytes, expected 16")
    expect(wire.StateCorrupt, "DATA_LOSS", good[:5] + good[6:], match="data chunk 4: chunk_index 5")
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        good[:-1] + [copied(good[-2], chunk_index=19)] + good[-1:],
        match=r"more than the declared total_bytes 398 \(19 chunks: .*tail_chunk_bytes 16\)",
    )
    expect(wire.StateCorrupt, "DATA_LOSS", good[:-2] + good[-1:], match="truncated")
    # the plan is covered by the manifest: a rewritten plan that cuts the same sizes is caught there
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        with_header(encode(64), tail_from=128, tail_chunk_bytes=64),
        match="manifest_sha256 mismatch",
    )


def test_fuzzed_plans_never_load_a_lie():
    """Random header plans over a valid tail stream: only the true plan loads; anything else is a
    StateInvalid or StateCorrupt (never another exception, never a partial state)."""
    rng = random.Random(4)
    good = encode(64, tail_from=158, tail_chunk_bytes=16)
    picks = [0, 1, 15, 16, 17, 63, 64, 65, 128, 192, 384, 398, 448, (1 << 32) - 1]
    for _ in range(150):
        fields = {
            "chunk_bytes": rng.choice([16, 32, 64, 65, 128]),
            "tail_from": rng.choice(picks),
            "tail_chunk_bytes": rng.choice(picks[:9]),
        }
        chunks = with_header(good, **fields)
        if fields == {"chunk_bytes": 64, "tail_from": 128, "tail_chunk_bytes": 16}:
            assert_bitwise(decode(chunks))
            continue
        with pytest.raises((wire.StateInvalid, wire.StateCorrupt)):
            decode(chunks)
    for _ in range(60):  # and random valid plans round-trip
        cb = rng.randint(1, 120)
        tail_from, tcb = rng.randint(0, TOTAL + 10), rng.randint(0, cb)
        chunks = encode(cb, tail_from=tail_from, tail_chunk_bytes=tcb)
        assert sizes(chunks) == planned(wire_encode.chunk_plan(TOTAL, cb, tail_from, tcb))
        assert_bitwise(decode(chunks))


def test_layout_is_unchanged_by_the_tail():
    assert LAYOUT.entries.keys() == {t.name for t in TENSORS}
    st = decode(encode(1, tail_from=0, tail_chunk_bytes=1))
    assert_bitwise(st)
    assert torch.equal(st.tensors["hidden"].view(torch.uint8), TENSORS[-1].tensor.view(torch.uint8))
