"""baton.handoff.wire: bitwise round trips, and every corruption / mismatch / lie refused with the right code.
Every test runs twice: chunks verified inline, and in the hashing pool (PARALLEL_MIN_BYTES = 1)."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from baton.handoff import decode as wire_decode
from baton.handoff import encode as wire_encode
from baton.handoff import layout, wire
from baton.v1 import common_pb2
from baton.v1 import state_pb2 as pb

FP = "sha256:test-model"
POS = 7


@pytest.fixture(autouse=True, params=["inline", "pool"])
def hashing(request, monkeypatch):
    monkeypatch.setattr(wire, "PARALLEL_MIN_BYTES", 1 if request.param == "pool" else 1 << 40)
    return request.param


def make_tensors(seed: int = 0, pos: int = POS) -> list[wire.WireTensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 16, 4, generator=g).half()[:, :pos]  # [kv_heads, L, head_dim], a strided view
    return [
        wire.WireTensor("layers.0.conv", pb.GDN_CONV, torch.randn(5, 3, generator=g).bfloat16()),
        wire.WireTensor("layers.0.recurrent", pb.GDN_RECURRENT, torch.randn(2, 4, 4, generator=g)),
        wire.WireTensor("layers.1.key", pb.ATTN_KEY, kv),
        wire.WireTensor("layers.1.value", "attn_value", torch.randn(2, pos, 4, generator=g).bfloat16()),
        wire.WireTensor("hidden", pb.HIDDEN, torch.randn(8, generator=g).bfloat16()),
    ]


TENSORS = make_tensors()
TOTAL = sum(t.tensor.numel() * t.tensor.element_size() for t in TENSORS)  # 30+128+112+112+16 = 398
LAYOUT = layout.ExpectedLayout.from_tensors(TENSORS, max_position=64)


def encode(chunk_bytes=64, tensors=TENSORS, **kw):
    args = (
        dict(session_id="s1", fingerprint=FP, position=POS, next_token=11, tensors=tensors, chunk_bytes=chunk_bytes)
        | kw
    )
    return list(wire_encode.encode_state(**args))


def decode(chunks, **kw):
    return wire_decode.decode_stream(chunks, LAYOUT, FP, 1 << 20, **kw)


def assert_bitwise(state, tensors=TENSORS):
    assert set(state.tensors) == {t.name for t in tensors}
    for t in tensors:
        got = state.tensors[t.name]
        assert got.dtype == t.tensor.dtype and got.shape == t.tensor.shape
        assert torch.equal(got.view(torch.uint8), t.tensor.contiguous().view(torch.uint8)), t.name


def copied(msg, **fields):
    c = pb.StateChunk()
    c.CopyFrom(msg)
    for k, v in fields.items():
        setattr(c, k, v)
    return c


def with_header(chunks, **fields):
    h = copied(chunks[0])
    for k, v in fields.items():
        setattr(h.header, k, v)
    return [h] + chunks[1:]


def flipped(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x01
    return bytes(b)


def expect(exc, code, chunks, match=None, **kw):
    with pytest.raises(exc, match=match) as e:
        decode(chunks, **kw)
    assert e.value.code == code
    return e.value


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_bytes", [1, 7, 30, 64, 100, 397, 398, 4096])
def test_round_trip_bitwise_across_chunk_sizes(chunk_bytes):
    chunks = encode(chunk_bytes)
    data = [c.data for c in chunks[1:-1]]
    assert [c.WhichOneof("part") for c in (chunks[0], chunks[-1])] == ["header", "trailer"]
    assert all(0 < len(d) <= chunk_bytes for d in data) and sum(map(len, data)) == TOTAL
    assert len(data) == -(-TOTAL // chunk_bytes)  # chunks span tensor boundaries: none is short early
    assert [c.chunk_index for c in chunks[1:-1]] == list(range(len(data)))
    assert [c.chunk_sha256 for c in chunks[1:-1]] == [hashlib.sha256(d).digest() for d in data]
    assert chunks[0].header.chunk_bytes == chunk_bytes and chunks[0].header.format_version == 4
    assert chunks[-1].trailer.data_chunks == len(data) and len(chunks[-1].trailer.manifest_sha256) == 32
    st = decode(chunks)
    assert_bitwise(st)
    assert (st.session_id, st.fingerprint, st.position, st.next_token) == ("s1", FP, POS, 11)
    assert st.stats.total_bytes == TOTAL and st.stats.chunks == len(data) and st.stats.tokens == POS
    assert st.stats.bytes_by_kind == {"gdn_conv": 30, "gdn_recurrent": 128, "attn_kv": 224, "hidden": 16}


def test_frames_are_the_same_messages_and_decode_zero_copy():
    frames = list(
        wire_encode.encode_state_frames(
            session_id="s1", fingerprint=FP, position=POS, next_token=11, tensors=TENSORS, chunk_bytes=50
        )
    )
    assert frames == [c.SerializeToString() for c in encode(50)]
    assert_bitwise(decode(frames))
    assert_bitwise(decode([pb.StateChunk.FromString(f) for f in frames]))


def test_big_fp32_bf16_tensors_round_trip_with_uneven_chunks():
    g = torch.Generator().manual_seed(1)
    ts = [
        wire.WireTensor("a", pb.GDN_RECURRENT, torch.randn(3, 128, 129, generator=g)),
        wire.WireTensor("b", pb.GDN_CONV, torch.randn(1000, 3, generator=g).bfloat16()),
    ]
    lay = layout.ExpectedLayout.from_tensors(ts, 0)
    chunks = wire_encode.encode_state(
        session_id="x", fingerprint=FP, position=0, next_token=0, tensors=ts, chunk_bytes=65521
    )  # prime: never divides a tensor's size
    assert_bitwise(wire_decode.decode_stream(wire.pipelined(chunks), lay, FP, 1 << 24), ts)


@pytest.mark.parametrize("new_bytes", ["c-api", "bytesio"])
@pytest.mark.parametrize("chunk_bytes", [(256 << 10) - 1, 256 << 10, 393_241, 1 << 20])
def test_large_frames_built_outside_the_gil_equal_protobuf(chunk_bytes, new_bytes, monkeypatch):
    """Frames >= 256 KiB are filled by numpy (not b"".join) into an uninitialized bytes object (C API),
    or a zero-filled BytesIO where that API is missing: same bytes, same state, plain immutable bytes."""
    from baton.handoff import frames

    if new_bytes == "bytesio":
        monkeypatch.setattr(frames, "_new_bytes", None)
    else:
        assert frames._new_bytes is not None  # CPython
    g = torch.Generator().manual_seed(2)
    ts = [
        wire.WireTensor("a", pb.GDN_RECURRENT, torch.randn(5, 128, 129, generator=g)),
        wire.WireTensor("k", pb.ATTN_KEY, torch.randn(4, 700, 256, generator=g).bfloat16()[:, :600]),
        wire.WireTensor("b", pb.GDN_CONV, torch.randn(1000, 3, generator=g).bfloat16()),
    ]
    lay = layout.ExpectedLayout.from_tensors(ts, 600)
    kw = dict(session_id="x", fingerprint=FP, position=600, next_token=0, tensors=ts, chunk_bytes=chunk_bytes)
    frames = list(wire_encode.encode_state_frames(**kw))
    assert frames == [c.SerializeToString() for c in wire_encode.encode_state(**kw)]
    assert len(frames) >= 4 and all(type(f) is bytes for f in frames)  # >= 2 data chunks
    assert_bitwise(wire_decode.decode_stream(frames, lay, FP, 1 << 24), ts)


def test_lazy_source_is_read_only_after_the_header_is_sent():
    touched = []

    def source():
        for t in TENSORS:
            touched.append(t.name)
            yield t.tensor

    it = wire_encode.encode_state(
        session_id="s1",
        fingerprint=FP,
        position=POS,
        next_token=11,
        chunk_bytes=64,
        specs=[wire.TensorDesc.of(t) for t in TENSORS],
        tensor_source=source(),
    )
    assert next(it).WhichOneof("part") == "header" and touched == []
    assert_bitwise(decode([encode()[0], *it]))
    assert touched == [t.name for t in TENSORS]


def test_lazy_source_must_match_its_table():
    specs = [wire.TensorDesc.of(t) for t in TENSORS]
    bad = [t.tensor for t in TENSORS[:-1]] + [torch.zeros(9, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="hidden"):
        list(
            wire_encode.encode_state(
                session_id="s", fingerprint=FP, position=POS, next_token=0, specs=specs, tensor_source=iter(bad)
            )
        )
    with pytest.raises(ValueError):  # one tensor short
        list(
            wire_encode.encode_state(
                session_id="s", fingerprint=FP, position=POS, next_token=0, specs=specs, tensor_source=iter(bad[:3])
            )
        )


def test_pipelined_reraises_producer_errors():
    def boom():
        yield 1
        raise RuntimeError("producer failed")

    it = wire.pipelined(boom())
    assert next(it) == 1
    with pytest.raises(RuntimeError, match="producer failed"):
        next(it)


def test_non_canonical_data_frames_are_parsed_by_protobuf():
    """Fields in another order (valid protobuf, not what the sender writes): the slow path, same result."""
    frames = list(
        wire_encode.encode_state_frames(
            session_id="s1", fingerprint=FP, position=POS, next_token=11, tensors=TENSORS, chunk_bytes=64
        )
    )
    for i in range(1, len(frames) - 1):
        c = pb.StateChunk.FromString(frames[i])
        sha = pb.StateChunk(chunk_sha256=c.chunk_sha256).SerializeToString()
        idx = pb.StateChunk(chunk_index=c.chunk_index).SerializeToString()
        frames[i] = sha + idx + pb.StateChunk(data=c.data).SerializeToString()
        assert wire._data_frame(frames[i]) is None
    assert_bitwise(decode(frames))


# ---- corruption: DATA_LOSS ----------------------------------------------------------------------
@pytest.mark.parametrize("index", [1, 3, 6, 7])
def test_flipped_byte_in_any_data_chunk_is_data_loss(index):
    chunks = encode(64)  # 7 data chunks: messages 1..7
    chunks[index] = copied(chunks[index], data=flipped(chunks[index].data, len(chunks[index].data) // 2))
    expect(wire.StateCorrupt, "DATA_LOSS", chunks, match=f"data chunk {index - 1}: chunk_sha256 mismatch")


@pytest.mark.parametrize("frames", [False, True])
def test_flipped_bit_anywhere_in_a_data_frame_is_data_loss(frames):
    """Every byte of a serialized data chunk (tag, length, data, index, digest) flipped in turn."""
    good = list(
        wire_encode.encode_state_frames(
            session_id="s1", fingerprint=FP, position=POS, next_token=11, tensors=TENSORS, chunk_bytes=64
        )
    )
    for i in range(len(good[2])):
        bad = good[:2] + [flipped(good[2], i)] + good[3:]
        expect(wire.StateCorrupt, "DATA_LOSS", bad if frames else [pb.StateChunk.FromString(bad[0])] + bad[1:])


def test_flipped_chunk_digest_is_data_loss():
    chunks = encode(64)
    chunks[2] = copied(chunks[2], chunk_sha256=flipped(chunks[2].chunk_sha256, 5))
    expect(wire.StateCorrupt, "DATA_LOSS", chunks, match="data chunk 1: chunk_sha256 mismatch")
    chunks[2] = copied(chunks[2], chunk_sha256=b"")
    expect(wire.StateCorrupt, "DATA_LOSS", chunks, match="chunk_sha256 has 0 bytes")


def test_reordered_duplicated_or_dropped_chunks_are_data_loss():
    chunks = encode(64)
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        chunks[:1] + [chunks[2], chunks[1]] + chunks[3:],
        match="data chunk 0: chunk_index 1",
    )
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:3] + chunks[2:], match="data chunk 2: chunk_index 1")
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:2] + chunks[3:], match="data chunk 1: chunk_index 2")


def test_reordered_chunks_with_rewritten_indices_fail_the_manifest():
    """Each chunk intact and the indices made consecutive again: only the manifest (the ordered
    digest list) can tell, and it does."""
    chunks = encode(64)
    a, b = chunks[2], chunks[3]  # both full 64-byte chunks
    chunks[2], chunks[3] = copied(b, chunk_index=a.chunk_index), copied(a, chunk_index=b.chunk_index)
    expect(wire.StateCorrupt, "DATA_LOSS", chunks, match="manifest_sha256 mismatch")


@pytest.mark.parametrize("field,value", [("session_id", "s2"), ("mode", 1), ("engine", 2)])
def test_altered_header_fails_the_manifest(field, value):
    """A header field that no size check covers (the digest of v1 covered only tensor bytes)."""
    expect(wire.StateCorrupt, "DATA_LOSS", with_header(encode(64), **{field: value}), match="manifest_sha256")


def with_trailer(chunks, **fields):
    t = copied(chunks[-1])
    for k, v in fields.items():
        setattr(t.trailer, k, v)
    return chunks[:-1] + [t]


def test_next_token_is_in_the_trailer_and_covered_by_the_manifest():
    """Format 3: next_token is known only after the logits, so it travels in the trailer; flipping it
    (the manifest left as sent) is DATA_LOSS, like any other altered field."""
    chunks = encode(64)
    assert chunks[-1].trailer.next_token == 11
    assert "next_token" not in str(chunks[0].header)
    assert decode(chunks).next_token == 11
    expect(wire.StateCorrupt, "DATA_LOSS", with_trailer(chunks, next_token=12), match="manifest_sha256 mismatch")


def test_next_token_may_be_given_late():
    """A callable next_token is asked for only after every tensor was pulled from the source."""
    pulled = []

    def source():
        for t in TENSORS:
            pulled.append(t.name)
            yield t.tensor

    def late():
        assert pulled == [t.name for t in TENSORS]
        return 42

    chunks = list(
        wire_encode.encode_state(
            session_id="s1",
            fingerprint=FP,
            position=POS,
            next_token=late,
            specs=[wire.TensorDesc.of(t) for t in TENSORS],
            tensor_source=source(),
            chunk_bytes=64,
        )
    )
    assert decode(chunks).next_token == 42


def test_altered_manifest_is_data_loss():
    chunks = encode(64)
    tr = copied(chunks[-1])
    tr.trailer.manifest_sha256 = flipped(tr.trailer.manifest_sha256, 0)
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:-1] + [tr], match="manifest_sha256 mismatch")
    tr.trailer.manifest_sha256 = b""
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:-1] + [tr], match="manifest_sha256 mismatch")


def test_chunk_sizes_must_follow_chunk_bytes():
    """Same bytes, cut differently from what the header declares: refused on arrival."""
    other = encode(50)
    expect(wire.StateCorrupt, "DATA_LOSS", encode(64)[:1] + other[1:], match="data chunk 0: 50 bytes, expected 64")
    short = encode(64)
    short[1] = copied(short[1], data=short[1].data[:-1])
    expect(wire.StateCorrupt, "DATA_LOSS", short, match="data chunk 0: 63 bytes, expected 64")


def test_index_or_digest_on_header_or_trailer_is_data_loss():
    chunks = encode(64)
    expect(
        wire.StateCorrupt, "DATA_LOSS", [copied(chunks[0], chunk_index=3)] + chunks[1:], match="set on a header message"
    )
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        chunks[:-1] + [copied(chunks[-1], chunk_sha256=b"x" * 32)],
        match="set on a trailer message",
    )


def test_missing_last_data_chunk_is_data_loss():
    chunks = encode(64)
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:-2] + chunks[-1:], match="truncated")


def test_missing_trailer_is_data_loss():
    expect(wire.StateCorrupt, "DATA_LOSS", encode(64)[:-1], match="before the trailer")


def test_missing_header_and_data_before_header_are_data_loss():
    chunks = encode(64)
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[1:], match="before the header")
    expect(wire.StateCorrupt, "DATA_LOSS", [], match="without a header")


def test_chunks_after_trailer_are_data_loss():
    chunks = encode(64)
    expect(wire.StateCorrupt, "DATA_LOSS", chunks + [chunks[1]], match="after the trailer")
    expect(wire.StateCorrupt, "DATA_LOSS", chunks + [chunks[-1]], match="trailer repeated")
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:1] + chunks, match="second header")


def test_more_bytes_than_declared_and_out_of_order_are_data_loss():
    chunks = encode(64)
    expect(
        wire.StateCorrupt,
        "DATA_LOSS",
        chunks[:-1] + [pb.StateChunk(data=b"x")] + chunks[-1:],
        match="more than the declared",
    )
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:2] + [pb.StateChunk()], match="no part")
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:2] + [b"\xff\xff\xff"], match="unparsable")


def test_trailer_counts_must_match():
    chunks = encode(64)
    tr = pb.StateChunk()
    tr.CopyFrom(chunks[-1])
    tr.trailer.data_chunks += 1
    expect(wire.StateCorrupt, "DATA_LOSS", chunks[:-1] + [tr], match="data_chunks")


def test_failure_or_abort_with_chunks_in_flight_waits_for_them_and_writes_nothing_after(hashing):
    """A corrupt chunk among many in the pool: the error names it, and once feed() raised no pool task
    still writes into the caller's buffers (they may be reused for the next stream)."""
    g = torch.Generator().manual_seed(3)
    ts = [wire.WireTensor(f"r{i}", pb.GDN_RECURRENT, torch.randn(64, 1024, generator=g)) for i in range(8)]
    lay = layout.ExpectedLayout.from_tensors(ts, 0)
    chunks = list(
        wire_encode.encode_state(
            session_id="x", fingerprint=FP, position=0, next_token=0, tensors=ts, chunk_bytes=96 << 10
        )
    )
    chunks[4] = copied(chunks[4], data=flipped(chunks[4].data, 7))
    bufs = []
    rx = wire_decode.StateReceiver(
        lay,
        fingerprint=FP,
        max_total_bytes=1 << 24,
        workers=4,
        alloc=lambda s, d: bufs.append(torch.zeros(s, dtype=d)) or bufs[-1],
    )
    with pytest.raises(wire.StateCorrupt, match="data chunk 3: chunk_sha256 mismatch"):
        for c in chunks:
            rx.feed(c)
    assert not rx._inflight and rx._tensors == {}
    before = [b.clone() for b in bufs]
    time.sleep(0.05)
    assert all(torch.equal(x, y) for x, y in zip(before, bufs))
    # the caller stops feeding (the client cancelled): abort() waits for the pool the same way
    bufs.clear()
    rx = wire_decode.StateReceiver(
        lay,
        fingerprint=FP,
        max_total_bytes=1 << 24,
        workers=4,
        alloc=lambda s, d: bufs.append(torch.zeros(s, dtype=d)) or bufs[-1],
    )
    for c in chunks[:4]:
        rx.feed(c)
    rx.abort()
    assert not rx._inflight and rx._tensors == {}
    before = [b.clone() for b in bufs]
    time.sleep(0.05)
    assert all(torch.equal(x, y) for x, y in zip(before, bufs))
    with pytest.raises(wire.StateCorrupt, match="already failed or finished"):
        rx.feed(chunks[4])


def test_failed_receiver_keeps_nothing_and_refuses_more():
    chunks = encode(64)
    rx = wire_decode.StateReceiver(LAYOUT, fingerprint=FP, max_total_bytes=1 << 20)
    rx.feed(chunks[0])
    rx.feed(chunks[1])
    with pytest.raises(wire.StateCorrupt):
        rx.feed(chunks[-1])  # trailer too early
    assert rx._tensors == {} and rx._arrays == []
    with pytest.raises(wire.StateCorrupt):
        rx.feed(chunks[2])
    with pytest.raises(wire.StateCorrupt):
        rx.finish()


# ---- mismatch: FAILED_PRECONDITION --------------------------------------------------------------
def test_fingerprint_mismatch():
    expect(wire.StateMismatch, "FAILED_PRECONDITION", encode(fingerprint="sha256:other"), match="fingerprint")


@pytest.mark.parametrize("version", [0, 1, 2, 5])
def test_format_version_mismatch(version):
    """Older (v1: one serial SHA-256; v2: next_token in the header), newer or unset: refused at the
    header, before any allocation. (Format 3 is still read: tests/handoff/test_wire_tail.py.)"""
    calls = []
    with pytest.raises(
        wire.StateMismatch,
        match=f"format_version {version}; this worker speaks 4 "
        r"\(and reads 3, 4\)",
    ) as e:
        decode(
            with_header(encode(), format_version=version), alloc=lambda s, d: calls.append(s) or torch.empty(s, dtype=d)
        )
    assert e.value.code == "FAILED_PRECONDITION" and calls == []


# ---- invalid table: INVALID_ARGUMENT, before any allocation -------------------------------------
def invalid_before_alloc(chunks, match):
    calls = []
    err = expect(
        wire.StateInvalid,
        "INVALID_ARGUMENT",
        chunks,
        match=match,
        alloc=lambda s, d: calls.append(s) or torch.empty(s, dtype=d),
    )
    assert calls == []
    return err


def test_position_beyond_window():
    ts = make_tensors(pos=65)
    invalid_before_alloc(encode(tensors=ts, position=65), "max_position=64")


def test_header_lying_about_sizes_is_refused_before_allocation():
    chunks = encode()
    invalid_before_alloc(with_header(chunks, total_bytes=1 << 50), "exceeds the limit")
    invalid_before_alloc(with_header(chunks, total_bytes=TOTAL - 1), "sum of tensors")
    h = with_header(chunks)
    h[0].header.tensors[4].nbytes = 1 << 40
    invalid_before_alloc(h, "'hidden': nbytes")
    h = with_header(chunks)
    h[0].header.tensors[4].shape[:] = [1 << 40]
    invalid_before_alloc(h, r"'hidden': shape \[1099511627776\], expected \[8\]")
    h = with_header(chunks)
    h[0].header.tensors[2].shape[1] = 8  # KV rows must equal position
    invalid_before_alloc(h, "'layers.1.key': shape")


@pytest.mark.parametrize("chunk_bytes", [0, wire.MAX_CHUNK_BYTES + 1])
def test_chunk_bytes_out_of_range_is_refused_before_allocation(chunk_bytes):
    invalid_before_alloc(with_header(encode(), chunk_bytes=chunk_bytes), f"chunk_bytes {chunk_bytes} not in")


def test_table_names_kinds_dtypes_checked():
    chunks = encode()
    for edit, match in [
        (lambda t: setattr(t[0], "name", "layers.9.conv"), "unknown tensor name"),
        (lambda t: setattr(t[1], "name", "layers.0.conv"), "duplicate tensor name"),
        (lambda t: setattr(t[0], "kind", pb.HIDDEN), "kind"),
        (lambda t: setattr(t[1], "dtype", pb.BFLOAT16), "dtype"),
        (lambda t: t.pop(), r"missing \['hidden'\]"),
    ]:
        h = with_header(chunks)
        edit(h[0].header.tensors)
        invalid_before_alloc(h, match)


def test_layout_from_tuples_and_validation():
    lay = layout.ExpectedLayout(
        {"k": ("attn_key", torch.bfloat16, None, (2, 4)), "h": (pb.HIDDEN, torch.bfloat16, (8,), None)}, max_position=10
    )
    assert lay.entries["k"].shape_at(5) == (2, 5, 4) and lay.entries["h"].kind == pb.HIDDEN
    with pytest.raises(ValueError):
        layout.ExpectedLayout({"x": (pb.HIDDEN, torch.float32, None, None)}, max_position=1)


# ---- a real loopback gRPC socket -----------------------------------------------------------------
def test_over_loopback_grpc():
    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    received = {}

    def load(request_iterator, context):
        try:
            st = wire_decode.decode_stream(request_iterator, LAYOUT, FP, 1 << 20)
        except wire.StateError as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        received.update(st.tensors)
        return st.stats.to_proto()

    handler = grpc.stream_unary_rpc_method_handler(
        load,
        request_deserializer=pb.StateChunk.FromString,
        response_serializer=common_pb2.BridgeReport.SerializeToString,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=opts)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Bridge", {"Load": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            call = ch.stream_unary(
                "/test.Bridge/Load",
                request_serializer=pb.StateChunk.SerializeToString,
                response_deserializer=common_pb2.BridgeReport.FromString,
            )
            report = call(wire.pipelined(iter(encode(50))), timeout=10)
            assert report.total_bytes == TOTAL and report.tokens == POS and report.chunks == 8
            assert dict(report.bytes_by_kind)["attn_kv"] == 224
            assert_bitwise(layout.ReceivedState("s1", FP, POS, 11, 0, 0, (), received, None))
            bad = encode(50)
            bad[2] = copied(bad[2], data=bytes(50))
            with pytest.raises(grpc.RpcError) as e:
                call(iter(bad), timeout=10)
            assert e.value.code() == grpc.StatusCode.DATA_LOSS
            assert "data chunk 1: chunk_sha256 mismatch" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                call(iter(encode(fingerprint="sha256:other")), timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop(None)


def test_failed_decode_stops_the_pipeline_thread():
    chunks = encode(64)
    endless = itertools.chain(chunks[:-1], itertools.repeat(copied(chunks[1], chunk_index=7)))
    expect(wire.StateCorrupt, "DATA_LOSS", endless, match="more than the declared")
    deadline = time.monotonic() + 2
    while any(t.name == "baton-wire-pipelined" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "baton-wire-pipelined" for t in threading.enumerate())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_round_trip_bitwise():
    dev = [wire.WireTensor(t.name, t.kind, t.tensor.to("cuda")) for t in TENSORS]
    dev[2] = wire.WireTensor(dev[2].name, dev[2].kind, torch.randn(2, 16, 4, device="cuda").half()[:, :POS])
    chunks = wire.pipelined(
        wire_encode.encode_state(
            session_id="g", fingerprint=FP, position=POS, next_token=1, tensors=dev, chunk_bytes=33
        )
    )
    assert_bitwise(decode(chunks), [wire.WireTensor(t.name, t.kind, t.tensor.cpu()) for t in dev])


def test_encoder_sends_layers_before_the_prefill_ends():
    """With a PrefillProgress source, data chunks of finished layers come out while later stages are
    still unmarked; next_token (from progress.finish) lands in the trailer."""
    import threading

    from baton.handoff.progress import PrefillProgress

    layers = 2  # TENSORS: layers.0.*, layers.1.*, hidden
    prog = PrefillProgress(layers, torch.device("cpu"))
    it = wire_encode.encode_state(
        session_id="s1",
        fingerprint=FP,
        position=POS,
        next_token=prog.next_token,
        specs=[wire.TensorDesc.of(t) for t in TENSORS],
        tensor_source=prog.source(TENSORS),
        chunk_bytes=16,
        workers=2,
    )
    assert next(it).WhichOneof("part") == "header"  # before any stage is final
    prog.mark(0)
    first = next(it)  # layer 0's bytes, layer 1 not final yet
    assert first.WhichOneof("part") == "data" and prog._marked == 1
    threading.Timer(0.05, lambda: (prog.mark(1), prog.finish(99))).start()
    rest = list(it)
    assert rest[-1].trailer.next_token == 99


def test_encoder_stops_when_the_prefill_fails():
    from baton.handoff.progress import PrefillFailed, PrefillProgress

    prog = PrefillProgress(2, torch.device("cpu"))
    it = wire_encode.encode_state(
        session_id="s1",
        fingerprint=FP,
        position=POS,
        next_token=prog.next_token,
        specs=[wire.TensorDesc.of(t) for t in TENSORS],
        tensor_source=prog.source(TENSORS),
        chunk_bytes=16,
        workers=2,
    )
    next(it)
    prog.fail(RuntimeError("oom"))
    with pytest.raises(PrefillFailed, match="oom"):
        list(it)
