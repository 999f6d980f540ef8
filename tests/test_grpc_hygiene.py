"""gRPC hygiene (issue 24), over real loopback sockets:

1. keepalive: every channel-arg name Baton passes is one grpc core knows (a misspelt one is silently
   ignored); with a 1 s client keepalive an idle channel stays READY (channel.subscribe) and its next
   call is immediate, while a server with the old misspelt option sends GOAWAY too_many_pings;
2. the router's public port refuses a 5 MiB request with RESOURCE_EXHAUSTED (default 4 MiB,
   `--max-request-bytes` raises it) and its RSS grows < 50 MB (a real `python -m router` process);
   other servers keep BATON_MAX_MESSAGE_BYTES;
3. a body that does not parse is INVALID_ARGUMENT naming the message type (never INTERNAL), never
   reaches the servicer, and logs one line (no traceback), rate-limited;
4. ChannelPool holds at most its bound, closes evicted idle channels, and never closes a channel under
   a running push (handoff.start_push to a receiver that holds the stream open).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from conftest import pick_free_port
from helpers import make_tiny_dir
from realcluster import child_env, rss_mib

from baton import rpc
from baton.engine.state import StateTensor
from baton.handoff import push as handoff
from baton.handoff.channels import ChannelPool
from baton.rpc_guard import RateLimitedLog
from baton.settings import Settings, SettingsError
from baton.v1 import common_pb2, decode_pb2, router_pb2, router_pb2_grpc

C = grpc.StatusCode
ROOT = Path(__file__).resolve().parents[1]
T = 5.0
BAD_UTF8 = b"\x12\x02\xff\xfe"  # GenerateRequest.text (field 2) holding invalid UTF-8


class Router(router_pb2_grpc.RouterServicer):
    def __init__(self):
        self.calls = 0

    def GetModelInfo(self, request, context):
        self.calls += 1
        return router_pb2.ModelInfo(model_id="fake")

    def Generate(self, request, context):
        self.calls += 1
        yield router_pb2.GenerateResponse(token_ids=[1])


def _serve(settings: Settings | None = None, **kw):
    router = Router()
    h = rpc.build_server(
        [(router_pb2_grpc.add_RouterServicer_to_server, router)],
        service_names=["baton.v1.Router"],
        settings=settings or Settings(),
        max_workers=4,
        **kw,
    )
    return h, router


# ---- 1. keepalive and option names ----------------------------------------------------------------------
def _core_arg_names() -> bytes:
    import grpc._cython as cy

    so = next(Path(cy.__file__).parent.glob("cygrpc*.so"))
    return so.read_bytes()


def _known(name: str, blob: bytes) -> bool:
    """`name` is a NUL-terminated string of grpc core (GRPC_ARG_* values live in its .rodata)."""
    return re.search(rb"(?<![a-z_.])" + re.escape(name.encode()) + rb"\x00", blob) is not None


def test_every_grpc_option_name_is_known_to_grpc_core():
    from router.registry import _CHANNEL_OPTIONS

    blob = _core_arg_names()
    assert _known("grpc.keepalive_time_ms", blob) and not _known("grpc.keepalive_tme_ms", blob)  # the probe works
    assert not _known("grpc.http2.min_recv_ping_interval_without_data_ms", blob)  # the old typo
    s = Settings()
    used = {k for k, _ in rpc._server_options(s) + rpc._client_options(s) + rpc._message_options(s) + _CHANNEL_OPTIONS}
    # and every "grpc.*" string literal in runtime code, however it is passed (service names aside)
    for d in ("baton", "router", "prefill_worker", "decode_worker", "deploy", "benchmarks"):
        for f in (ROOT / d).rglob("*.py"):
            if not f.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                used |= {
                    n
                    for n in re.findall(r"""["'](grpc\.[a-z0-9_.]+)["']""", f.read_text())
                    if not n.startswith(("grpc.health.", "grpc.reflection."))
                }
    assert "grpc.http2.min_ping_interval_without_data_ms" in used
    unknown = sorted(n for n in used if not _known(n, blob))
    assert not unknown, f"grpc core does not know {unknown}: a misspelt channel argument is silently ignored"


def _watch_idle(address: str, settings: Settings, idle_s: float, out: dict) -> None:
    """One call, `idle_s` seconds of nothing, one call; connectivity states and the second call's time."""
    ch = rpc.make_channel(address, settings)
    t0 = time.monotonic()
    states: list[tuple[float, str]] = []
    ch.subscribe(lambda s: states.append((round(time.monotonic() - t0, 2), s.name)), try_to_connect=True)
    try:
        stub = router_pb2_grpc.RouterStub(ch)
        stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T)
        # the subscription's callbacks come on grpc's own thread: READY may be recorded after the call
        # returned (seen once in a full run: both at 0.0 s, READY counted as idle); wait for it, then
        # watch every state after the first READY
        end = time.monotonic() + T
        while "READY" not in (s for _, s in states) and time.monotonic() < end:
            time.sleep(0.01)
        ready_at = next((i + 1 for i, (_, s) in enumerate(states) if s == "READY"), len(states))
        time.sleep(idle_s)
        after_idle = list(states[ready_at:])
        t1 = time.monotonic()
        stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=T)
        out.update(states=list(states), after_ready=after_idle, next_call_s=time.monotonic() - t1)
    finally:
        ch.close()


def test_an_idle_channel_with_a_short_keepalive_stays_ready():
    """Client keepalive 1 s, servers accept pings every 0.5 s: idle for 4.5 s (4 pings), the channel never
    leaves READY (no GOAWAY) and the next call goes out at once. The control, a server built with the old
    misspelt option (so grpc's 5-minute minimum), strikes the same pings and sends GOAWAY too_many_pings
    after ~3 s: the channel drops to IDLE. Both run at once."""
    fast = Settings(keepalive_time_ms=1000, keepalive_timeout_ms=2000, min_ping_interval_ms=500)
    h, _ = _serve(fast)
    old = grpc.server(
        futures.ThreadPoolExecutor(2),
        options=[
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ],
    )
    router_pb2_grpc.add_RouterServicer_to_server(Router(), old)
    old_port = old.add_insecure_port("127.0.0.1:0")
    old.start()
    got, ctl = {}, {}
    try:
        threads = [
            threading.Thread(target=_watch_idle, args=(h.address, fast, 4.5, got)),
            threading.Thread(target=_watch_idle, args=(f"127.0.0.1:{old_port}", fast, 4.5, ctl)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        h.stop(0)
        old.stop(0)
    assert got["states"][-1][1] == "READY", got
    assert got["after_ready"] == [], f"the channel left READY while idle: {got}"
    assert got["next_call_s"] < 0.5, got
    assert any(s == "IDLE" for _, s in ctl["after_ready"]), f"control: no GOAWAY from the old option: {ctl}"


def test_keepalive_settings_come_from_the_environment_and_must_agree():
    s = Settings.from_env(
        {
            "BATON_KEEPALIVE_TIME_MS": "2000",
            "BATON_KEEPALIVE_TIMEOUT_MS": "700",
            "BATON_MIN_PING_INTERVAL_MS": "1500",
            "BATON_MAX_REQUEST_BYTES": "1048576",
        }
    )
    assert (s.keepalive_time_ms, s.keepalive_timeout_ms, s.min_ping_interval_ms, s.max_request_bytes) == (
        2000,
        700,
        1500,
        1 << 20,
    )
    assert dict(rpc._server_options(s))["grpc.http2.min_ping_interval_without_data_ms"] == 1500
    assert dict(rpc._client_options(s))["grpc.keepalive_time_ms"] == 2000
    d = Settings.from_env({})
    assert (d.keepalive_time_ms, d.min_ping_interval_ms, d.max_request_bytes) == (30_000, 10_000, 4 << 20)
    with pytest.raises(SettingsError, match="BATON_MIN_PING_INTERVAL_MS"):  # servers would GOAWAY own clients
        Settings.from_env({"BATON_KEEPALIVE_TIME_MS": "5000"})
    with pytest.raises(SettingsError, match="BATON_MAX_REQUEST_BYTES"):
        Settings.from_env({"BATON_MAX_REQUEST_BYTES": "0"})


# ---- 2. the router's public message limit -----------------------------------------------------------------
def _packed_ids_request(n_bytes: int) -> bytes:
    """A GenerateRequest of ~n_bytes: token_ids with one-byte packed varints (the worst case for parsing)."""
    ids = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[7] * n_bytes), max_new_tokens=1)
    return ids.SerializeToString()


def _start_router(tiny, *args) -> subprocess.Popen:
    env = child_env()
    env.pop("BATON_MAX_REQUEST_BYTES", None)
    env.pop("BATON_MAX_MESSAGE_BYTES", None)
    dead = [f"127.0.0.1:{pick_free_port()}" for _ in range(2)]  # no workers: refused before any is needed
    p = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "router",
            "--port",
            "0",
            "--prefill",
            dead[0],
            "--decode",
            dead[1],
            "--model",
            str(tiny),
            *args,
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return p


def _address(p: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        m = re.search(r"serving on (\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError(f"router exited ({p.poll()}) without a serving line")


def _generate(address: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(address, options=opts) as ch:
        try:
            list(ch.unary_stream("/baton.v1.Router/Generate", None, None)(body, timeout=30))
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return C.OK, ""


def test_the_router_refuses_a_5mib_request_without_growing(tmp_path):
    """`python -m router` with its defaults: a 5 MiB request (packed ids, which parse ~10x larger) is
    RESOURCE_EXHAUSTED and three of them grow the router's RSS by < 50 MB; 3 MiB still passes the transport
    (validation then refuses the prompt). With `--max-request-bytes 8388608` the 5 MiB body is parsed and
    reaches validation instead."""
    tiny = make_tiny_dir(tmp_path)
    default = _start_router(tiny)
    raised = _start_router(tiny, "--max-request-bytes", str(8 << 20))
    try:
        addr, addr8 = _address(default), _address(raised)
        big, small = _packed_ids_request(5 << 20), _packed_ids_request(3 << 20)
        assert len(big) > 5 << 20 and len(small) < 4 << 20
        assert _generate(addr, _packed_ids_request(100))[0] == C.UNAVAILABLE  # no workers; warms grpc up
        time.sleep(0.3)
        rss0 = rss_mib(default.pid)
        for _ in range(3):
            code, details = _generate(addr, big)
            assert code == C.RESOURCE_EXHAUSTED, (code, details)
        time.sleep(0.3)
        grown = rss_mib(default.pid) - rss0
        print(f"router RSS growth after 3 x 5 MiB: {grown:.1f} MiB")  # 1.3 here; 15 with the 64 MiB limit
        assert grown * 1.048576 < 50, f"router RSS grew {grown:.1f} MiB"
        code, details = _generate(addr, small)
        assert (code, details.split(":")[0]) == (C.INVALID_ARGUMENT, "prompt"), (code, details)
        code, details = _generate(addr8, big)
        assert (code, details.split(":")[0]) == (C.INVALID_ARGUMENT, "prompt"), (code, details)
    finally:
        for p in (default, raised):
            p.terminate()
        for p in (default, raised):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_other_servers_keep_the_internal_message_limit():
    """build_server without max_receive_bytes (the workers): BATON_MAX_MESSAGE_BYTES, 64 MiB by default, so a
    5 MiB message (an unknown field: parses) is served; with max_receive_bytes=4 MiB it is refused."""
    body = b"\x7a" + bytes([0x80, 0x80, 0xC0, 0x02]) + b"x" * (5 << 20)  # field 15, length-delimited, 5 MiB
    opts = [("grpc.max_send_message_length", -1)]
    for limit, want in ((None, C.OK), (4 << 20, C.RESOURCE_EXHAUSTED)):
        h, _ = _serve(max_receive_bytes=limit)
        try:
            with grpc.insecure_channel(h.address, options=opts) as ch:
                try:
                    ch.unary_unary("/baton.v1.Router/GetModelInfo", None, None)(body, timeout=T)
                    code = C.OK
                except grpc.RpcError as e:
                    code = e.code()
            assert code == want, (limit, code)
        finally:
            h.stop(0)


# ---- 3. bodies that do not parse --------------------------------------------------------------------------
class _Streams:
    """A service of our own with a deserializing client stream, to cover the streaming-request shapes."""

    def __init__(self):
        self.seen = 0

    def Sum(self, request_iterator, context):  # stream_unary that swallows errors
        try:
            for _ in request_iterator:
                self.seen += 1
        except Exception:  # noqa: BLE001 - a servicer that maps everything to a code of its own
            context.abort(C.DATA_LOSS, "swallowed")
        return router_pb2.ModelInfo(model_id=str(self.seen))

    def Echo(self, request_iterator, context):  # stream_stream
        for r in request_iterator:
            yield router_pb2.GenerateResponse(text=r.text)


def _add_streams(servicer, server):
    kw = dict(request_deserializer=router_pb2.GenerateRequest.FromString)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Streams",
                {
                    "Sum": grpc.stream_unary_rpc_method_handler(
                        servicer.Sum, response_serializer=router_pb2.ModelInfo.SerializeToString, **kw
                    ),
                    "Echo": grpc.stream_stream_rpc_method_handler(
                        servicer.Echo, response_serializer=router_pb2.GenerateResponse.SerializeToString, **kw
                    ),
                },
            ),
        )
    )


def test_a_body_that_does_not_parse_is_invalid_argument_naming_the_type(caplog):
    streams = _Streams()
    router = Router()
    h = rpc.build_server(
        [(router_pb2_grpc.add_RouterServicer_to_server, router), (_add_streams, streams)],
        service_names=["baton.v1.Router"],
        settings=Settings(token="t"),
        max_workers=4,
    )
    md = (("authorization", "Bearer t"),)
    good = router_pb2.GenerateRequest(text="ok").SerializeToString()
    caplog.set_level(logging.INFO)
    t0 = time.monotonic()
    try:
        with grpc.insecure_channel(h.address) as ch:

            def code(fn, *a):
                try:
                    r = fn(*a, timeout=T, metadata=md)
                    if hasattr(r, "__next__"):
                        list(r)
                except grpc.RpcError as e:
                    return e.code(), e.details()
                return C.OK, ""

            gen = ch.unary_stream("/baton.v1.Router/Generate", None, None)
            info = ch.unary_unary("/baton.v1.Router/GetModelInfo", None, None)
            total = ch.stream_unary("/test.Streams/Sum", None, None)
            echo = ch.stream_stream("/test.Streams/Echo", None, None)
            health = ch.unary_unary("/grpc.health.v1.Health/Check", None, None)
            cases = [
                (gen, BAD_UTF8, "baton.v1.GenerateRequest"),
                (info, b"\x0a\x05", "baton.v1.GetModelInfoRequest"),
                (total, iter([good, BAD_UTF8, good]), "baton.v1.GenerateRequest"),
                (echo, iter([good, BAD_UTF8]), "baton.v1.GenerateRequest"),
                (health, b"\x0a\x01\xff", "grpc.health.v1.HealthCheckRequest"),
            ]
            for fn, body, type_name in cases:
                c, details = code(fn, body)
                assert c == C.INVALID_ARGUMENT, (type_name, c, details)
                assert details.startswith(f"request: the body does not parse as {type_name}"), details
            assert router.calls == 0  # the servicer never saw them
            assert code(gen, good) == (C.OK, "") and code(total, iter([good, good])) == (C.OK, "")
            assert code(ch.unary_stream("/baton.v1.Router/Generate", None, None), BAD_UTF8)[0] == C.INVALID_ARGUMENT
            for _ in range(40):  # a flood: a few lines, not 40 tracebacks
                assert code(gen, BAD_UTF8)[0] == C.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as ei:  # unauthenticated: refused before parsing
                list(gen(BAD_UTF8, timeout=T))
            assert ei.value.code() == C.UNAUTHENTICATED
            took = time.monotonic() - t0
    finally:
        h.stop(0)
    lines = [r for r in caplog.records if r.name == "baton.rpc"]
    assert lines and all(r.exc_info is None and "Traceback" not in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    assert not any("Exception deserializing" in r.getMessage() for r in caplog.records)
    assert 5 <= len(lines) <= 5 + took + 1, (took, [r.getMessage() for r in lines])  # burst 5, then 1/s
    assert "GenerateRequest" in lines[0].getMessage() and "ipv4:127.0.0.1" in lines[0].getMessage()


def test_rate_limited_log_counts_what_it_suppressed(caplog):
    t = [0.0]
    log = RateLimitedLog(logging.getLogger("baton.test"), per_s=1.0, burst=2, clock=lambda: t[0])
    caplog.set_level(logging.WARNING, logger="baton.test")
    written = [log.warning("bad %d", i) for i in range(10)]
    assert written == [True, True] + [False] * 8
    t[0] = 1.0
    assert log.warning("bad %d", 10) and not log.warning("bad %d", 11)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["bad 0", "bad 1", "bad 10 (8 more suppressed)"], msgs


# ---- 4. the bounded channel pool -----------------------------------------------------------------------
def _closed(ch: grpc.Channel) -> bool:
    try:
        ch.unary_unary("/x.Y/Z")(b"", timeout=0.001)
    except ValueError:  # "Cannot invoke RPC on closed channel!"
        return True
    except grpc.RpcError:
        return False
    return False


def test_a_pool_given_many_addresses_holds_at_most_its_bound():
    made: list[grpc.Channel] = []
    pool = ChannelPool(max_channels=8, factory=lambda a, s: made.append(rpc.make_channel(a, s)) or made[-1])
    s = Settings()
    addrs = [f"127.0.0.1:{20000 + i}" for i in range(100)]
    for a in addrs:
        with pool.lease(a, s) as ch:
            assert ch is made[-1] and not _closed(ch)
        assert len(pool) <= 8 and pool.open_channels() <= 8
    assert len(made) == 100 and sum(_closed(ch) for ch in made) == 92
    assert all(not _closed(ch) for ch in made[-8:])  # the 8 most recently used
    hot = pool.get(addrs[-8], s)  # LRU: a use keeps it
    for a in (f"127.0.0.1:{21000 + i}" for i in range(7)):
        pool.get(a, s)
    assert pool.get(addrs[-8], s) is hot and not _closed(hot) and len(made) == 107
    pool.close()
    assert len(pool) == 0 and all(_closed(ch) for ch in made)
    with pytest.raises(ValueError):
        ChannelPool(max_channels=0)


class _SlowReceiver:
    """LoadState (raw frames, as decode_worker registers it) that holds the stream open until `go`."""

    def __init__(self):
        self.first, self.go, self.frames = threading.Event(), threading.Event(), 0

    def LoadState(self, request_iterator, context):
        for _ in request_iterator:
            self.frames += 1
            self.first.set()
            self.go.wait(T)
        return decode_pb2.LoadStateResponse(session_id="s", position=1)


def _add_receiver(servicer, server):
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "baton.v1.DecodeWorker",
                {
                    "LoadState": grpc.stream_unary_rpc_method_handler(
                        servicer.LoadState,
                        request_deserializer=None,
                        response_serializer=decode_pb2.LoadStateResponse.SerializeToString,
                    )
                },
            ),
        )
    )


@pytest.mark.parametrize("bound", [1, 2])
def test_a_channel_in_use_is_never_closed_under_a_running_push(bound):
    """A push to a receiver that holds the stream open, then 20 other targets through a pool of `bound`
    channels: bound 2 evicts the idle ones around it (it stays cached); bound 1 must drop it from the cache
    but closes it only when the push has ended. The push completes OK either way."""
    rx = _SlowReceiver()
    h = rpc.build_server([(_add_receiver, rx)], service_names=["baton.v1.DecodeWorker"], max_workers=4)
    pool = ChannelPool(max_channels=bound)
    s = Settings()
    tensors = [StateTensor("layers.0.recurrent", "gdn_recurrent", torch.arange(64 * 1024, dtype=torch.float32))]
    try:
        push = handoff.start_push(
            h.address,
            s,
            tensors=tensors,
            session_id="s",
            fingerprint="f",
            position=1,
            next_token=0,
            chunk_bytes=16 * 1024,
            timeout=T,
            pool=pool,
        )
        assert rx.first.wait(T)
        pushed = pool.get(h.address, s)
        others = [pool.get(f"127.0.0.1:{22000 + i}", s) for i in range(20)]
        assert len(pool) <= bound and not _closed(pushed)
        assert sum(_closed(ch) for ch in others) >= 20 - bound
        if bound == 1:
            assert pool.open_channels() == 2  # the cached one + the pushed one, still open
        rx.go.set()
        resp, _ = push.result()
        assert resp.session_id == "s" and rx.frames >= 3  # header, data..., trailer: all went through
        deadline = time.monotonic() + T
        while bound == 1 and not _closed(pushed) and time.monotonic() < deadline:
            time.sleep(0.01)  # the done callback returns the lease
        assert _closed(pushed) == (bound == 1) and pool.open_channels() <= bound
    finally:
        rx.go.set()
        pool.close()
        h.stop(0)
