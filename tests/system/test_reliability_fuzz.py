"""Hostile input, property-based (hypothesis), over real loopback sockets against real processes: a
router, a prefill and a decode worker (tests/realcluster.py: tiny model, window 128, session TTL 4 s).

Every RPC of the three services (enumerated from the generated descriptors, so a new RPC is fuzzed too)
gets, with the right bearer token, as raw request bytes (a generic `channel.unary_unary(path, None, None)`):
  * random bytes;
  * messages built from the descriptor with hostile values: uint32/uint64 extremes, unknown enum values
    (negative ones too), random text, random decode_target strings, repeated fields up to 40 entries;
  * the same with invalid UTF-8 in a string field (raw bytes: the proto `string` must be UTF-8);
  * LoadState: state streams whose header lies (tensor shapes / nbytes / total_bytes / position far
    beyond the data) around a real state.
Property: the call ends OK or with a status the service documents; a body that does not parse as the
request type ends INVALID_ARGUMENT naming the type (baton.rpc_guard.DecodeGuard: it never reaches Baton;
never grpc's INTERNAL "Exception deserializing request!"); never UNKNOWN (an unhandled exception), never a
hang past the deadline. Afterwards the servers' RSS is
within a fixed bound, health is SERVING, no session is left and a normal request is served.
Huge repeated fields (1e6 ids) are refused by validation, naming the field, before any list is built.
"""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.internal.encoder import _VarintBytes
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pass
from helpers import make_tiny_dir
from realcluster import RealCluster, rss_mib, tokens

from baton.handoff import push
from baton.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2, state_pb2

C = grpc.StatusCode
MAX_LEN, TTL = 128, 4.0
HANDOFF = {C.UNAVAILABLE, C.DATA_LOSS, C.FAILED_PRECONDITION, C.UNAUTHENTICATED}  # decode_target's, passed on
DOCUMENTED = {  # from the services' docstrings (router/service.py, prefill_worker/service.py, decode_worker/...)
    "baton.v1.Router": {
        C.INVALID_ARGUMENT,
        C.RESOURCE_EXHAUSTED,
        C.UNAVAILABLE,
        C.OUT_OF_RANGE,
        C.DEADLINE_EXCEEDED,
        C.CANCELLED,
    },
    "baton.v1.PrefillWorker": {
        C.INVALID_ARGUMENT,
        C.NOT_FOUND,
        C.RESOURCE_EXHAUSTED,
        C.OUT_OF_RANGE,
        C.ABORTED,
        C.DEADLINE_EXCEEDED,
        C.CANCELLED,
    }
    | HANDOFF,
    "baton.v1.DecodeWorker": {
        C.INVALID_ARGUMENT,
        C.NOT_FOUND,
        C.RESOURCE_EXHAUSTED,
        C.OUT_OF_RANGE,
        C.ABORTED,
        C.DATA_LOSS,
        C.FAILED_PRECONDITION,
        C.DEADLINE_EXCEEDED,
        C.CANCELLED,
    },
}
SERVICES = [
    (router_pb2, "Router", "router"),
    (prefill_pb2, "PrefillWorker", "prefill-0"),
    (decode_pb2, "DecodeWorker", "decode-0"),
]
METHODS = [
    (svc, m, where)
    for mod, name, where in SERVICES
    for svc in [mod.DESCRIPTOR.services_by_name[name]]
    for m in svc.methods
]
SIDS = ["fz-a", "fz-b", ""]
RSS_GROWTH_MIB = 300  # allowed growth of each server's RSS over the whole run
seen: dict[str, dict[str, int]] = {}


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    tiny = make_tiny_dir(tmp)
    c = RealCluster(tmp, prefill=1, decode=1, max_len=MAX_LEN, model_dir=tiny, worker_args=("--ttl", str(TTL)))
    try:
        c.start()
        c.stream = _real_state(tiny, c)  # a valid LoadState stream, to lie around
        c.rss0 = {n: rss_mib(c.pid(n)) for n in ("router", "prefill-0", "decode-0")}
        yield c
    finally:
        c.close()
    print("fuzz: status codes seen per RPC:", {k: dict(sorted(v.items())) for k, v in sorted(seen.items())})


def _real_state(tiny, c) -> list[state_pb2.StateChunk]:
    import torch

    from baton.engine.runner import ModelRunner
    from baton.loading import load_model
    from prefill_worker.engine import ExactEngine

    torch.set_num_threads(1)
    lm = load_model(tiny, dtype="fp32", mtp=None)
    eng = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN, width=16))
    eng.prefill([5, 6, 7, 8], session_id="src")
    tensors, pos, nxt = eng.export("src")
    return list(
        push.stream_state(
            tensors, session_id="fz-a", fingerprint=lm.fingerprint, position=pos, next_token=nxt, chunk_bytes=8192
        )
    )


def _call(cl, svc, m, where, body, timeout=8.0):
    """-> status code of one raw call (token attached, no client-side size limit)."""
    addr = cl.router_addr if where == "router" else cl.addr[where]
    path = f"/{svc.full_name}/{m.name}"
    opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    md = (("authorization", f"Bearer {cl.token}"),)
    with grpc.insecure_channel(addr, options=opts) as ch:
        try:
            if m.client_streaming:
                ch.stream_unary(path, None, None)(iter(body), timeout=timeout, metadata=md)
            elif m.server_streaming:
                for _ in ch.unary_stream(path, None, None)(body, timeout=timeout, metadata=md):
                    pass
            else:
                ch.unary_unary(path, None, None)(body, timeout=timeout, metadata=md)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return C.OK, ""


def _parses(cls, body) -> bool:
    try:
        cls.FromString(body)
        return True
    except Exception:
        return False


def _check(cl, svc, m, where, body, msg_sids=()):
    t0 = time.monotonic()
    code, details = _call(cl, svc, m, where, body)
    took = time.monotonic() - t0
    seen.setdefault(f"{svc.name}.{m.name}", {}).setdefault(code.name, 0)
    seen[f"{svc.name}.{m.name}"][code.name] += 1
    for sid in {*SIDS, *msg_sids} - {""}:  # leave no session behind
        for n in ("prefill-0", "decode-0"):
            cl.release(n, sid)
    assert code != C.UNKNOWN, details  # an exception Baton did not handle
    assert took < 8.0 + 2, f"{m.name} took {took:.1f}s"
    if not m.client_streaming and not _parses(_cls(m.input_type), body):  # refused before Baton saw it
        assert code == C.INVALID_ARGUMENT and m.input_type.full_name in details, (m.name, code, details)
        return code
    assert code == C.OK or code in DOCUMENTED[svc.full_name], (m.name, code, details)
    return code


def _cls(desc):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(desc)


# ---- strategies -------------------------------------------------------------------------------------
U32 = st.one_of(st.integers(0, 40), st.sampled_from([511, 512, 2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
U64 = st.one_of(U32, st.sampled_from([2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
ENUM = st.one_of(st.integers(0, 4), st.sampled_from([-1, -(2**31), 2**31 - 1, 99]))
TARGETS = st.one_of(
    st.just(""),
    st.sampled_from(
        [
            "127.0.0.1:1",
            "localhost:0",
            "[::1]:1",
            "no.such.host:80",
            "\x00",
            "ipv4:1.2.3.4:5",
            "dns://8.8.8.8/x:1",
            "unix:/x",
            ":::",
        ]
    ),
    st.text(max_size=30),
)


@st.composite
def messages(draw, desc, depth=0, cl=None):
    msg = _cls(desc)()
    for f in desc.fields:
        if not draw(st.booleans()):
            continue
        if f.type == F.TYPE_MESSAGE:
            if depth < 2 and not f.is_repeated and not f.message_type.GetOptions().map_entry:
                getattr(msg, f.name).CopyFrom(draw(messages(f.message_type, depth + 1, cl)))
            continue
        if f.type == F.TYPE_STRING:
            if f.name == "decode_target":
                val = draw(st.one_of(TARGETS, st.just(cl.addr["decode-0"]))) if cl else draw(TARGETS)
            elif "session_id" in f.name:
                val = draw(st.one_of(st.just("fz-a"), st.sampled_from(SIDS), st.text(max_size=20)))
            else:
                val = draw(st.text(max_size=60))
        else:
            val = {
                F.TYPE_UINT32: U32,
                F.TYPE_UINT64: U64,
                F.TYPE_ENUM: ENUM,
                F.TYPE_BOOL: st.booleans(),
                F.TYPE_BYTES: st.binary(max_size=64),
                F.TYPE_DOUBLE: st.floats(),
                F.TYPE_FLOAT: st.floats(width=32),  # SamplingParams: NaN, inf, out of range
                F.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
            }[f.type]
            if f.is_repeated:
                val = draw(st.lists(val, max_size=40))
            else:
                val = draw(val)
        if f.is_repeated:
            getattr(msg, f.name).extend(val)
        else:
            setattr(msg, f.name, val)
    return msg


def _sids(msg) -> set[str]:
    return {getattr(msg, f.name) for f in msg.DESCRIPTOR.fields if "session_id" in f.name}


def _bad_utf8(desc, body: bytes, junk: bytes) -> bytes:
    """body + one more occurrence of the message's first string field, holding invalid UTF-8."""
    f = next((f for f in desc.fields if f.type == F.TYPE_STRING), None)
    if f is None:
        return body
    raw = b"\xff" + junk
    return body + _VarintBytes(f.number << 3 | 2) + _VarintBytes(len(raw)) + raw


SETTINGS = settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# ---- the properties --------------------------------------------------------------------------------------
@pytest.mark.parametrize("svc,m,where", METHODS, ids=[f"{s.name}.{m.name}" for s, m, _ in METHODS])
@SETTINGS
@given(data=st.data())
def test_random_bytes_get_documented_codes(cl, svc, m, where, data):
    if m.client_streaming:
        body = data.draw(st.lists(st.binary(max_size=512), min_size=0, max_size=4))
    else:
        body = data.draw(st.binary(max_size=512))
    _check(cl, svc, m, where, body)


@pytest.mark.parametrize("svc,m,where", METHODS, ids=[f"{s.name}.{m.name}" for s, m, _ in METHODS])
@SETTINGS
@given(data=st.data())
@example(data=None)
def test_hostile_messages_get_documented_codes(cl, svc, m, where, data):
    if data is None:  # an @example: the decode_target strings that used to leak odd codes
        if m.name in ("Prefill", "ExportState"):
            for target in ("\x00", "ipv4:1.2.3.4:5", "dns://8.8.8.8/x:1", "127.0.0.1:99999"):
                req = _cls(m.input_type)(session_id="fz-a", decode_target=target)
                if m.name == "Prefill":
                    req.prompt_ids.extend([1, 2, 3])
                else:  # ExportState needs a kept (EXACT) session
                    _call(
                        cl,
                        svc,
                        svc.methods_by_name["Prefill"],
                        where,
                        prefill_pb2.PrefillRequest(
                            session_id="fz-a", prompt_ids=[1, 2], mode=common_pb2.EXACT
                        ).SerializeToString(),
                    )
                assert _check(cl, svc, m, where, req.SerializeToString()) == C.INVALID_ARGUMENT, target
        return
    if m.name in ("Verify", "ExportState", "Decode", "Draft"):  # a live session "fz-a" on both workers
        prefill = _m("PrefillWorker", "Prefill")
        _call(
            cl,
            *prefill,
            prefill_pb2.PrefillRequest(
                session_id="fz-a", prompt_ids=[3, 4, 5], mode=common_pb2.EXACT, decode_target=cl.addr["decode-0"]
            ).SerializeToString(),
        )
    msg = data.draw(messages(m.input_type, cl=cl))
    body = msg.SerializeToString()
    if data.draw(st.integers(0, 3)) == 0:
        body = _bad_utf8(m.input_type, body, data.draw(st.binary(max_size=8)))
    if m.client_streaming:
        chunks = [body] + [
            c.SerializeToString() for c in data.draw(st.lists(messages(m.input_type, cl=cl), max_size=3))
        ]
        _check(cl, svc, m, where, chunks, _sids(msg.header) if msg.HasField("header") else ())
    else:
        _check(cl, svc, m, where, body, _sids(msg))


@SETTINGS
@given(data=st.data())
def test_loadstate_headers_that_lie_about_sizes(cl, data):
    """A real state stream whose header lies: a tensor's shape / nbytes, total_bytes, position or the
    session's window, far beyond the data actually sent: refused before any allocation of that size."""
    svc, m, _ = _m("DecodeWorker", "LoadState")
    chunks = [state_pb2.StateChunk.FromString(c.SerializeToString()) for c in cl.stream]
    h = chunks[0].header
    lie = data.draw(st.sampled_from(["shape", "nbytes", "total", "position", "count", "truncate"]))
    big = data.draw(st.sampled_from([2**31, 2**40, 2**63, 2**64 - 1, 10**12]))
    t = h.tensors[data.draw(st.integers(0, len(h.tensors) - 1))]
    if lie == "shape":
        t.shape[data.draw(st.integers(0, len(t.shape) - 1))] = big
    elif lie == "nbytes":
        t.nbytes = big
    elif lie == "total":
        h.total_bytes = big
    elif lie == "position":
        h.position = big
    elif lie == "count":
        h.tensors.add().CopyFrom(t)
    else:
        chunks = chunks[: data.draw(st.integers(0, len(chunks) - 1))]
    code = _check(cl, svc, m, "decode-0", [c.SerializeToString() for c in chunks])
    assert code in {C.INVALID_ARGUMENT, C.DATA_LOSS, C.FAILED_PRECONDITION}, (lie, code)


@pytest.mark.parametrize(
    "svc,m,where",
    [x for x in METHODS if not x[1].client_streaming],
    ids=[f"{s.name}.{m.name}" for s, m, _ in METHODS if not m.client_streaming],
)
def test_a_body_that_does_not_parse_is_invalid_argument_naming_the_type(cl, svc, m, where):
    """Invalid UTF-8 in the request's first string field (or, without one, a truncated field): INVALID_ARGUMENT
    "request: the body does not parse as <type>", not grpc's INTERNAL."""
    body = _bad_utf8(m.input_type, b"", b"x")
    if body == b"":
        body = b"\x0a\x05"  # field 1, length 5, no bytes follow
    assert not _parses(_cls(m.input_type), body)
    code, details = _call(cl, svc, m, where, body)
    assert (code, details.split(":")[0]) == (C.INVALID_ARGUMENT, "request"), (code, details)
    assert m.input_type.full_name in details, details


def test_huge_repeated_fields_are_refused_by_validation(cl):
    """1e6 ids (a few MB: under the 64 MiB message limit) in every repeated id field, and 4e6 characters of
    text: INVALID_ARGUMENT naming the field, at once (the length is checked before any list is built)."""
    n = 1_000_000
    r = prefill_pb2.PrefillRequest(session_id="big", prompt_ids=[5, 6, 7], decode_target=cl.addr["decode-0"])
    _call(cl, *_m("PrefillWorker", "Prefill"), r.SerializeToString())  # a session "big" on D (FAST)
    stops = router_pb2.GenerateRequest(text="a", max_new_tokens=4)
    stops.stop_token_ids.extend([1] * n)
    cases = [
        (
            "Router",
            "Generate",
            router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1] * n), max_new_tokens=4),
            "prompt",
        ),
        ("Router", "Generate", router_pb2.GenerateRequest(text="x" * (4 * n), max_new_tokens=4), "prompt"),
        ("Router", "Generate", stops, "stop_token_ids"),
        ("PrefillWorker", "Prefill", prefill_pb2.PrefillRequest(prompt_ids=[1] * n), "prompt_ids"),
        ("PrefillWorker", "Verify", prefill_pb2.VerifyRequest(session_id="big", tokens=[1] * n), "tokens"),
        (
            "DecodeWorker",
            "Decode",
            decode_pb2.DecodeRequest(session_id="big", max_new_tokens=1, stop_token_ids=[1] * n),
            "stop_token_ids",
        ),
    ]
    try:
        for svc, meth, req, field in cases:
            t0 = time.monotonic()
            code, details = _call(cl, *_m(svc, meth), req.SerializeToString())
            assert (code, details.split(":")[0]) == (C.INVALID_ARGUMENT, field), (meth, code, details)
            assert time.monotonic() - t0 < 3.0
    finally:
        cl.release("decode-0", "big")


def _m(service: str, method: str):
    svc, where = next((s, w) for s, _, w in METHODS if s.name == service)
    return svc, svc.methods_by_name[method], where


def test_zz_servers_stay_bounded_healthy_and_serving(cl):
    """After everything above: RSS within RSS_GROWTH_MIB of the start, every server SERVING, no session
    left (the TTL reaps the ones a fuzzed FAST Prefill left without a usable id), a normal request served."""
    grown = {n: rss_mib(cl.pid(n)) - cl.rss0[n] for n in cl.rss0}
    print("fuzz: RSS growth MiB", {n: round(g, 1) for n, g in grown.items()}, "from", cl.rss0)
    assert all(g < RSS_GROWTH_MIB for g in grown.values()), grown
    from deploy.processes import health_status

    for addr in (cl.router_addr, *cl.addr.values()):
        assert health_status(addr) == "SERVING", addr
    cl.wait_no_sessions(TTL + 4)
    deltas = list(cl.client.generate("def f(x):", max_new_tokens=8, mode="exact", timeout=30))
    assert len(tokens(deltas)) >= 1 and deltas[-1].finish_reason in ("LENGTH", "EOS")
