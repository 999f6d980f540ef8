"""The hand-off sender process (baton/handoff/sender/process.py, baton/handoff/sender/child.py) over real loopback gRPC:
byte-identical frames to the in-thread sender, bitwise state at a real decode worker, cancellation,
a kill -9 of the child (clear error, respawn), nothing left behind (shared memory, fds, threads)."""

import math
import os
import signal
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from helpers import make_tiny_dir

from baton.handoff import decode, layout, timeline, wire
from baton.handoff import push as handoff
from baton.handoff.progress import PrefillProgress
from baton.handoff.sender.process import SenderProcess
from baton.loading import load_model
from baton.rpc import make_channel
from baton.settings import Settings, SettingsError
from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, state_pb2
from decode_worker.serve import serve_decode
from prefill_worker.serve import serve_prefill

MAX_LEN, W, T = 256, 16, 30
PROMPT = list(range(40, 90))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ring_inode(sender: SenderProcess) -> int:
    return os.fstat(sender.child().ring.fd).st_ino


def ring_traces(inode: int | None = None) -> list[str]:
    """This process's fds and mappings of sender rings (memfds: never a /dev/shm entry); `inode`: of one."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "baton-sender-ring" in os.readlink(f"/proc/self/fd/{fd}") and inode in (
                None,
                os.stat(f"/proc/self/fd/{fd}").st_ino,
            ):
                out.append(f"fd {fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        out += [line.strip() for line in f if "baton-sender-ring" in line and inode in (None, int(line.split()[4]))]
    return out


def sender_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("baton-sender")]


# ---------------------------------------------------------------- frames: byte-identical to the thread sender
class Recorder:
    """A LoadState server that keeps every stream's raw frames."""

    def __init__(self):
        self.streams: list[list[bytes]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        h = grpc.stream_unary_rpc_method_handler(lambda it, ctx: self.streams.append(list(it)) or b"")
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("baton.v1.DecodeWorker", {"LoadState": h}),)
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


@pytest.fixture(scope="module")
def sender():
    s = SenderProcess(slots=6, slot_bytes=1 << 20, workers=2)
    inode = ring_inode(s)
    yield s
    reader = s.child().reader
    s.close()
    assert ring_traces(inode) == [] and not reader.is_alive()


def random_state(seed: int) -> list[wire.WireTensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        wire.WireTensor("layers.0.conv", state_pb2.GDN_CONV, torch.randn(1000, 3, generator=g).bfloat16()),
        wire.WireTensor("layers.0.recurrent", state_pb2.GDN_RECURRENT, torch.randn(3, 128, 129, generator=g)),
        wire.WireTensor("layers.1.key", state_pb2.ATTN_KEY, torch.randn(2, 700, 64, generator=g).bfloat16()[:, :600]),
        wire.WireTensor("hidden", state_pb2.HIDDEN, torch.randn(77, generator=g).half()),
    ]


def _three_pushes(ts, sender, **kw):
    """The same 2-layer state pushed to a recording receiver by the process sender, the thread sender, and
    the process sender pulling tensors as a running prefill marks them -> (their streams, their results)."""
    rec = Recorder()
    try:
        res = [
            handoff.start_push(rec.address, Settings(), tensors=ts, sender=sender, **kw).result(),
            handoff.start_push(rec.address, Settings(), tensors=ts, **kw).result(),
        ]
        progress = PrefillProgress(2, torch.device("cpu"))
        push = handoff.start_push(rec.address, Settings(), tensors=ts, progress=progress, sender=sender, **kw)
        progress.mark(0)
        progress.mark(1)
        progress.finish(kw["next_token"])
        res.append(push.result())
    finally:
        rec.server.stop(0)
    return rec.streams, res


@pytest.mark.parametrize("chunk_bytes", [1000, 65521, 1 << 17, 300_007])  # 300_007: frames built outside the GIL
def test_frames_are_byte_identical_to_the_thread_sender(sender, chunk_bytes):
    ts = random_state(chunk_bytes)
    total = sum(t.tensor.numel() * t.tensor.element_size() for t in ts)
    assert any(total > chunk_bytes and (sum(x.tensor.nbytes for x in ts[:i]) % chunk_bytes) for i in range(1, 4))
    (proc, thr, lazy), ((_, b_proc), (_, b_thr), _) = _three_pushes(
        ts,
        sender,
        session_id="s",
        fingerprint="sha256:x",
        position=600,
        next_token=4242,
        chunk_bytes=chunk_bytes,
        mode=common_pb2.EXACT,
        engine="mtp",
        timeout=T,
    )
    assert len(proc) == -(-total // chunk_bytes) + 2
    assert proc == thr == lazy
    assert (b_proc.total_bytes, b_proc.chunks, b_proc.tokens) == (b_thr.total_bytes, b_thr.chunks, b_thr.tokens)
    got = decode.decode_stream(proc, layout.ExpectedLayout.from_tensors(ts, 600), "sha256:x", 1 << 24)
    assert got.next_token == 4242
    for t in ts:
        assert torch.equal(got.tensors[t.name].view(torch.uint8), t.tensor.contiguous().view(torch.uint8))


def test_the_child_imports_no_torch(sender):
    child = sender.child()
    for _ in range(500):
        if child.ready is not None:
            break
        time.sleep(0.02)
    assert child.ready == {"pid": child.proc.pid, "torch": False}  # so it never initialises CUDA


def test_setting_env_and_cli():
    assert Settings().handoff_sender == "process"
    assert Settings.from_env({"BATON_HANDOFF_SENDER": "Thread"}).handoff_sender == "thread"
    with pytest.raises(SettingsError, match="BATON_HANDOFF_SENDER"):
        Settings.from_env({"BATON_HANDOFF_SENDER": "fork"})


# ---------------------------------------------------------------- against a real decode worker
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tiny = make_tiny_dir(tmp_path_factory.mktemp("m"))
    ph, ps = serve_prefill(
        load_model(tiny, dtype="fp32"), max_len=MAX_LEN, width=W, slots=3, settings=Settings(handoff_sender="process")
    )
    dh, ds = serve_decode(
        load_model(tiny, dtype="fp32"), engines=("bf16",), max_len=MAX_LEN, width=W, slots=3, settings=Settings()
    )
    with make_channel(ph.address, Settings()) as pc, make_channel(dh.address, Settings()) as dc:
        yield dict(
            P=prefill_pb2_grpc.PrefillWorkerStub(pc),
            D=decode_pb2_grpc.DecodeWorkerStub(dc),
            ps=ps,
            ds=ds,
            target=dh.address,
        )
    ph.stop(0)
    dh.stop(0)


def settled(ds) -> int:
    for _ in range(500):
        if ds.engine.session_count() == 0 and ds.outstanding == 0:
            break
        time.sleep(0.02)
    return ds.engine.session_count()


def test_prefill_rpc_streams_through_the_sender_process_bitwise(cluster):
    P, ps, ds = cluster["P"], cluster["ps"], cluster["ds"]
    assert ps.sender is not None
    child = ps.sender.child()
    streams = child._ids
    P.Prefill(
        prefill_pb2.PrefillRequest(
            session_id="b", prompt_ids=PROMPT, mode=common_pb2.EXACT, decode_target=cluster["target"]
        ),
        timeout=T,
    )
    assert child._ids == streams + 1 and ps.sender.child() is child  # the child streamed it
    sent, pos, nxt = ps.engine.export("b")
    s = ds.engine.get("b")
    got = {t.name: t.tensor for t in s.runner.state.export(s.slot)}
    for t in sent:
        assert torch.equal(got[t.name].view(torch.uint8), t.tensor.contiguous().view(torch.uint8)), t.name
    assert (int(s.runner.state.position[s.slot]), int(s.runner.state.next_token[s.slot])) == (pos, nxt)
    cluster["P"].Release(common_pb2.ReleaseRequest(session_id="b"), timeout=T)
    cluster["D"].Release(common_pb2.ReleaseRequest(session_id="b"), timeout=T)


def running_push(
    cluster, sender, sid: str, chunk_bytes: int = 1024, *, timeout: float = T, settings: Settings | None = None
):
    """A push whose source is a prefill stopped after layer 0: (push, progress, session to release)."""
    eng = cluster["ps"].engine
    s, _ = eng.prefill(PROMPT)
    tensors, pos, _ = eng.export(s.id)
    progress = PrefillProgress(eng.runner.model.cfg.num_hidden_layers, torch.device("cpu"))
    push = handoff.start_push(
        cluster["target"],
        settings or Settings(),
        tensors=tensors,
        session_id=sid,
        fingerprint=cluster["ps"].fingerprint,
        position=pos,
        next_token=0,
        chunk_bytes=chunk_bytes,
        timeout=timeout,
        progress=progress,
        sender=sender,
    )
    progress.mark(0)
    return push, progress, s.id


def wait_streaming(ds, timeout: float = 10.0) -> None:
    """Until the decode worker is inside that LoadState (it has read the header)."""
    t0 = time.perf_counter()
    while ds.outstanding == 0 and time.perf_counter() - t0 < timeout:
        time.sleep(0.01)
    time.sleep(0.2)


def test_cancel_mid_stream_leaves_no_session(cluster):
    sender = cluster["ps"].sender
    push, progress, sid = running_push(cluster, sender, "cancel")
    try:
        wait_streaming(cluster["ds"])
        push.cancel()
        with pytest.raises(handoff.HandoffError) as ei:
            push.result()
        assert ei.value.code == grpc.StatusCode.CANCELLED
    finally:
        progress.fail(RuntimeError("test over"))
        cluster["ps"].engine.release(sid)
    push.join(5)
    assert settled(cluster["ds"]) == 0
    # is_active turning False cancels too
    push, progress, sid = running_push(cluster, sender, "inactive")
    try:
        wait_streaming(cluster["ds"])
        with pytest.raises(handoff.HandoffError) as ei:
            push.result(is_active=lambda: False)
        assert ei.value.code == grpc.StatusCode.CANCELLED and "calling RPC ended" in ei.value.details
    finally:
        progress.fail(RuntimeError("test over"))
        cluster["ps"].engine.release(sid)
    push.join(5)
    assert settled(cluster["ds"]) == 0
    assert all(not n.startswith("baton-sender-stage") for n in sender_threads())


def test_child_killed_mid_stream_is_a_clear_error_and_the_next_push_respawns(cluster):
    shm_before = sorted(os.listdir("/dev/shm"))
    sender = SenderProcess(slots=4, slot_bytes=64 << 10, workers=1)
    try:
        first, first_ring = sender.child(), ring_inode(sender)
        assert ring_traces(first_ring)
        push, progress, sid = running_push(cluster, sender, "kill")
        try:
            wait_streaming(cluster["ds"])
            os.kill(first.proc.pid, signal.SIGKILL)
            with pytest.raises(handoff.HandoffError) as ei:
                push.result()
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            assert "sender process died (exit code -9)" in str(ei.value)
        finally:
            progress.fail(RuntimeError("test over"))
            cluster["ps"].engine.release(sid)
        push.join(5)
        first.reader.join(5)
        assert settled(cluster["ds"]) == 0
        assert ring_traces(first_ring) == []  # the dead child's ring: unmapped, its fd closed
        eng = cluster["ps"].engine
        s, _ = eng.prefill(PROMPT)
        try:
            tensors, pos, nxt = eng.export(s.id)
            resp, bridge = handoff.push_state(
                cluster["target"],
                Settings(),
                tensors=tensors,
                session_id="again",
                fingerprint=cluster["ps"].fingerprint,
                position=pos,
                next_token=nxt,
                chunk_bytes=8192,
                timeout=T,
                sender=sender,
            )
        finally:
            eng.release(s.id)
        second, second_ring = sender.child(), ring_inode(sender)
        assert second is not first and resp.session_id == "again" and bridge.total_bytes > 0
        cluster["D"].Release(common_pb2.ReleaseRequest(session_id="again"), timeout=T)
    finally:
        sender.close()
    assert ring_traces(second_ring) == [] and sorted(os.listdir("/dev/shm")) == shm_before
    assert not first.reader.is_alive() and not second.reader.is_alive()
    assert not [n for n in sender_threads() if n.startswith("baton-sender-stage")]


def test_thread_sender_is_the_fallback(cluster, tmp_path):
    ps = cluster["ps"]
    from prefill_worker.service import PrefillServicer

    thr = PrefillServicer(ps.engine, fingerprint=ps.fingerprint, settings=Settings(handoff_sender="thread"))
    try:
        assert thr.sender is None
    finally:
        thr.close()
    assert SenderProcess(slot_bytes=1 << 20).fits(1 << 20) and not SenderProcess(slot_bytes=1 << 20).fits(2 << 20)


# ---------------------------------------------------------------- 16 MiB chunks (wire.MAX_CHUNK_BYTES) and guards
def big_state_model():
    """A CPU model whose state spans several 16 MiB chunks: 30 GDN layers of a 2 MiB fp32 recurrent state
    each (the 9B's per-layer size) + conv + 10 attention layers' KV: ~65 MB, built in seconds."""
    from transformers import Qwen3_5TextConfig

    from baton.config import ModelConfig
    from baton.loading import random_model

    cfg = ModelConfig.from_dict(
        Qwen3_5TextConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=40,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            linear_num_key_heads=8,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
        ).to_dict()
    )
    return random_model(cfg, dtype="fp32", seed=0, mtp=False)


@pytest.fixture(scope="module")
def big_cluster():
    lm = big_state_model()
    ph, ps = serve_prefill(
        lm, max_len=64, width=4, slots=1, chunk_bytes=wire.MAX_CHUNK_BYTES, settings=Settings(handoff_sender="process")
    )
    dh, ds = serve_decode(lm, engines=("bf16",), max_len=64, width=4, slots=1, settings=Settings())
    with make_channel(ph.address, Settings()) as pc:
        yield dict(P=prefill_pb2_grpc.PrefillWorkerStub(pc), ps=ps, ds=ds, target=dh.address)
    ph.stop(0)
    dh.stop(0)


@pytest.mark.parametrize("chunk_bytes", [wire.MAX_CHUNK_BYTES, int(15.9 * (1 << 20))])
def test_max_size_chunks_of_a_state_made_layer_by_layer_land_bitwise_with_both_senders(big_cluster, chunk_bytes):
    """The bench_ttft --chunk-mib 16 path on CPU: Prefill streams each layer as it is computed, in chunks of
    up to wire.MAX_CHUNK_BYTES, through the sender process and through the thread sender."""
    P, ps, ds = big_cluster["P"], big_cluster["ps"], big_cluster["ds"]
    proc, tail = ps.sender, ps.tail_chunk_bytes
    assert proc is not None and proc.fits(chunk_bytes)
    try:
        for sender in (proc, None):
            # NOTE: between requests only, as bench_ttft does; no tail segment: every chunk full-size
            ps.chunk_bytes, ps.sender, ps.tail_chunk_bytes = chunk_bytes, sender, 0
            streams = proc.child()._ids
            t0 = time.perf_counter()
            r = P.Prefill(
                prefill_pb2.PrefillRequest(
                    session_id="big",
                    prompt_ids=list(range(10, 40)),
                    mode=common_pb2.EXACT,
                    decode_target=big_cluster["target"],
                ),
                timeout=T,
            )
            assert time.perf_counter() - t0 < 20
            assert proc.child()._ids == streams + (sender is not None)  # who streamed it
            sent, pos, nxt = ps.engine.export("big")
            total = sum(t.tensor.numel() * t.tensor.element_size() for t in sent)
            assert total > 3 * wire.MAX_CHUNK_BYTES
            assert (r.bridge.total_bytes, r.bridge.chunks) == (total, -(-total // chunk_bytes))
            s = ds.engine.get("big")
            got = {t.name: t.tensor for t in s.runner.state.export(s.slot)}
            for t in sent:
                assert torch.equal(got[t.name].view(torch.uint8), t.tensor.contiguous().view(torch.uint8)), t.name
            assert (int(s.runner.state.position[s.slot]), int(s.runner.state.next_token[s.slot])) == (pos, nxt)
            ps.engine.release("big")
            ds.engine.release("big")
    finally:
        ps.chunk_bytes, ps.sender, ps.tail_chunk_bytes = wire.MAX_CHUNK_BYTES, proc, tail


def test_chunk_bytes_past_the_cap_or_the_message_limit_is_refused_at_configuration(cluster):
    from prefill_worker.service import PrefillServicer

    cap = wire.MAX_CHUNK_BYTES
    assert wire.check_chunk_bytes(cap, Settings().max_message_bytes) == cap
    for bad in (cap + 1, 0, -1):
        with pytest.raises(ValueError, match="chunk_bytes must be in"):
            wire.check_chunk_bytes(bad)
    with pytest.raises(ValueError, match="max_message_bytes=16777216"):
        wire.check_chunk_bytes(cap, max_message_bytes=cap)  # the frame is a few bytes more than its chunk
    ps = cluster["ps"]
    before = sender_threads()
    for chunk, settings in [(cap + 1, Settings()), (cap, Settings(max_message_bytes=cap))]:
        with pytest.raises(ValueError, match="chunk_bytes"):
            PrefillServicer(ps.engine, fingerprint=ps.fingerprint, settings=settings, chunk_bytes=chunk)
        with pytest.raises(ValueError, match="chunk_bytes"):  # before the model loads
            serve_prefill("/nonexistent/model", chunk_bytes=chunk, settings=settings)
    assert sender_threads() == before  # no sender process started
    tensors = random_state(5)
    for sender in (ps.sender, None):
        with pytest.raises(ValueError, match="chunk_bytes must be in"):
            handoff.start_push(
                cluster["target"],
                Settings(),
                tensors=tensors,
                session_id="x",
                fingerprint="f",
                position=600,
                next_token=1,
                chunk_bytes=cap + 1,
                sender=sender,
            )


def push_ok(cluster, sender, sid: str) -> None:
    eng = cluster["ps"].engine
    s, _ = eng.prefill(PROMPT)
    try:
        tensors, pos, nxt = eng.export(s.id)
        resp, _ = handoff.push_state(
            cluster["target"],
            Settings(),
            tensors=tensors,
            session_id=sid,
            fingerprint=cluster["ps"].fingerprint,
            position=pos,
            next_token=nxt,
            chunk_bytes=8192,
            timeout=T,
            sender=sender,
        )
    finally:
        eng.release(s.id)
    assert resp.session_id == sid
    cluster["D"].Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T)


def test_a_wedged_child_is_killed_past_the_deadline_and_the_next_push_respawns(cluster):
    """A child that never answers (SIGSTOP: alive, its control socket open, so no EOF) must not hold a push
    past its deadline: result() raises DEADLINE_EXCEEDED at timeout + grace and the child is killed."""
    sender = SenderProcess(slots=4, slot_bytes=64 << 10, workers=1, answer_grace_s=0.5)
    try:
        wedged = sender.child()
        os.kill(wedged.proc.pid, signal.SIGSTOP)
        push, progress, sid = running_push(cluster, sender, "wedged", timeout=1.0)
        try:
            t0 = time.perf_counter()
            with pytest.raises(handoff.HandoffError) as ei:
                push.result()
            assert 1.0 <= time.perf_counter() - t0 < 5
            assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "gave no answer" in ei.value.details
        finally:
            progress.fail(RuntimeError("test over"))
            cluster["ps"].engine.release(sid)
        assert wedged.proc.wait(5) == -signal.SIGKILL
        push.join(5)
        wedged.reader.join(5)
        assert not wedged.reader.is_alive()
        push_ok(cluster, sender, "after-wedged")
        assert sender.child() is not wedged
    finally:
        sender.close()
    assert settled(cluster["ds"]) == 0
    assert not [n for n in sender_threads() if n.startswith("baton-sender-stage")]


def test_a_cancel_the_child_does_not_read_kills_it(cluster, monkeypatch):
    from baton.handoff.sender import stream

    monkeypatch.setattr(stream, "CANCEL_SEND_S", 0.2)
    sender = SenderProcess(slots=4, slot_bytes=64 << 10, workers=1)
    try:
        push, progress, sid = running_push(cluster, sender, "deaf")
        child = push.child
        try:
            wait_streaming(cluster["ds"])
            with child.conn._lock:  # as a stager stuck in sendall to a child that reads nothing would
                push.cancel()
            with pytest.raises(handoff.HandoffError) as ei:
                push.result()
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            assert "does not read its control channel" in ei.value.details
        finally:
            progress.fail(RuntimeError("test over"))
            cluster["ps"].engine.release(sid)
        assert child.proc.wait(5) == -signal.SIGKILL
        push.join(5)
    finally:
        sender.close()
    assert settled(cluster["ds"]) == 0


def test_a_call_the_child_cannot_start_fails_that_push_only(cluster):
    sender = SenderProcess(slots=4, slot_bytes=64 << 10, workers=1)
    try:
        child = sender.child()
        push, progress, sid = running_push(cluster, sender, "badtls", settings=Settings(tls_ca="/nonexistent/ca.pem"))
        try:
            with pytest.raises(handoff.HandoffError) as ei:
                push.result()
            assert ei.value.code == grpc.StatusCode.INTERNAL
            assert "could not start the call" in ei.value.details and "/nonexistent/ca.pem" in ei.value.details
        finally:
            progress.fail(RuntimeError("test over"))
            cluster["ps"].engine.release(sid)
        push.join(5)
        push_ok(cluster, sender, "after-badtls")
        assert sender.child() is child and child.proc.poll() is None  # the same child served it
    finally:
        sender.close()


def test_a_broken_control_channel_kills_the_child_and_fails_its_pushes(cluster):
    """Whatever breaks the parent's reader, the pushes on that child fail (they never wait for a child that
    is still alive and will never be heard again)."""
    sender = SenderProcess(slots=4, slot_bytes=64 << 10, workers=1)
    try:
        child = sender.child()
        for _ in range(500):
            if child.ready is not None:
                break
            time.sleep(0.02)

        def broken():
            raise ValueError("sender control message of 99999999999 bytes")

        child.conn.recv = broken  # NOTE: the reader's next call, after the message it waits for now
        push, progress, sid = running_push(cluster, sender, "broken")
        try:
            with pytest.raises(handoff.HandoffError) as ei:
                push.result()
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE and "control channel failed" in ei.value.details
        finally:
            progress.fail(RuntimeError("test over"))
            cluster["ps"].engine.release(sid)
        assert child.proc.wait(5) == -signal.SIGKILL
        push.join(5)
        child.reader.join(5)
        push_ok(cluster, sender, "after-broken")
    finally:
        sender.close()
    assert settled(cluster["ds"]) == 0


# ---------------------------------------------------------------- wire format 4: a tail segment of smaller chunks
def data_sizes(frames: list[bytes]) -> list[int]:
    return [len(state_pb2.StateChunk.FromString(f).data) for f in frames[1:-1]]


@pytest.mark.parametrize(
    "chunk_bytes,tail_chunk_bytes,tail_layers",
    [(65521, 4099, 1), (300_007, 65536, 1), (1 << 17, 1000, 0), (1 << 17, 1 << 17, 1)],
)
def test_tail_frames_are_byte_identical_from_both_senders_and_cut_as_planned(
    sender, chunk_bytes, tail_chunk_bytes, tail_layers
):
    """The last `tail_layers` layers' bytes (+ hidden) in tail_chunk_bytes chunks, from tail_offset rounded down to
    chunk_bytes: the same frames from the sender process, the thread sender and a running prefill's source."""
    from baton.handoff.encode import chunk_plan
    from baton.handoff.progress import tail_offset

    ts = random_state(7)
    specs = [wire.TensorDesc.of(t) for t in ts]
    total = sum(s.nbytes for s in specs)
    plan = chunk_plan(total, chunk_bytes, tail_offset(specs, tail_layers), tail_chunk_bytes)
    assert plan.tail_from == (
        0 if tail_chunk_bytes == chunk_bytes else tail_offset(specs, tail_layers) // chunk_bytes * chunk_bytes
    )
    (proc, thr, lazy), _ = _three_pushes(
        ts,
        sender,
        session_id="s",
        fingerprint="sha256:x",
        position=600,
        next_token=77,
        chunk_bytes=chunk_bytes,
        timeout=T,
        tail_chunk_bytes=tail_chunk_bytes,
        tail_layers=tail_layers,
    )
    assert proc == thr == lazy
    h = state_pb2.StateChunk.FromString(proc[0]).header
    assert (h.format_version, h.tail_from, h.tail_chunk_bytes) == (4, plan.tail_from, plan.tail_chunk_bytes)
    assert data_sizes(proc) == [plan.span(i)[1] for i in range(plan.count)]
    if plan.tail_chunk_bytes:
        assert set(data_sizes(proc)[plan.head_chunks : -1]) == {tail_chunk_bytes}
        assert len(proc) - 2 > -(-total // chunk_bytes)
    got = decode.decode_stream(proc, layout.ExpectedLayout.from_tensors(ts, 600), "sha256:x", 1 << 24)
    for t in ts:
        assert torch.equal(got.tensors[t.name].view(torch.uint8), t.tensor.contiguous().view(torch.uint8))


def test_prefill_rpc_with_a_tail_lands_bitwise_through_both_senders(cluster):
    """The prefill worker's own path (the setting, via PrefillServicer.tail_chunk_bytes) to the real decode
    worker: the streamed state is bitwise the exported one and the chunk count is the plan's."""
    from baton.handoff.encode import chunk_plan
    from baton.handoff.progress import tail_offset

    P, ps, ds = cluster["P"], cluster["ps"], cluster["ds"]
    proc = ps.sender
    try:
        for sender, tail in [(proc, 1000), (None, 1000), (proc, 0)]:
            ps.chunk_bytes, ps.tail_chunk_bytes, ps.sender = 4096, tail, sender  # NOTE: between requests only
            streams = proc.child()._ids
            r = P.Prefill(
                prefill_pb2.PrefillRequest(
                    session_id="tail", prompt_ids=PROMPT, mode=common_pb2.EXACT, decode_target=cluster["target"]
                ),
                timeout=T,
            )
            assert proc.child()._ids == streams + (sender is not None)
            sent, pos, nxt = ps.engine.export("tail")
            specs = [wire.TensorDesc.of(t) for t in sent]
            plan = chunk_plan(sum(s.nbytes for s in specs), 4096, tail_offset(specs, ps.tail_layers), tail)
            assert bool(plan.tail_chunk_bytes) == bool(tail) and r.bridge.chunks == plan.count
            s = ds.engine.get("tail")
            got = {t.name: t.tensor for t in s.runner.state.export(s.slot)}
            for t in sent:
                assert torch.equal(got[t.name].view(torch.uint8), t.tensor.contiguous().view(torch.uint8)), t.name
            assert (int(s.runner.state.position[s.slot]), int(s.runner.state.next_token[s.slot])) == (pos, nxt)
            P.Release(common_pb2.ReleaseRequest(session_id="tail"), timeout=T)
            cluster["D"].Release(common_pb2.ReleaseRequest(session_id="tail"), timeout=T)
    finally:
        ps.chunk_bytes, ps.tail_chunk_bytes, ps.sender = wire.DEFAULT_CHUNK_BYTES, 0, proc
    assert settled(ds) == 0


def test_tail_chunk_bytes_past_chunk_bytes_is_capped_at_the_chunk_size(cluster):
    from prefill_worker.service import PrefillServicer

    ps = cluster["ps"]
    big = PrefillServicer(
        ps.engine,
        fingerprint=ps.fingerprint,
        chunk_bytes=8192,
        settings=Settings(handoff_sender="thread", handoff_tail_chunk_bytes=8193),
    )
    try:
        assert big.tail_chunk_bytes == 8192
    finally:
        big.close()
    ok = PrefillServicer(
        ps.engine,
        fingerprint=ps.fingerprint,
        chunk_bytes=8192,
        settings=Settings(handoff_sender="thread", handoff_tail_chunk_bytes=8192, handoff_tail_layers=3),
    )
    try:
        assert (ok.tail_chunk_bytes, ok.tail_layers) == (8192, 3)
    finally:
        ok.close()


# ---------------------------------------------------------------- the hand-off's timeline
def test_prefill_timeline_through_the_sender_process_has_every_mark_in_causal_order(cluster):
    """PrefillRequest.timeline: bridge.timeline holds every mark of baton/handoff/timeline.py, stamped in this
    process, the sender child and the decode worker, on one clock (CLOCK_MONOTONIC of this host), finite, in
    the order causality imposes, inside the Prefill call; one reading per data chunk and stage. Not asked
    for: no timeline."""
    P, D, ps, ds = cluster["P"], cluster["D"], cluster["ps"], cluster["ds"]
    ps.chunk_bytes = 4096  # many chunks
    try:
        r = P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id="tl", prompt_ids=PROMPT, mode=common_pb2.FAST, decode_target=cluster["target"], timeline=True
            ),
            timeout=T,
        )
        plain = P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id="tl0", prompt_ids=PROMPT, mode=common_pb2.FAST, decode_target=cluster["target"]
            ),
            timeout=T,
        )
    finally:
        ps.chunk_bytes = wire.DEFAULT_CHUNK_BYTES
    for sid in ("tl", "tl0"):
        assert D.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T).released
    assert settled(ds) == 0
    assert not plain.bridge.HasField("timeline")
    tl, n = r.bridge.timeline, r.bridge.chunks
    assert n == -(-r.bridge.total_bytes // 4096) > 3
    assert set(tl.marks_ns) == set(timeline.MARKS), set(tl.marks_ns) ^ set(timeline.MARKS)
    assert dict(tl.clocks) == {"prefill": timeline.CLOCK_ID, "sender": timeline.CLOCK_ID, "decode": timeline.CLOCK_ID}
    assert timeline.violations(tl) == []
    off = timeline.offsets_ms(tl)
    assert off["prefill.compute_end"] == 0 and all(math.isfinite(v) for v in off.values())
    assert all(off["prefill.rpc_start"] <= v <= off["prefill.rpc_reply"] for v in off.values())
    assert 0 < -off["prefill.rpc_start"] <= r.prefill_seconds * 1e3  # the same interval as prefill_seconds, inside it
    series = {k: list(v.ns) for k, v in tl.series_ns.items()}
    assert {k: len(v) for k, v in series.items()} == {"prefill.staged": n, "sender.handed": n, "decode.received": n}
    assert series["prefill.staged"][-1] == tl.marks_ns["prefill.last_chunk_staged"]
    assert series["sender.handed"][-1] == tl.marks_ns["sender.last_chunk_handed"]
    assert series["decode.received"][-1] == tl.marks_ns["decode.last_chunk_received"]
    assert all(0 <= v <= n for v in timeline.behind_at(tl).values())


def test_timeline_does_not_change_the_frames(sender):
    """With the timeline asked for, the streams are still byte-identical (only call metadata is added)."""
    ts = random_state(3)
    kw = dict(session_id="s", fingerprint="sha256:x", position=600, next_token=7, chunk_bytes=65521, timeout=T)
    (proc, thr, lazy), _ = _three_pushes(ts, sender, **kw)
    (proc_t, thr_t, lazy_t), res = _three_pushes(ts, sender, timeline=True, **kw)
    assert proc == thr == lazy == proc_t == thr_t == lazy_t
    for _, report in res:  # a receiver that reports no marks: the sender's own still come back
        assert {"sender.last_chunk_handed", "sender.trailer_sent", "prefill.reply_received"} <= set(
            report.timeline.marks_ns
        )


def test_ring_admission_is_fifo_so_later_pushes_never_fill_the_ring():
    """_Child.take: only the slots/2 oldest pushes asking for ring slots stage (2 slots each). A later
    push waits even while slots are free, until an older push is done. (A batched prefill starts many
    pushes at once; on the H200 32 of them filled the 8-slot ring and every hand-off hung.)"""
    import threading

    from baton.handoff.sender.process import _Child

    class FakePush:
        def __init__(self):
            self.held, self.done = 0, threading.Event()

    child = _Child(slots=4, slot_bytes=4096, per_stream=3, workers=1)
    try:
        assert child.streams == 2
        a, b, c = FakePush(), FakePush(), FakePush()
        sa = [child.take(a), child.take(a)]  # a alone may hold per_stream (3); with b admitted its share is 2
        child.take(b)  # b holds one, one slot stays free
        got = []
        t = threading.Thread(target=lambda: got.append(child.take(c)), daemon=True)
        t.start()
        t.join(0.3)
        assert not got  # a free slot, but c is the third push: not admitted
        for s in sa:
            child.give(s)
        t.join(0.3)
        assert not got  # a's slots are back, a is not done: still only a and b
        a.done.set()
        t.join(2.0)
        assert len(got) == 1 and c.held == 1  # a done: c is admitted
    finally:
        child.close()


def test_the_ring_is_unmapped_once_whoever_sees_itself_last():
    """The reader's end and the last stager's leave() may both see themselves last, on two threads: the
    ring is closed once (two closes racing past Ring.close's fd check would close the fd twice, and the
    second would close whatever file had reused its number)."""
    s = SenderProcess(slots=2, slot_bytes=1 << 16, workers=1)
    child = s.child()
    s.close()
    child.reader.join(5.0)
    assert not child.reader.is_alive() and child.ring.fd == -1  # unmapped by the reader's end
    closes = []
    child.ring.close = lambda: closes.append(1)
    child._unmap()  # a late second caller (leave() of the last stager calls it)
    assert closes == []
