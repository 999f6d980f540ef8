"""Router health (Check + Watch flipping with worker health), auth, graceful stop, the registry's
choice and Ray discovery, and the Prometheus endpoint."""

import sys
import threading
import time
import types
import urllib.request

import fakes
import grpc
import pytest
from fakes import Cluster, reference
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.client import Client
from baton.settings import Settings
from router import registry as registry_mod
from router.registry import NoWorker, Registry

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _status(addr, service=""):
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def _wait_status(addr, want, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _status(addr) == want and _status(addr, "baton.v1.Router") == want:
            return True
        time.sleep(0.05)
    return False


def test_health_follows_workers_and_watch_sees_it():
    c = Cluster(n_prefill=1, n_decode=1)
    seen, ch = [], grpc.insecure_channel(c.address)
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="baton.v1.Router"))

    def follow():
        try:
            for r in watch:
                seen.append(r.status)
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    try:
        assert _wait_status(c.address, SERVING)
        c.decode[0].handle.set_serving(False)  # decode worker not ready
        assert _wait_status(c.address, NOT_SERVING)
        c.decode[0].handle.set_serving(True)
        assert _wait_status(c.address, SERVING)
        port = c.decode[0].handle.port
        c.decode[0].stop()  # decode worker gone
        assert _wait_status(c.address, NOT_SERVING)
        c.decode[0] = fakes.decode_worker(c.settings, port=port)  # back on the same address
        assert _wait_status(c.address, SERVING, timeout=5)
        assert c.run([1, 2], max_new_tokens=4)[0] == reference([1, 2], 4)
        c.prefill[0].handle.set_serving(False)
        assert _wait_status(c.address, NOT_SERVING)
        time.sleep(0.2)
        assert seen[:5] == [SERVING, NOT_SERVING, SERVING, NOT_SERVING, SERVING], seen
        assert seen[-1] == NOT_SERVING
    finally:
        watch.cancel()
        ch.close()
        c.close()


def test_not_serving_without_reachable_workers():
    from router.__main__ import serve_router, stop_router
    from router.service import ModelMeta

    dead = f"127.0.0.1:{__import__('conftest').pick_free_port()}"
    handle, servicer = serve_router(
        prefill=[dead], decode=[dead], meta=ModelMeta("fake", 100, (99,)), settings=Settings(), poll_interval=0.1
    )
    try:
        assert _status(handle.address) == NOT_SERVING
        with Client(handle.address, settings=Settings()) as cl:
            assert cl.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as ei:
                list(cl.generate([1, 2], max_new_tokens=3, timeout=5))
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_router(handle, servicer, 0)


def test_auth_token_required_everywhere():
    c = Cluster(token="s3cret")
    try:
        with Client(c.address, settings=Settings()) as anon:
            for call in (lambda: list(anon.generate([1, 2], max_new_tokens=3, timeout=5)), anon.model_info):
                with pytest.raises(grpc.RpcError) as ei:
                    call()
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert anon.health() == "SERVING"  # probes stay open
        with Client(c.address, settings=Settings(token="wrong")) as bad:
            with pytest.raises(grpc.RpcError) as ei:
                list(bad.generate([1, 2], max_new_tokens=3, timeout=5))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the router's own token reaches the (token-protected) fake workers
        assert c.run([1, 2], max_new_tokens=5, mode="exact")[0] == reference([1, 2], 5)
    finally:
        c.close()


def test_graceful_stop_finishes_in_flight_requests():
    from router.__main__ import stop_router

    c = Cluster(n_prefill=1, n_decode=1)
    try:
        c.decode[0].servicer.delay = 0.02
        stream = c.client.generate([3, 4], max_new_tokens=30, timeout=10)
        first = next(stream)
        stopper = threading.Thread(target=stop_router, args=(c.handle, c.servicer, 5.0))
        stopper.start()
        time.sleep(0.1)
        assert c.client.health() != "SERVING"  # new calls are refused
        rest = [t for d in stream for t in d.token_ids]
        assert first.token_ids + rest == reference([3, 4], 30)
        stopper.join(5)
        assert not stopper.is_alive()
        assert c.wait_sessions_zero()
    finally:
        c.client.close()
        for w in c.workers:
            w.stop()


def test_metrics_endpoint():
    from conftest import pick_free_port

    c = Cluster(n_prefill=1, n_decode=1)
    try:
        c.run([1, 2], max_new_tokens=6)
        c.run([1, 2], max_new_tokens=6, mode="exact", engine="fp8")
        port = c.servicer.metrics.start(pick_free_port())
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for line in (
            'baton_router_requests_total{mode="fast",status="OK"} 1.0',
            'baton_router_requests_total{mode="exact",status="OK"} 1.0',
            'baton_router_tokens_total{engine="default",mode="fast"} 6.0',
            'baton_router_workers_up{role="decode"} 1.0',
            'baton_router_handoffs_total{state="full"} 2.0',  # the fakes take no draft-only states
        ):
            assert line in body, line
        for name in (
            "baton_router_ttft_seconds_count",
            "baton_router_inter_token_seconds_count",
            "baton_router_drafted_tokens_total",
            "baton_router_accepted_tokens_total",
            "baton_router_bridge_bytes_total",
            "baton_router_bridge_seconds_count",
            "baton_router_handoff_bytes_total",
            "baton_router_migrations_total",
        ):
            assert name in body or name.replace("_total", "") in body, name
    finally:
        c.close()


# ---- registry -----------------------------------------------------------------------------------
def test_late_health_checks_mark_a_worker_down_only_when_it_answers_nothing_else():
    """Two late health checks mark an up worker down, unless it answered a request call within busy_s:
    under load (benchmarks/load.py, 64 clients on 2 cores) the checks queue behind real work, and a
    busy decode worker marked down turned every new request into UNAVAILABLE."""

    class Late(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    class LateHealth:
        def Check(self, request, timeout):
            raise Late()

    reg = Registry(Settings(), decode=["127.0.0.1:9"], busy_s=3.0)
    try:
        (w,) = reg.workers("decode")
        w.up = w.seen = True
        w.health = LateHealth()
        w.last_answer = time.monotonic()  # it is streaming tokens right now
        assert all(reg.probe(w) for _ in range(4)) and w.up
        w.last_answer -= 10  # silent for 10 s: hung
        assert reg.probe(w) is False and not w.up
    finally:
        reg.stop()


def test_pick_least_outstanding_and_rotation():
    reg = Registry(Settings(), decode=["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
        ws = reg.workers("decode")
        with pytest.raises(NoWorker):
            reg.pick("decode")
        for w in ws:
            w.up, (w.engines, w.engines_complete) = True, registry_mod.parse_engines("bf16,mtp")
        ws[2].engines = ("fp8", "bf16")
        assert [reg.pick("decode") for _ in range(3)] == ws  # ties: least recently picked
        with reg.lease(ws[0]), reg.lease(ws[1]):
            assert reg.pick("decode") is ws[2]
            with reg.lease(ws[2]), reg.lease(ws[2]):
                assert reg.pick("decode") in ws[:2]
        assert reg.pick("decode", "fp8") is ws[2]
        with pytest.raises(NoWorker):
            reg.pick("decode", "fp8", exclude=[ws[2]])
        assert reg.engines() == {"bf16", "fp8", "mtp"} and reg.engines_known()
        ws[1].engines, ws[1].engines_complete = registry_mod.parse_engines("bf16")  # default only
        assert not reg.engines_known()
        assert reg.pick("decode", "fp8") is ws[2]  # known offer first
        assert reg.pick("decode", "fp8", exclude=[ws[2]]) is ws[1]  # might offer it
    finally:
        reg.stop()


def test_parse_engines():
    assert registry_mod.parse_engines("fp8") == (("fp8",), False)
    assert registry_mod.parse_engines("FP8, bf16,mtp") == (("fp8", "bf16", "mtp"), True)
    assert registry_mod.parse_engines("") == ((), False)


def test_ray_discovery(monkeypatch):
    actors = {
        "baton-prefill-0": "127.0.0.1:7001",
        "baton-decode-0": "127.0.0.1:7002",
        "baton-decode-1": "127.0.0.1:7003",
        "other": "x",
    }
    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        util=types.SimpleNamespace(
            list_named_actors=lambda all_namespaces: (
                [{"name": n, "namespace": "baton"} for n in actors] + [{"name": "baton-decode-9", "namespace": "x"}]
            )
        ),
        get_actor=lambda name, namespace: types.SimpleNamespace(
            address=types.SimpleNamespace(remote=lambda: ("ref", name))
        ),
        wait=lambda refs, num_returns, timeout: (refs, []),
        get=lambda ref: actors[ref[1]],
    )
    monkeypatch.setitem(sys.modules, "ray", fake)
    found = registry_mod.discover_ray_workers("baton")
    assert found == {"prefill": ["127.0.0.1:7001"], "decode": ["127.0.0.1:7002", "127.0.0.1:7003"]}

    reg = Registry(Settings(), decode=["127.0.0.1:9"], ray_namespace="baton")
    try:
        reg.poll_once()
        assert {w.address for w in reg.workers("decode")} == {"127.0.0.1:9", "127.0.0.1:7002", "127.0.0.1:7003"}
        del actors["baton-decode-1"]
        reg._last_ray = 0.0
        reg.poll_once()  # vanished actors leave the pool
        assert {w.address for w in reg.workers("decode")} == {"127.0.0.1:9", "127.0.0.1:7002"}
        assert [w.address for w in reg.workers("prefill")] == ["127.0.0.1:7001"]
    finally:
        reg.stop()


def test_tls_on_the_public_port_with_plaintext_workers(tmp_path):
    from helpers import self_signed_cert

    from router.__main__ import serve_router, stop_router
    from router.service import ModelMeta

    cert, key = self_signed_cert(tmp_path)
    p, d = fakes.prefill_worker(Settings()), fakes.decode_worker(Settings())
    handle, servicer = serve_router(
        prefill=[p.address],
        decode=[d.address],
        meta=ModelMeta("fake", 100, (99,)),
        settings=Settings(token="t", tls_cert=cert, tls_key=key),
        worker_settings=Settings(),
        poll_interval=0.1,
    )
    try:
        with Client(handle.address, token="t", tls_ca=cert) as c:
            assert [t for x in c.generate([1, 2], max_new_tokens=5, timeout=10) for t in x.token_ids] == reference(
                [1, 2], 5
            )
        with Client(handle.address, settings=Settings(token="t")) as plain:  # plaintext to a TLS port
            assert plain.health(timeout=2) == "UNAVAILABLE"
    finally:
        stop_router(handle, servicer, 0)
        p.stop()
        d.stop()


def test_prefill_resource_exhausted_tries_another_worker():
    c = Cluster(n_prefill=2, n_decode=1)
    try:
        c.prefill[0].servicer.fail["Prefill"] = grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.run([1, 2], max_new_tokens=4)[0] == reference([1, 2], 4)
        for w in c.prefill:
            w.servicer.fail["Prefill"] = grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as ei:
            c.run([1, 2], max_new_tokens=4)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        c.close()


def test_a_worker_never_up_is_named_in_the_log_with_why_once_a_while(caplog):
    """A router given a wrong worker address said nothing but `worker added`: NOT_SERVING, no reason."""
    caplog.set_level("WARNING", logger="baton.router.registry")
    reg = Registry(Settings(), prefill=["127.0.0.1:9"])  # nothing listens on port 9
    try:
        w = reg.workers("prefill")[0]
        for _ in range(3):
            assert reg.probe(w) is False
        lines = [r.getMessage() for r in caplog.records if r.name == "baton.router.registry"]
        assert len(lines) == 1 and lines[0].startswith("worker not up yet: prefill 127.0.0.1:9: UNAVAILABLE: ")
        assert "127.0.0.1:9" in lines[0].split("UNAVAILABLE: ", 1)[1]  # grpc's reason: connection refused
        w.unseen_note = 0.0  # UNSEEN_NOTE_S later
        reg.probe(w)
        assert len([r for r in caplog.records if r.name == "baton.router.registry"]) == 2
    finally:
        reg.stop()
