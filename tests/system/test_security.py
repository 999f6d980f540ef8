"""Security of the real entry points (`python -m router | prefill_worker | decode_worker`, tiny model):

  * auth: every RPC of every service, enumerated from the generated descriptors (a new RPC cannot be
    missed), refuses a missing and a wrong bearer token with UNAUTHENTICATED, and with the token does
    not (health and reflection stay open by design: probes);
  * loopback: started without --host / BATON_HOST, each prints 127.0.0.1:PORT and listens on 127.0.0.1
    only (`ss -ltnp` by pid; the router's /metrics port too); `baton serve` gives its workers 127.0.0.1;
  * size limits: a message over the default 64 MiB limit gets RESOURCE_EXHAUSTED from every server;
  * TLS end to end with a certificate made here (cryptography): router and workers with BATON_TLS_CERT /
    KEY / CA, so every hop (client -> router -> workers, prefill -> decode hand-off) is mutual TLS.
    A client without the CA fails, with it (and the client certificate the CA requires) it gets the
    same tokens as `baton complete`; plaintext fails.
Not here: no pickle/marshal in runtime code (tests/engine/test_state.py); in-process auth/TLS/limits of
baton.rpc (tests/test_rpc.py).
"""

from __future__ import annotations

import re
import subprocess

import grpc
import pytest
from conftest import pick_free_port
from helpers import make_tiny_dir, self_signed_cert
from realcluster import TOKEN, Cmd, RealCluster, reference, start_cmd, tokens

from baton.client import Client
from baton.settings import Settings
from baton.v1 import decode_pb2, prefill_pb2, router_pb2

C = grpc.StatusCode
MAX_LEN = 128
SERVICES = {
    "router": router_pb2.DESCRIPTOR.services_by_name["Router"],
    "prefill": prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"],
    "decode": decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"],
}
ALL = [(role, m) for role, svc in SERVICES.items() for m in svc.methods]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The three entry points with their defaults: no --host, no BATON_HOST, the default message limit."""
    tmp = tmp_path_factory.mktemp("sec")
    tiny = make_tiny_dir(tmp)
    tf = tmp / "token"
    tf.write_text(TOKEN)
    common = ["--model", str(tiny), "--max-len", str(MAX_LEN), "--token-file", str(tf)]
    procs = {
        "prefill": start_cmd(Cmd("prefill", "prefill_worker", ["--port", "0", *common])),
        "decode": start_cmd(Cmd("decode", "decode_worker", ["--port", "0", *common])),
    }
    try:
        addr = {k: p.wait_ready(timeout=120, settings=Settings(token=TOKEN)) for k, p in procs.items()}
        metrics = pick_free_port()
        procs["router"] = start_cmd(
            Cmd(
                "router",
                "router",
                [
                    "--port",
                    "0",
                    "--prefill",
                    addr["prefill"],
                    "--decode",
                    addr["decode"],
                    "--model",
                    str(tiny),
                    "--token-file",
                    str(tf),
                    "--metrics-port",
                    str(metrics),
                ],
            )
        )
        addr["router"] = procs["router"].wait_ready(timeout=60, settings=Settings(token=TOKEN))
        yield type("Plain", (), dict(procs=procs, addr=addr, metrics=metrics))
    finally:
        for p in procs.values():
            p.stop(grace=2.0)


def _raw(addr: str, m, metadata=(), body: bytes = b"", timeout: float = 10.0, creds=None):
    """One call of method descriptor `m` with a raw body -> status code (OK when it returns)."""
    path = f"/{m.containing_service.full_name}/{m.name}"
    opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    ch = grpc.secure_channel(addr, creds, options=opts) if creds else grpc.insecure_channel(addr, options=opts)
    try:
        if m.client_streaming:
            ch.stream_unary(path, None, None)(iter([body]), timeout=timeout, metadata=metadata)
        elif m.server_streaming:
            list(ch.unary_stream(path, None, None)(body, timeout=timeout, metadata=metadata))
        else:
            ch.unary_unary(path, None, None)(body, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        return e.code()
    finally:
        ch.close()
    return C.OK


# ---- auth ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("role,m", ALL, ids=[f"{r}.{m.name}" for r, m in ALL])
def test_every_rpc_refuses_a_missing_or_wrong_token(plain, role, m):
    addr = plain.addr[role]
    for md in [
        (),
        (("authorization", "Bearer wrong"),),
        (("authorization", TOKEN),),
        (("authorization", f"bearer {TOKEN}"),),
        (("x-token", TOKEN),),
    ]:
        assert _raw(addr, m, md) == C.UNAUTHENTICATED, (m.name, md)
    # with the token the call reaches the service (an empty request is then OK or a validation error)
    assert _raw(addr, m, (("authorization", f"Bearer {TOKEN}"),)) != C.UNAUTHENTICATED


def test_the_enumeration_covers_every_method():
    assert {(r, m.name) for r, m in ALL} == {
        ("router", "Generate"),
        ("router", "GetModelInfo"),
        *(
            ("prefill", n)
            for n in ("Prefill", "PrefillStream", "Verify", "VerifyMany", "Release", "ExportState", "GetStats")
        ),
        *(("decode", n) for n in ("LoadState", "Decode", "Draft", "DraftMany", "Release", "GetStats")),
    }


# ---- loopback -------------------------------------------------------------------------------------------
def _listening(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=10).stdout
    return [ln.split()[3] for ln in out.splitlines() if f"pid={pid}," in ln]


def test_every_server_binds_loopback_by_default(plain):
    for role, p in plain.procs.items():
        assert plain.addr[role].startswith("127.0.0.1:"), plain.addr[role]  # the printed serving line
        socks = _listening(p.pid)
        assert socks, f"{role}: no listening socket found for pid {p.pid}"
        # 127.0.0.1, or its IPv4-mapped form on a dual-stack socket: never 0.0.0.0 / [::] / a real interface
        assert all(s.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for s in socks), (role, socks)
    assert {f"127.0.0.1:{plain.metrics}", f"[::ffff:127.0.0.1]:{plain.metrics}"} & set(
        _listening(plain.procs["router"].pid)
    )
    import argparse

    from deploy.local import _worker_specs  # `baton serve` (Ray or --processes) gives its workers 127.0.0.1

    ns = argparse.Namespace(
        model=None,
        device="cpu",
        dtype=None,
        max_len=None,
        slots=None,
        token_file=None,
        grace=1.0,
        prefill=1,
        decode=2,
        engine=None,
    )
    assert {s.host for s in _worker_specs(ns)} == {"127.0.0.1"}
    assert Settings.from_env({}).host == "127.0.0.1"


# ---- message size limits ------------------------------------------------------------------------------
@pytest.mark.parametrize("role,method", [("router", "Generate"), ("prefill", "Prefill"), ("decode", "LoadState")])
def test_a_message_over_the_default_limit_is_resource_exhausted(plain, role, method):
    """65 MiB (the limit is 64 MiB, BATON_MAX_MESSAGE_BYTES): refused by the transport, before parsing."""
    m = SERVICES[role].methods_by_name[method]
    body = b"\x12" + bytes([0x80 | 0x7F, 0xFF, 0xFF, 0x1F]) + b"x" * (65 << 20)  # one bytes/string field
    assert _raw(plain.addr[role], m, (("authorization", f"Bearer {TOKEN}"),), body, timeout=30) == C.RESOURCE_EXHAUSTED
    assert _raw(plain.addr[role], SERVICES[role].methods[-1], (("authorization", f"Bearer {TOKEN}"),)) in (
        C.OK,
        C.INVALID_ARGUMENT,
    )  # still serving


# ---- TLS end to end ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tls_end_to_end(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    tiny = make_tiny_dir(tmp_path)
    mtls = Settings(token=TOKEN, tls_cert=cert, tls_key=key, tls_ca=cert)
    cl = RealCluster(
        tmp_path,
        prefill=1,
        decode=1,
        max_len=MAX_LEN,
        model_dir=tiny,
        client_settings=mtls,
        env={"BATON_TLS_CERT": cert, "BATON_TLS_KEY": key, "BATON_TLS_CA": cert},
    )
    try:
        ref = reference(tiny, MAX_LEN)
        cl.start()
        for mode in ("fast", "exact"):  # client -> router -> prefill -> decode, all TLS
            got = tokens(cl.client.generate("def main(", max_new_tokens=10, mode=mode, ignore_eos=True, timeout=60))
            assert got == ref("def main(", 10), mode
        refused = {
            "plaintext": Settings(token=TOKEN),
            "no CA (system roots)": Settings(token=TOKEN, tls_cert=cert, tls_key=key),
            "CA but no client certificate": Settings(token=TOKEN, tls_ca=cert),
        }
        for what, s in refused.items():
            with Client(cl.router_addr, settings=s) as c:
                with pytest.raises(grpc.RpcError) as ei:
                    list(c.generate("def", max_new_tokens=2, timeout=10))
                assert ei.value.code() == C.UNAVAILABLE, what
        for name, addr in cl.addr.items():  # the workers refuse plaintext too
            m = SERVICES[name.split("-")[0]].methods_by_name["GetStats"]
            assert _raw(addr, m, (("authorization", f"Bearer {TOKEN}"),)) == C.UNAVAILABLE, name
        with Client(cl.router_addr, settings=mtls.replace(token="wrong")) as c:  # TLS does not replace the token
            with pytest.raises(grpc.RpcError) as ei:
                list(c.generate("def", max_new_tokens=2, timeout=10))
            assert ei.value.code() == C.UNAUTHENTICATED
        assert re.match(r"^127\.0\.0\.1:\d+$", cl.router_addr)
    finally:
        cl.close()
