"""State hand-off prefill -> decode over real loopback gRPC: exact tokens, bitwise state, MTP policy,
migration (ExportState), failures of the target, tampered streams."""

import collections
import json
import math
import random
import threading
import time

import grpc
import pytest
import torch
from helpers import make_tiny_dir

from baton.complete import complete
from baton.engine.runner import ModelRunner
from baton.handoff import push, receive, timeline, wire
from baton.handoff.wire import StateCorrupt, StateInvalid
from baton.loading import load_model
from baton.rpc import build_server, make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, state_pb2
from decode_worker.serve import serve_decode
from decode_worker.service import SERVICE as DECODE
from decode_worker.service import DecodeServicer, add_to_server
from prefill_worker.serve import serve_prefill

MAX_LEN, W, T = 256, 16, 30
FAST, EXACT = common_pb2.FAST, common_pb2.EXACT


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def lm(tiny):
    return load_model(tiny, dtype="fp32")


def _serve_pair(prefill_lm, decode_lm, **kw):
    p = serve_prefill(prefill_lm, max_len=MAX_LEN, width=W, slots=3, settings=Settings(), **kw)
    d = serve_decode(decode_lm, engines=("bf16", "mtp"), max_len=MAX_LEN, width=W, slots=3, settings=Settings())
    return p, d


@pytest.fixture(scope="module")
def workers(tiny, lm):
    (ph, ps), (dh, ds) = _serve_pair(lm, load_model(tiny, dtype="fp32"))
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


def _settled(stub):
    """GetStats once nothing is in flight (a cancelled call may still be finishing server-side)."""
    for _ in range(500):  # up to 10 s: the box may be busy
        st = stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
        if st.outstanding == 0 and st.sessions == 0:
            break
        time.sleep(0.02)
    return st


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "workers" in request.fixturenames:
        w = request.getfixturevalue("workers")
        for stub in (w["P"], w["D"]):
            st = _settled(stub)
            assert (st.sessions, st.session_bytes, st.outstanding) == (0, 0, 0)


def _decode(D, sid, n, engine=0):
    out, last = [], None
    for m in D.Decode(
        decode_pb2.DecodeRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, engine=engine, release_at_end=True),
        timeout=T,
    ):
        out += m.token_ids
        last = m
    assert last.finish_reason == common_pb2.LENGTH
    return out


PROMPTS = [[5, 17, 33, 200, 7], list(range(40, 90)), [300] * 3 + [12, 480]]


@pytest.mark.parametrize("engine", [common_pb2.BF16, common_pb2.MTP])
def test_prefill_handoff_decode_equals_complete(workers, lm, engine):
    P, D = workers["P"], workers["D"]
    for i, prompt in enumerate(PROMPTS):
        ref = complete(None, prompt, 24, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)
        r = P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id=f"h{i}", prompt_ids=prompt, mode=FAST, engine=engine, decode_target=workers["target"]
            ),
            timeout=T,
        )
        b = r.bridge
        assert b.tokens == len(prompt) and b.chunks >= 1 and b.seconds > 0
        assert b.total_bytes == sum(b.bytes_by_kind.values())
        assert set(b.bytes_by_kind) == {"gdn_conv", "gdn_recurrent", "attn_kv", "hidden"}
        assert [r.first_token] + _decode(D, f"h{i}", 23, engine) == ref


def test_received_state_is_bitwise_the_exported_one(workers):
    P, ps, ds = workers["P"], workers["ps"], workers["ds"]
    P.Prefill(
        prefill_pb2.PrefillRequest(
            session_id="bit", prompt_ids=PROMPTS[1], mode=EXACT, decode_target=workers["target"]
        ),
        timeout=T,
    )
    sent, pos, nxt = ps.engine.export("bit")
    s = ds.engine.get("bit")
    got = {t.name: t.tensor for t in s.runner.state.export(s.slot)}
    assert set(got) == {t.name for t in sent} and {"mtp.key", "mtp.value"} <= set(got)
    for t in sent:
        assert got[t.name].dtype == t.tensor.dtype and torch.equal(got[t.name], t.tensor), t.name
    assert (int(s.runner.state.position[s.slot]), int(s.runner.state.next_token[s.slot])) == (pos, nxt)
    P.Release(common_pb2.ReleaseRequest(session_id="bit"), timeout=T)
    workers["D"].Release(common_pb2.ReleaseRequest(session_id="bit"), timeout=T)


def test_small_chunks_and_export_state_migration(workers, lm):
    """EXACT: Prefill -> Verify 2 blocks -> ExportState to a new decode session -> Decode continues
    exactly where the exact state is (the router's migration path)."""
    P, D, ps = workers["P"], workers["D"], workers["ps"]
    prompt = PROMPTS[0]
    ref = complete(None, prompt, 30, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)
    ps.chunk_bytes = 1000
    try:
        r = P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id="mig", prompt_ids=prompt, mode=EXACT, decode_target=workers["target"]
            ),
            timeout=T,
        )
        assert r.bridge.chunks == -(-r.bridge.total_bytes // 1000)
        out = [r.first_token]
        for _ in range(2):
            v = P.Verify(
                prefill_pb2.VerifyRequest(session_id="mig", tokens=[out[-1]] + ref[len(out) : len(out) + 3]), timeout=T
            )
            out += ref[len(out) : len(out) + v.accepted] + [v.next_token]
        e = P.ExportState(
            prefill_pb2.ExportStateRequest(session_id="mig", decode_target=workers["target"], target_session_id="mig2"),
            timeout=T,
        )
        assert (e.position, e.next_token) == (len(prompt) + len(out) - 1, out[-1])
        assert e.bridge.tokens == e.position
    finally:
        ps.chunk_bytes = wire.DEFAULT_CHUNK_BYTES
    assert out + _decode(D, "mig2", 30 - len(out)) == ref
    assert D.Release(common_pb2.ReleaseRequest(session_id="mig"), timeout=T).released
    assert P.Release(common_pb2.ReleaseRequest(session_id="mig"), timeout=T).released


# ---------------------------------------------------------------- MTP KV optional
def test_prefill_without_mtp_head_feeds_mtp_decode_unchanged(tiny, lm):
    (ph, _), (dh, ds) = _serve_pair(load_model(tiny, dtype="fp32", mtp=False), load_model(tiny, dtype="fp32"))
    try:
        P = prefill_pb2_grpc.PrefillWorkerStub(make_channel(ph.address, Settings()))
        D = decode_pb2_grpc.DecodeWorkerStub(make_channel(dh.address, Settings()))
        prompt = PROMPTS[1]
        ref = complete(None, prompt, 20, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)
        r = P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id="z", prompt_ids=prompt, engine=common_pb2.MTP, decode_target=dh.address
            ),
            timeout=T,
        )
        s = ds.engine.get("z")
        assert not s.runner.state.slot_kv(s.runner.state.mtp_layer, s.slot, len(prompt))[0].any()  # zero-filled
        assert [r.first_token] + _decode(D, "z", 19, common_pb2.MTP) == ref
    finally:
        ph.stop(0)
        dh.stop(0)


def test_prefill_ships_mtp_kv_only_for_sessions_that_can_read_it(workers, lm):
    """bf16 / fp8 sessions never read the MTP layer's KV, so a Prefill naming one of them leaves those
    rows off the wire (the decode worker zero-fills them, on the device); an mtp or UNSPECIFIED (the
    worker's default) session gets them. Tokens equal the exact run either way."""
    P, D, ds = workers["P"], workers["D"], workers["ds"]
    prompt = PROMPTS[1]
    ref = complete(None, prompt, 12, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)
    kv_bytes = {}
    for sid, engine, shipped in (
        ("b", common_pb2.BF16, False),
        ("u", common_pb2.ENGINE_UNSPECIFIED, True),
        ("m", common_pb2.MTP, True),
    ):
        mtp = ds.engine.runners["mtp"].state
        mtp.key[mtp.mtp_layer].fill_(1.0)  # whatever slot it lands in held other rows before
        mtp.value[mtp.mtp_layer].fill_(1.0)
        r = P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id=sid, prompt_ids=prompt, engine=engine, decode_target=workers["target"]
            ),
            timeout=T,
        )
        kv_bytes[sid] = r.bridge.bytes_by_kind["attn_kv"]
        s = ds.engine.get(sid)
        st = s.runner.state
        assert bool(st.slot_kv(st.mtp_layer, s.slot, len(prompt))[0].any()) == shipped, sid
        assert bool(st.slot_kv(st.mtp_layer, s.slot, len(prompt))[1].any()) == shipped, sid
        assert [r.first_token] + _decode(D, sid, 11, engine) == ref, sid
        assert P.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T) is not None
    layers = len(lm.cfg.attn_layers)
    assert kv_bytes["u"] == kv_bytes["m"] == kv_bytes["b"] * (layers + 1) // layers


@pytest.mark.parametrize(
    "mode,engine,to_target,computed",
    [
        (FAST, common_pb2.BF16, True, False),
        (FAST, common_pb2.MTP, True, True),
        (FAST, common_pb2.ENGINE_UNSPECIFIED, True, True),
        (FAST, common_pb2.ENGINE_UNSPECIFIED, False, False),
        (EXACT, common_pb2.BF16, True, True),
        (EXACT, common_pb2.BF16, False, True),
    ],
)
def test_prefill_computes_mtp_kv_only_when_it_can_be_shipped(workers, lm, mode, engine, to_target, computed):
    """The MTP layer's prefill (~1/(layers+1) of the compute) runs only when the hand-off ships its KV or
    the session is kept (EXACT: ExportState ships it later); the first token is the exact one either way."""
    P, ps = workers["P"], workers["ps"]
    prompt = PROMPTS[1]
    st = ps.engine.runner.state
    for t in (st.key[st.mtp_layer], st.value[st.mtp_layer]):
        t.fill_(7.0)  # every slot: the one the Prefill takes is not known here
    ref = complete(None, prompt, 1, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)
    r = P.Prefill(
        prefill_pb2.PrefillRequest(
            session_id="c",
            prompt_ids=prompt,
            mode=mode,
            engine=engine,
            decode_target=workers["target"] if to_target else "",
        ),
        timeout=T,
    )
    assert [r.first_token] == ref
    # the Prefill's page is reset (zeros), then computed or not; the other pages keep the 7s
    rows = st.key[st.mtp_layer][:, :, : len(prompt)].flatten(1)  # [pages, ...]: the session's first page among them
    assert any(bool(r.any()) and not bool((r == 7.0).all()) for r in rows) == computed
    if mode == EXACT:
        assert P.Release(common_pb2.ReleaseRequest(session_id="c"), timeout=T).released
    if to_target:
        assert workers["D"].Release(common_pb2.ReleaseRequest(session_id="c"), timeout=T).released


def test_receive_state_mtp_entries_are_optional_both_ways(lm):
    with_mtp = ModelRunner(lm.model, slots=1, max_len=64, width=W)
    with_mtp.prefill(0, [1, 2, 3, 4])
    sent = with_mtp.state.export(0)
    kw = dict(session_id="m", fingerprint="fp", position=4, next_token=9)
    no_mtp = ModelRunner(load_model(lm.model_dir, dtype="fp32", mtp=False).model, slots=1, max_len=64, width=W)
    # sender with MTP -> receiver without: accepted, the MTP rows dropped
    got = receive.receive_state(
        push.stream_state(sent, **kw, frames=True), **receive.layout_of(no_mtp.state), fingerprint="fp"
    )
    assert set(got.tensors) == set(no_mtp.state.layout()) and "mtp.key" not in got.tensors
    # sender without MTP -> receiver with: accepted, MTP rows zero
    bare = [t for t in sent if not t.name.startswith("mtp.")]
    got = receive.receive_state(push.stream_state(bare, **kw), **receive.layout_of(with_mtp.state), fingerprint="fp")
    assert set(got.tensors) == set(with_mtp.state.layout())
    assert got.tensors["mtp.key"].shape == (lm.cfg.num_key_value_heads, 4, lm.cfg.head_dim)
    assert not got.tensors["mtp.key"].any() and not got.tensors["mtp.value"].any()
    assert all(torch.equal(got.tensors[t.name], t.tensor) for t in bare)
    # only one of the pair: the receiver with MTP refuses it
    with pytest.raises(StateInvalid, match="mtp.value"):
        receive.receive_state(
            push.stream_state([t for t in sent if t.name != "mtp.value"], **kw),
            **receive.layout_of(with_mtp.state),
            fingerprint="fp",
        )
    with pytest.raises(StateCorrupt):
        receive.receive_state([], **receive.layout_of(with_mtp.state), fingerprint="fp")


# ---------------------------------------------------------------- tampered streams (format 4)
def _frames(w, sid, **over) -> list[bytes]:
    """A valid serialized LoadState stream of PROMPTS[1] (8 KiB chunks), stream_state overrides applied."""
    eng = w["ps"].engine
    s, _ = eng.prefill(PROMPTS[1], session_id=sid + "-src")
    try:
        tensors, pos, nxt = eng.export(s.id)
        kw = dict(session_id=sid, fingerprint=w["ps"].fingerprint, position=pos, next_token=nxt, chunk_bytes=8192)
        return list(push.stream_state(tensors, **kw | over, frames=True))
    finally:
        eng.release(s.id)


def _edit(frame: bytes, fn) -> bytes:
    c = state_pb2.StateChunk.FromString(frame)
    fn(c)
    return c.SerializeToString()


def test_tampered_streams_get_the_documented_status_and_load_nothing(workers, monkeypatch):
    """Raw frames (the prefill worker's own path) to the real decode worker's LoadState: corrupt, reordered,
    dropped or truncated chunks and an altered header are DATA_LOSS; another model or format version is
    FAILED_PRECONDITION; the decode worker keeps nothing. Chunks are verified in its hashing pool."""
    monkeypatch.setattr(wire, "PARALLEL_MIN_BYTES", 1)  # the receiver is in this process: use the pool
    good = _frames(workers, "t")
    n = len(good) - 2
    assert n >= 4 and wire._data_frame(good[2]) is not None
    flip = bytearray(good[2])
    flip[100] ^= 0x04
    tail = _frames(workers, "t", tail_from=8192, tail_chunk_bytes=1024)  # all but the first chunk: 1 KiB

    def reindexed(i, j):  # chunks i and j swapped, each with the other's index: per-chunk digests still hold
        out = list(good)
        out[i + 1] = _edit(good[j + 1], lambda c: setattr(c, "chunk_index", i))
        out[j + 1] = _edit(good[i + 1], lambda c: setattr(c, "chunk_index", j))
        return out

    def header(**f):
        return [_edit(good[0], lambda c: [setattr(c.header, k, v) for k, v in f.items()])] + good[1:]

    cases = {
        "corrupt chunk": (good[:2] + [bytes(flip)] + good[3:], "DATA_LOSS", "data chunk 1: chunk_sha256 mismatch"),
        "reordered chunks": (good[:1] + [good[2], good[1]] + good[3:], "DATA_LOSS", "data chunk 0: chunk_index 1"),
        "reordered, indices rewritten": (reindexed(0, 1), "DATA_LOSS", "manifest_sha256 mismatch"),
        "dropped chunk": (good[:2] + good[3:], "DATA_LOSS", "data chunk 1: chunk_index 2"),
        "truncated: no trailer": (good[:-1], "DATA_LOSS", "before the trailer"),
        "truncated: last chunk": (good[:-2] + good[-1:], "DATA_LOSS", "truncated"),
        "altered header": (header(session_id="other"), "DATA_LOSS", "manifest_sha256 mismatch"),
        "altered next_token": (
            [*good[:-1], _edit(good[-1], lambda c: setattr(c.trailer, "next_token", 3))],
            "DATA_LOSS",
            "manifest_sha256 mismatch",
        ),
        "foreign fingerprint": (
            _frames(workers, "t", fingerprint="sha256:" + "0" * 64),
            "FAILED_PRECONDITION",
            "model_fingerprint",
        ),
        "format_version 1": (header(format_version=1), "FAILED_PRECONDITION", "format_version 1; this worker speaks 4"),
        "format_version 2": (header(format_version=2), "FAILED_PRECONDITION", "format_version 2; this worker speaks 4"),
        "format_version 5": (header(format_version=5), "FAILED_PRECONDITION", "format_version 5; this worker speaks 4"),
        "tail_from off the chunk grid": (
            header(tail_from=100, tail_chunk_bytes=1024),
            "INVALID_ARGUMENT",
            "tail_from 100 is not a multiple of chunk_bytes 8192",
        ),
        "tail chunk size past chunk_bytes": (
            header(tail_from=8192, tail_chunk_bytes=8193),
            "INVALID_ARGUMENT",
            "tail_chunk_bytes 8193 not in 1..chunk_bytes 8192",
        ),
        "tail chunks, the header says none": (
            good[:1] + tail[1:],
            "DATA_LOSS",
            "data chunk 1: 1024 bytes, expected 8192",
        ),
        "no tail, the header says one": (tail[:1] + good[1:], "DATA_LOSS", "data chunk 1: 8192 bytes, expected 1024"),
    }
    with make_channel(workers["target"], Settings()) as ch:
        load = ch.stream_unary(
            push.LOAD_STATE, request_serializer=None, response_deserializer=decode_pb2.LoadStateResponse.FromString
        )
        for what, (frames, code, msg) in cases.items():
            with pytest.raises(grpc.RpcError) as ei:
                load(iter(frames), timeout=T)
            assert (ei.value.code().name, msg in ei.value.details()) == (code, True), (what, ei.value.details())
            assert workers["ds"].engine.session_count() == 0, what
        r = load(iter(good), timeout=T)  # the intact stream loads
        assert (r.session_id, r.bridge.chunks) == ("t", n)
        workers["D"].Release(common_pb2.ReleaseRequest(session_id="t"), timeout=T)
        r = load(iter(tail), timeout=T)  # and so does the stream with a tail segment
        assert (r.session_id, r.bridge.chunks) == ("t", len(tail) - 2) and len(tail) - 2 > n
        workers["D"].Release(common_pb2.ReleaseRequest(session_id="t"), timeout=T)


def test_release_while_the_state_streams_leaves_no_session(workers):
    """A Release that reaches the decode worker while a LoadState of that session is still streaming (a
    cancelled Prefill releasing its target) is deferred until the load ends, then releases what it loaded:
    never answered first and missed, which would leave the session until its TTL."""
    import threading

    good = _frames(workers, "rel")
    half, go = threading.Event(), threading.Event()

    def paced():
        for i, f in enumerate(good):
            if i == 2:  # header and one data chunk are in: the slot is reserved
                half.set()
                assert go.wait(T)
            yield f

    with make_channel(workers["target"], Settings()) as ch:
        load = ch.stream_unary(
            push.LOAD_STATE, request_serializer=None, response_deserializer=decode_pb2.LoadStateResponse.FromString
        )
        fut = load.future(paced(), timeout=T)
        assert half.wait(T)
        time.sleep(0.2)  # the decode worker has read the header
        r = workers["D"].Release(common_pb2.ReleaseRequest(session_id="rel"), timeout=T)
        assert r.released  # deferred to the end of the LoadState
        go.set()
        assert fut.result(timeout=T).session_id == "rel"
    assert _settled(workers["D"]).sessions == 0
    with pytest.raises(grpc.RpcError) as ei:
        _decode(workers["D"], "rel", 2)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------- failures of the target
def test_dead_target_is_unavailable_and_leaves_nothing(workers, free_port):
    P = workers["P"]
    dead = f"127.0.0.1:{free_port}"
    for mode in (FAST, EXACT):
        with pytest.raises(grpc.RpcError) as ei:
            P.Prefill(
                prefill_pb2.PrefillRequest(session_id="dead", prompt_ids=[1, 2, 3], mode=mode, decode_target=dead),
                timeout=T,
            )
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and dead in ei.value.details()
    pool = push.ChannelPool()
    assert pool.get(dead, Settings()) is pool.get(dead, Settings())
    t = workers["ps"].engine.runner.state.export(0, position=0)
    with pytest.raises(push.HandoffError) as ei:
        push.push_state(
            dead, Settings(), tensors=t, session_id="x", fingerprint="f", position=0, next_token=0, timeout=5, pool=pool
        )
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE and dead in str(ei.value)
    pool.close()


def test_decode_refusal_is_passed_through_with_the_target(workers, lm):
    """A decode worker of another model answers FAILED_PRECONDITION; Prefill reports it, keeps nothing."""
    ds = workers["ds"]
    foreign = DecodeServicer(ds.engine, fingerprint="sha256:other-model")
    h = build_server([(add_to_server, foreign)], service_names=[DECODE], port=0, settings=Settings())
    try:
        for mode in (FAST, EXACT):
            with pytest.raises(grpc.RpcError) as ei:
                workers["P"].Prefill(
                    prefill_pb2.PrefillRequest(session_id="f", prompt_ids=[1, 2], mode=mode, decode_target=h.address),
                    timeout=T,
                )
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert h.address in ei.value.details() and "model_fingerprint" in ei.value.details()
    finally:
        h.stop(0)
        foreign.close()


def test_cancelled_prefill_releases_on_both_workers(workers, lm, monkeypatch):
    """The client gives up while prefill or the hand-off is in flight: neither worker keeps the session.

    Each layer is made slow and the cancel is sent at a known point (before the compute, after the
    first layer was streamed, after the last), so every cancel lands while the call is in flight:
    a cancel that races the reply is the router's to clean up (it Releases on P and D at the end)."""
    from baton.handoff.progress import PrefillProgress

    mark, seen = PrefillProgress.mark, []
    layers = lm.cfg.num_hidden_layers

    def slow_mark(self, stage):
        mark(self, stage)
        seen[-1][stage].set()
        if stage < self.layers:
            time.sleep(0.1)

    monkeypatch.setattr(PrefillProgress, "mark", slow_mark)
    rng = random.Random(3)
    for at in (None, 0, layers - 1):
        seen.append(collections.defaultdict(threading.Event))
        fut = workers["P"].Prefill.future(
            prefill_pb2.PrefillRequest(
                session_id="c", prompt_ids=[rng.randrange(512)] * 150, mode=EXACT, decode_target=workers["target"]
            ),
            timeout=T,
        )
        if at is not None:
            assert seen[-1][at].wait(T), f"layer {at} never marked"
        assert fut.cancel(), f"the Prefill finished before the cancel at layer {at}"
        with pytest.raises(grpc.FutureCancelledError):
            fut.result()
        assert _settled(workers["P"]).sessions == 0, f"a Prefill cancelled at layer {at} left a session on P"
        assert _settled(workers["D"]).sessions == 0, f"a Prefill cancelled at layer {at} left a session on D"


def test_layer_state_is_final_when_marked_and_marked_before_its_mlp(lm):
    """The prefill marks layer i (the hand-off may copy its state from then on) mid-layer: after its
    KV rows / GDN state are written, before its MLP. At each mark the layer's exported state already
    equals its value after the whole prefill."""
    r = ModelRunner(lm.model, max_len=MAX_LEN, width=W, slots=1)
    prompt = PROMPTS[1]
    order, at_mark = [], {}
    names = {i: [n for n in r.state.layout() if n.startswith(f"layers.{i}.")] for i in range(lm.cfg.num_hidden_layers)}

    def on_layer(i):
        order.append(("mark", i))
        views = {t.name: t.tensor for t in r.state.export(0, len(prompt))}
        at_mark[i] = {n: views[n].clone() for n in names[i]}

    hooks = [
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: order.append(("mlp", i)))
        for i, layer in enumerate(lm.model.model.layers)
    ]  # lm.model: the nn.Module
    try:
        r.prefill(0, prompt, on_layer=on_layer)
    finally:
        for h in hooks:
            h.remove()
    layers = lm.cfg.num_hidden_layers
    assert [e for e in order if e[0] == "mark"] == [("mark", i) for i in range(layers)]
    assert all(order.index(("mark", i)) < order.index(("mlp", i)) for i in range(layers)), order
    final = {t.name: t.tensor for t in r.state.export(0, len(prompt))}
    for i in range(layers):
        assert names[i] and all(torch.equal(at_mark[i][n], final[n]) for n in names[i]), i


def test_state_streams_while_prefill_runs(workers, lm, monkeypatch):
    """Prefill -> LoadState is streamed per layer: with each layer made slow, the decode worker has
    verified and placed the first tensors before the prefill's last layer is done, and the loaded
    state still decodes exactly as `complete`."""
    from baton.handoff.progress import PrefillProgress
    from baton.handoff.slot_fill import SlotFill

    events = []
    mark, place = PrefillProgress.mark, SlotFill.place

    def slow_mark(self, stage):
        mark(self, stage)
        events.append(("mark", stage, time.perf_counter()))
        if stage < self.layers:
            time.sleep(0.15)

    def seen_place(self, name, src):
        events.append(("place", name, time.perf_counter()))
        place(self, name, src)

    monkeypatch.setattr(PrefillProgress, "mark", slow_mark)
    monkeypatch.setattr(SlotFill, "place", seen_place)
    monkeypatch.setattr(workers["ps"], "chunk_bytes", 1024)
    prompt = PROMPTS[1]
    ref = complete(None, prompt, 8, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)
    r = workers["P"].Prefill(
        prefill_pb2.PrefillRequest(session_id="st", prompt_ids=prompt, mode=FAST, decode_target=workers["target"]),
        timeout=T,
    )
    layers = lm.cfg.num_hidden_layers
    last_layer = next(t for k, s, t in events if k == "mark" and s == layers - 1)
    first_place = min(t for k, _, t in events if k == "place")
    assert first_place < last_layer, events
    placed = [s for k, s, _ in events if k == "place"]
    assert placed[0] == "layers.0.conv" or placed[0].startswith("layers.0.")  # layer-major order
    assert r.prefill_seconds >= 0.15 * layers and r.bridge.seconds > 0
    assert [r.first_token] + _decode(workers["D"], "st", 7) == ref


def test_prefill_failing_mid_stream_loads_nothing(workers, monkeypatch):
    """A prefill that raises after some layers were streamed: the stream is cancelled, the decode worker
    activates nothing (no_leaks checks both workers), the Prefill RPC fails."""
    from baton.handoff.progress import PrefillProgress

    mark = PrefillProgress.mark

    def failing_mark(self, stage):
        if stage == 1:
            raise RuntimeError("boom in layer 1")
        mark(self, stage)

    monkeypatch.setattr(PrefillProgress, "mark", failing_mark)
    monkeypatch.setattr(workers["ps"], "chunk_bytes", 1024)
    with pytest.raises(grpc.RpcError) as e:
        workers["P"].Prefill(
            prefill_pb2.PrefillRequest(
                session_id="fail", prompt_ids=PROMPTS[1], mode=FAST, decode_target=workers["target"]
            ),
            timeout=T,
        )
    assert e.value.code() != grpc.StatusCode.OK
    # the cancelled LoadState may still hold the session id a moment (ABORTED "busy with another call": a
    # loaded 2-core run saw it); once it let go, nothing was loaded
    end = time.monotonic() + 10
    while True:
        with pytest.raises(grpc.RpcError) as e:
            workers["D"].Decode(decode_pb2.DecodeRequest(session_id="fail", max_new_tokens=1), timeout=T).next()
        if e.value.code() != grpc.StatusCode.ABORTED or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nogil_launch", ["0", "1"])
def test_gpu_streamed_handoff_is_bitwise_and_decodes_exactly(tiny, nogil_launch, monkeypatch):
    """CUDA end to end: the state streamed during prefill (per-layer events, pinned staging, side-stream
    H2D into a reserved slot) arrives bitwise, and the decode worker's graphs continue it exactly; with
    the GIL-holding launcher (baton/engine/nogil.py: the slot's copies, the graphs' replays) and without."""
    from baton.engine import nogil

    monkeypatch.setenv(nogil.ENV, nogil_launch)
    monkeypatch.setattr(nogil, "_state", {})
    lm_p, lm_d = (load_model(tiny, dtype="bf16", device="cuda") for _ in range(2))
    ph, ps = serve_prefill(
        lm_p, device="cuda", max_len=MAX_LEN, width=W, slots=2, settings=Settings(), chunk_bytes=64 << 10
    )
    dh, ds = serve_decode(
        lm_d, device="cuda", engines=("bf16", "mtp"), max_len=MAX_LEN, width=W, slots=2, settings=Settings()
    )
    try:
        with make_channel(ph.address, Settings()) as pc, make_channel(dh.address, Settings()) as dc:
            P, D = prefill_pb2_grpc.PrefillWorkerStub(pc), decode_pb2_grpc.DecodeWorkerStub(dc)
            for i, prompt in enumerate(PROMPTS):
                ref = complete(None, prompt, 16, max_len=MAX_LEN, width=W, loaded=lm_p, ignore_eos=True, device="cuda")
                P.Prefill(
                    prefill_pb2.PrefillRequest(
                        session_id=f"g{i}", prompt_ids=prompt, mode=EXACT, decode_target=dh.address
                    ),
                    timeout=T,
                )
                sent, pos, nxt = ps.engine.export(f"g{i}")
                s = ds.engine.get(f"g{i}")
                got = {t.name: t.tensor for t in s.runner.state.export(s.slot)}
                for t in sent:
                    assert torch.equal(got[t.name], t.tensor), t.name
                assert (int(s.runner.state.position[s.slot]), int(s.runner.state.next_token[s.slot])) == (pos, nxt)
                P.Release(common_pb2.ReleaseRequest(session_id=f"g{i}"), timeout=T)
                assert [nxt] + _decode(D, f"g{i}", 15) == ref
            # a bf16 session: the MTP KV stays off the wire and is zero-filled on the device, over rows
            # an earlier session left in the slot
            st = ds.engine.runners["bf16"].state
            st.key[st.mtp_layer].fill_(1.0)
            r = P.Prefill(
                prefill_pb2.PrefillRequest(
                    session_id="gb", prompt_ids=PROMPTS[1], engine=common_pb2.BF16, decode_target=dh.address
                ),
                timeout=T,
            )
            s = ds.engine.get("gb")
            assert not st.slot_kv(st.mtp_layer, s.slot, len(PROMPTS[1]))[0].any()
            ref = complete(None, PROMPTS[1], 16, max_len=MAX_LEN, width=W, loaded=lm_p, ignore_eos=True, device="cuda")
            assert [r.first_token] + _decode(D, "gb", 15, common_pb2.BF16) == ref
    finally:
        ph.stop(0)
        dh.stop(0)


# ---------------------------------------------------------------- the hand-off's timeline
def test_prefill_timeline_with_the_thread_sender(workers):
    """The thread sender has every mark but the sender process's staging and child marks; finite, one clock,
    in causal order; series per data chunk."""
    P, D, ps = workers["P"], workers["D"], workers["ps"]
    proc, ps.sender, ps.chunk_bytes = ps.sender, None, 4096  # NOTE: between requests only
    try:
        r = P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id="tlt", prompt_ids=PROMPTS[1], mode=FAST, decode_target=workers["target"], timeline=True
            ),
            timeout=T,
        )
    finally:
        ps.sender, ps.chunk_bytes = proc, wire.DEFAULT_CHUNK_BYTES
    assert D.Release(common_pb2.ReleaseRequest(session_id="tlt"), timeout=T).released
    tl, n = r.bridge.timeline, r.bridge.chunks
    want = set(timeline.MARKS) - timeline.PROCESS_SENDER_ONLY
    assert set(tl.marks_ns) == want, set(tl.marks_ns) ^ want
    assert set(tl.clocks.values()) == {timeline.CLOCK_ID} and timeline.violations(tl) == []
    off = timeline.offsets_ms(tl)
    assert all(math.isfinite(v) for v in off.values()) and off["prefill.compute_end"] == 0
    assert off["sender.reply"] == off["prefill.reply_received"] > off["decode.loaded"] > 0
    assert {k: len(v.ns) for k, v in tl.series_ns.items()} == {"sender.handed": n, "decode.received": n} and n > 3


def test_load_state_reports_the_receiver_marks_only_when_asked(workers):
    """LoadState answers a timeline (the decode.* marks, its clock) only to a call that asked for it."""
    ps, D = workers["ps"], workers["D"]
    s, _ = ps.engine.prefill(PROMPTS[0])
    try:
        tensors, pos, nxt = ps.engine.export(s.id)
        kw = dict(
            tensors=tensors, fingerprint=ps.fingerprint, position=pos, next_token=nxt, timeout=T, chunk_bytes=2048
        )
        plain, _ = push.push_state(workers["target"], Settings(), session_id="lt0", **kw)
        resp, report = push.push_state(workers["target"], Settings(), session_id="lt1", timeline=True, **kw)
    finally:
        ps.engine.release(s.id)
    for sid in ("lt0", "lt1"):
        assert D.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T).released
    assert not plain.bridge.HasField("timeline")
    rx = resp.bridge.timeline
    assert set(rx.marks_ns) == {m for m in timeline.MARKS if m.startswith("decode.")}
    assert dict(rx.clocks) == {"decode": timeline.CLOCK_ID} and len(rx.series_ns["decode.received"].ns) == report.chunks
    # the sender's report carries the receiver's marks and its own (no prefill ran: no compute_end)
    assert set(rx.marks_ns) | {"sender.last_chunk_handed", "sender.trailer_sent", "prefill.reply_received"} <= set(
        report.timeline.marks_ns
    )
    m = report.timeline.marks_ns
    order = [
        "sender.last_chunk_handed",
        "decode.last_chunk_received",
        "decode.last_chunk_fed",
        "decode.verified",
        "decode.received",
        "decode.loaded",
        "decode.reply",
        "sender.reply",
        "prefill.reply_received",
    ]
    assert [m[k] for k in order] == sorted(m[k] for k in order)


def test_timeline_helpers_compare_one_clock_and_name_what_breaks_causality():
    tl = timeline.Timeline({"prefill": "A", "sender": "A", "decode": "B"})
    tl.update(
        {
            "prefill.compute_end": 1_000_000,
            "sender.last_chunk_handed": 2_000_000,
            "prefill.rpc_reply": 3_500_000,
            "decode.reply": 5,
        },
        series={"sender.handed": [900_000, 2_000_000], "decode.received": [1, 2]},
    )
    assert timeline.Timeline().merge_json(json.loads(json.dumps(tl.to_json()))).to_proto() == tl.to_proto()
    pb = tl.to_proto()
    assert timeline.offsets_ms(pb) == {
        "prefill.compute_end": 0.0,
        "sender.last_chunk_handed": 1.0,
        "prefill.rpc_reply": 2.5,
    }  # decode's clock is another host's
    assert not timeline.shared_clock(pb) and timeline.violations(pb) == []
    assert timeline.behind_at(pb) == {"sender.handed": 1}
    pb.clocks["decode"] = "A"  # one clock: decode.reply (5 ns) before the hand-off and chunks received before sent
    v = timeline.violations(pb)
    assert any(x.startswith("sender.last_chunk_handed 1.000 > decode.reply") for x in v)
    assert "chunk 0: decode.received before sender.handed" in v and "chunk 1: decode.received before sender.handed" in v
    empty = timeline.Timeline().to_proto()  # no reference mark: nothing to compare
    assert timeline.offsets_ms(empty) == {} and timeline.behind_at(empty) == {} and timeline.violations(empty) == []


def test_migration_probe_outputs_stay_exact_with_the_mtp_rows_of_verified_tokens_missing():
    """benchmarks/migration_mtp_probe.py (trained default model): after ExportState the decode worker's MTP
    KV lacks the verified tokens' rows (the prefill worker's Verify runs no MTP layer). Drafts may be
    worse; the tokens must still be the exact ones, in the migrated and in the control session."""
    from benchmarks import migration_mtp_probe

    r = migration_mtp_probe.main(["--generated", "10", "--new", "8", "--prompts", "1"])
    (row,) = r["results"]
    assert row["exact_control"] and row["exact_migrated"] and row["migrated_at"] >= 10
    assert row["mean_accept_len_control"] >= 1 and row["mean_accept_len_migrated"] >= 1
