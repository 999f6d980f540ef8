"""baton.rpc over real loopback sockets: auth on all call shapes, health, reflection, TLS, limits."""

import socket
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from helpers import self_signed_cert

from baton import rpc
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc, state_pb2

TOKEN = "s3cret-token"
T = 5  # seconds; every call has a deadline


class FakeRouter(router_pb2_grpc.RouterServicer):
    def __init__(self):
        self.calls = 0

    def GetModelInfo(self, request, context):
        self.calls += 1
        return router_pb2.ModelInfo(model_id="fake", vocab_size=7)

    def Generate(self, request, context):
        self.calls += 1
        with rpc.rpc_errors(context, {KeyError: grpc.StatusCode.NOT_FOUND}):
            if request.max_new_tokens == 0:
                raise rpc.StatusError(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be > 0")
            if request.request_id == "missing":
                raise KeyError("request_id: no such session")
            for i in range(request.max_new_tokens):
                yield router_pb2.GenerateResponse(token_ids=[i])


class FakeDecode(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self):
        self.calls = 0

    def LoadState(self, request_iterator, context):
        self.calls += 1
        n = sum(1 for _ in request_iterator)
        return decode_pb2.LoadStateResponse(session_id="s", position=n)


def _start(settings, **kw):
    router, decode = FakeRouter(), FakeDecode()
    handle = rpc.build_server(
        [
            (router_pb2_grpc.add_RouterServicer_to_server, router),
            (decode_pb2_grpc.add_DecodeWorkerServicer_to_server, decode),
        ],
        service_names=["baton.v1.Router", "baton.v1.DecodeWorker"],
        port=0,
        settings=settings,
        max_workers=4,
        **kw,
    )
    return handle, router, decode


@pytest.fixture
def secured():
    handle, router, decode = _start(Settings(token=TOKEN))
    yield handle, router, decode
    handle.stop(0)


def _code(call):
    with pytest.raises(grpc.RpcError) as ei:
        call()
    return ei.value.code(), ei.value.details()


def _chunks():
    yield state_pb2.StateChunk(header=state_pb2.StateHeader(session_id="s"))
    yield state_pb2.StateChunk(data=b"\x00" * 16)


def test_unary_without_or_with_wrong_token_is_unauthenticated(secured):
    handle, router, _ = secured
    for settings in (Settings(), Settings(token="wrong")):
        with rpc.make_channel(handle.address, settings) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            got = _code(lambda: stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T))
            assert got == (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
    # a bare "Bearer" prefix or the raw token without the scheme is not enough either
    with grpc.insecure_channel(handle.address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for md in ((("authorization", TOKEN),), (("authorization", "Bearer "),)):
            got = _code(lambda: stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T, metadata=md))
            assert got[0] == grpc.StatusCode.UNAUTHENTICATED
    assert router.calls == 0  # the servicer never ran


def test_right_token_passes(secured):
    handle, router, _ = secured
    with rpc.make_channel(handle.address, Settings(token=TOKEN)) as ch:
        info = router_pb2_grpc.RouterStub(ch).GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T)
    assert info.model_id == "fake" and info.vocab_size == 7
    # explicit metadata on a plain channel works the same
    with grpc.insecure_channel(handle.address) as ch:
        info = router_pb2_grpc.RouterStub(ch).GetModelInfo(
            router_pb2.GetModelInfoRequest(), timeout=T, metadata=rpc.call_metadata(TOKEN)
        )
    assert info.model_id == "fake"
    assert router.calls == 2
    assert rpc.call_metadata(None) == () and rpc.call_metadata("") == ()


def test_streaming_calls_are_protected(secured):
    handle, router, decode = secured
    req = router_pb2.GenerateRequest(text="hi", max_new_tokens=3)
    with rpc.make_channel(handle.address, Settings()) as ch:
        got = _code(lambda: list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=T)))
        assert got == (grpc.StatusCode.UNAUTHENTICATED, rpc.AUTH_FAILED)
        got = _code(lambda: decode_pb2_grpc.DecodeWorkerStub(ch).LoadState(_chunks(), timeout=T))
        assert got[0] == grpc.StatusCode.UNAUTHENTICATED
    assert router.calls == 0 and decode.calls == 0
    with rpc.make_channel(handle.address, Settings(token=TOKEN)) as ch:
        out = list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=T))
        assert [r.token_ids[0] for r in out] == [0, 1, 2]
        resp = decode_pb2_grpc.DecodeWorkerStub(ch).LoadState(_chunks(), timeout=T)
        assert resp.position == 2


def test_rpc_errors_maps_to_status(secured):
    handle, _, _ = secured
    with rpc.make_channel(handle.address, Settings(token=TOKEN)) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        got = _code(lambda: list(stub.Generate(router_pb2.GenerateRequest(max_new_tokens=0), timeout=T)))
        assert got == (grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be > 0")
        req = router_pb2.GenerateRequest(request_id="missing", max_new_tokens=1)
        got = _code(lambda: list(stub.Generate(req, timeout=T)))
        assert got[0] == grpc.StatusCode.NOT_FOUND and "request_id" in got[1]


def _check(ch, service="", metadata=()):
    stub = health_pb2_grpc.HealthStub(ch)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=T, metadata=metadata).status


def test_health_follows_set_serving_and_is_open_by_default(secured):
    handle, _, _ = secured
    S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(handle.address) as ch:  # no token: probes stay reachable
        assert _check(ch) == N and _check(ch, "baton.v1.Router") == N
        handle.set_serving(True)
        assert _check(ch) == S and _check(ch, "baton.v1.Router") == S
        assert _check(ch, "baton.v1.DecodeWorker") == S
        handle.set_serving(False)
        assert _check(ch) == N and _check(ch, "baton.v1.DecodeWorker") == N
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert {"baton.v1.Router", "baton.v1.DecodeWorker", "grpc.health.v1.Health"} <= set(services)


def test_protect_health_requires_token():
    handle, _, _ = _start(Settings(token=TOKEN), protect_health=True, serving=True)
    try:
        with grpc.insecure_channel(handle.address) as ch:
            assert _code(lambda: _check(ch))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert _check(ch, metadata=rpc.call_metadata(TOKEN)) == health_pb2.HealthCheckResponse.SERVING
    finally:
        handle.stop(0)


def test_stop_turns_health_not_serving_and_closes_port():
    handle, _, _ = _start(Settings(), serving=True)
    port = handle.port
    handle.stop(0)
    assert handle.health  # servicer left in graceful shutdown; set() is ignored from now on
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_default_bind_is_loopback_only():
    assert Settings().host == "127.0.0.1" and Settings.from_env({}).host == "127.0.0.1"
    handle, _, _ = _start(Settings())
    try:
        assert handle.host == "127.0.0.1" and handle.port > 0
        assert handle.address == f"127.0.0.1:{handle.port}"
        socket.create_connection(("127.0.0.1", handle.port), timeout=1).close()
        # another loopback address reaches the same interface but not a 127.0.0.1-bound socket
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", handle.port), timeout=1).close()
    finally:
        handle.stop(0)


def test_taken_port_is_refused():
    handle, _, _ = _start(Settings())
    try:
        with pytest.raises(OSError):
            rpc.build_server([], service_names=[], port=handle.port, settings=Settings())
    finally:
        handle.stop(0)


def test_message_limit_applies():
    handle, _, decode = _start(Settings(max_message_bytes=1024))
    try:
        big = lambda: iter([state_pb2.StateChunk(data=b"\x01" * 4096)])  # noqa: E731
        with rpc.make_channel(handle.address, Settings(max_message_bytes=1 << 20)) as ch:
            got = _code(lambda: decode_pb2_grpc.DecodeWorkerStub(ch).LoadState(big(), timeout=T))
        assert got[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        handle.stop(0)


def test_max_concurrent_rpcs_answers_resource_exhausted():
    gate, entered = threading.Event(), threading.Event()

    class Slow(router_pb2_grpc.RouterServicer):
        def GetModelInfo(self, request, context):
            entered.set()
            gate.wait(T)
            return router_pb2.ModelInfo(model_id="slow")

    handle = rpc.build_server(
        [(router_pb2_grpc.add_RouterServicer_to_server, Slow())],
        service_names=["baton.v1.Router"],
        settings=Settings(),
        max_workers=4,
        max_concurrent_rpcs=1,
    )
    try:
        with rpc.make_channel(handle.address, Settings()) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            first = stub.GetModelInfo.future(router_pb2.GetModelInfoRequest(), timeout=T)
            assert entered.wait(T)  # the first RPC holds the only slot
            got = _code(lambda: stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T))
            gate.set()
            assert got[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert first.result().model_id == "slow"
    finally:
        gate.set()
        handle.stop(0)


# ---------------------------------------------------------------- TLS
def test_tls_call_succeeds_and_plaintext_fails(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    server_settings = Settings(token=TOKEN, tls_cert=cert, tls_key=key)
    handle, router, _ = _start(server_settings)
    try:
        with rpc.make_channel(handle.address, Settings(token=TOKEN, tls_ca=cert)) as ch:
            info = router_pb2_grpc.RouterStub(ch).GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T)
        assert info.model_id == "fake"
        with rpc.make_channel(handle.address, Settings(token=TOKEN)) as ch:  # plaintext to a TLS port
            got = _code(
                lambda: router_pb2_grpc.RouterStub(ch).GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T)
            )
        assert got[0] == grpc.StatusCode.UNAVAILABLE
        assert router.calls == 1
    finally:
        handle.stop(0)


def test_mutual_tls_requires_client_cert(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    handle, _, _ = _start(Settings(tls_cert=cert, tls_key=key, tls_ca=cert), serving=True)
    try:
        with rpc.make_channel(handle.address, Settings(tls_ca=cert)) as ch:  # no client cert
            assert _code(lambda: _check(ch))[0] == grpc.StatusCode.UNAVAILABLE
        with rpc.make_channel(handle.address, Settings(tls_ca=cert, tls_cert=cert, tls_key=key)) as ch:
            assert _check(ch) == health_pb2.HealthCheckResponse.SERVING
    finally:
        handle.stop(0)


def test_common_messages_roundtrip():
    r = common_pb2.BridgeReport(total_bytes=10, bytes_by_kind={"gdn_conv": 4, "attn_kv": 6})
    assert common_pb2.BridgeReport.FromString(r.SerializeToString()).bytes_by_kind["attn_kv"] == 6


def test_refused_tokens_are_logged_with_method_peer_and_why_rate_limited(secured, caplog):
    handle, router, _ = secured
    caplog.set_level("WARNING", logger="baton.rpc")
    for settings in (Settings(), Settings(token="wrong")):
        with rpc.make_channel(handle.address, settings) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            _code(lambda: stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T))
    lines = [r.getMessage() for r in caplog.records if r.name == "baton.rpc"]
    assert len(lines) == 2, lines
    assert (
        lines[0].startswith("refused /baton.v1.Router/GetModelInfo from ipv") and "no authorization header" in lines[0]
    )
    assert "a bearer token that does not match" in lines[1] and TOKEN not in lines[1] and "wrong" not in lines[1]
    caplog.clear()
    with rpc.make_channel(handle.address, Settings(token="wrong")) as ch:  # a flood: a few lines, then 1 a second
        stub = router_pb2_grpc.RouterStub(ch)
        for _ in range(40):
            _code(lambda: stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T))
    assert 1 <= len([r for r in caplog.records if r.name == "baton.rpc"]) <= 6
    assert router.calls == 0
