"""DecodeWorker over real loopback gRPC: Draft/Verify loop (the router's exact mode in miniature),
Decode stop conditions and cancellation, bad input, corrupt LoadState streams, auth."""

import random
import time

import grpc
import pytest
from helpers import make_tiny_dir

pass
from baton.complete import complete
from baton.handoff import push
from baton.loading import load_model
from baton.rpc import build_server, make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, state_pb2
from decode_worker.serve import serve_decode
from decode_worker.service import SERVICE, DecodeServicer, add_to_server
from prefill_worker.serve import serve_prefill

MAX_LEN, W, T = 256, 16, 30
EXACT, BF16, MTP = common_pb2.EXACT, common_pb2.BF16, common_pb2.MTP
PROMPT = [11, 22, 33, 44, 55, 66]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype="fp32")


@pytest.fixture(scope="module")
def w(lm):
    ph, ps = serve_prefill(lm, max_len=MAX_LEN, width=W, slots=3, settings=Settings())
    dh, ds = serve_decode(
        load_model(lm.model_dir, dtype="fp32"), max_len=MAX_LEN, width=W, slots=3, settings=Settings()
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


@pytest.fixture(scope="module")
def ref(lm):
    return complete(None, PROMPT, 60, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)


def _settled(stub):
    for _ in range(500):  # up to 10 s: the box may be busy
        st = stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
        if st.outstanding == 0 and st.sessions == 0:
            break
        time.sleep(0.02)
    return st


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "w" in request.fixturenames:
        for stub in (request.getfixturevalue("w")["P"], request.getfixturevalue("w")["D"]):
            st = _settled(stub)
            assert (st.sessions, st.session_bytes, st.outstanding) == (0, 0, 0)


def _handoff(w, sid, prompt=PROMPT, engine=0, mode=common_pb2.FAST, **kw):
    """Prefill with the state handed to D -> the PrefillResponse (kw: more PrefillRequest fields)."""
    req = prefill_pb2.PrefillRequest(
        session_id=sid, prompt_ids=prompt, mode=mode, engine=engine, decode_target=w["target"], **kw
    )
    return w["P"].Prefill(req, timeout=T)


def _load(w, sid, prompt=PROMPT, engine=0, mode=common_pb2.FAST, **kw):
    return _handoff(w, sid, prompt, engine, mode, **kw).first_token


def _decode(D, sid, n, **kw):
    msgs = list(D.Decode(decode_pb2.DecodeRequest(session_id=sid, max_new_tokens=n, **kw), timeout=T))
    assert all(m.finish_reason == 0 for m in msgs[:-1]) and msgs[-1].finish_reason != 0
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def _err(fn, req, timeout=T):
    with pytest.raises(grpc.RpcError) as ei:
        r = fn(req, timeout=timeout)
        if not hasattr(r, "ByteSize"):  # a stream: errors come while reading it
            list(r)
    return ei.value.code(), ei.value.details()


def _rel(w, sid):
    w["P"].Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T)
    w["D"].Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T)


# ---------------------------------------------------------------- exact mode in miniature
@pytest.mark.parametrize(
    "engine,hidden,draft_only", [(BF16, False, False), (MTP, False, False), (MTP, True, False), (MTP, True, True)]
)
def test_draft_verify_loop_drives_the_ar_sequence(w, ref, engine, hidden, draft_only):
    """LoadState via Prefill(EXACT) -> Draft -> Verify -> Draft(verdict) ... == complete(). bf16 drafts
    are exact, so the loop also corrupts some drafts before Verify to force rollbacks on the decode side.
    hidden: each Verify returns the kept rows' hidden rows, relayed with the verdict (what the router does
    for mtp drafts): the same tokens, and the Draft positions move as with the decode worker's own rows.
    draft_only: the hand-off was draft-only (the hidden row and the MTP KV alone): the same again."""
    P, D, rng = w["P"], w["D"], random.Random(engine)
    out = [_load(w, "ex", engine=engine, mode=EXACT, draft_only=draft_only)]
    assert w["ds"].engine.get("ex").draft_only == draft_only
    verdict, rounds = {}, 0
    while len(out) < 40:
        k = rng.choice([1, 3, 6, W - 2])
        d = D.Draft(decode_pb2.DraftRequest(session_id="ex", k=k, engine=engine, **verdict), timeout=T)
        assert len(d.draft_tokens) == k and d.position == len(PROMPT) + len(out) - 1
        assert d.round.size == 1 and d.round.id != 0  # a batch of this one session: its Verify waits for no other
        s = w["ds"].engine.get("ex")  # the pending token the drafting took (host-known after a relayed verdict)
        assert s.draft_t0 == out[-1], (s.draft_t0, out[-1])
        drafts = list(d.draft_tokens)
        if engine == BF16 and rng.random() < 0.5:
            j = rng.randrange(k)
            drafts[j] = (drafts[j] + 1) % 512
        req = prefill_pb2.VerifyRequest(session_id="ex", tokens=[out[-1]] + drafts, want_hidden=hidden, round=d.round)
        v = P.Verify(req, timeout=T)
        assert v.HasField("hidden") == hidden and v.hidden.rows == (v.accepted + 1 if hidden else 0)
        out += drafts[: v.accepted] + [v.next_token]
        verdict = dict(has_verdict=True, accepted=v.accepted, next_token=v.next_token)
        if hidden:
            verdict["verdict_hidden"] = v.hidden
        rounds += 1
    assert out[:40] == ref[:40]
    # the last verdict applies too: the next draft starts at the committed state (bf16 drafts are exact)
    d = D.Draft(decode_pb2.DraftRequest(session_id="ex", k=1, **verdict), timeout=T)
    assert d.position == len(PROMPT) + len(out) - 1
    if engine == BF16:
        assert d.draft_tokens[0] == ref[len(out)]
    _rel(w, "ex")


# ---------------------------------------------------------------- Decode
def test_decode_continues_across_calls_and_stop_reasons(w, ref):
    D = w["D"]
    first = _load(w, "d")
    a, last = _decode(D, "d", 10, ignore_eos=True)
    assert [first] + a == ref[:11] and last.finish_reason == common_pb2.LENGTH and len(last.token_ids) == 1
    stop = ref[15]
    b, last = _decode(D, "d", 30, stop_token_ids=[stop], ignore_eos=True)  # stop id included in the output
    assert b == ref[11:16] and last.finish_reason == common_pb2.STOP
    # EOS: a second servicer over the same engine whose EOS is the next reference token
    eos_svc = DecodeServicer(w["ds"].engine, fingerprint=w["ds"].fingerprint, eos_ids=(ref[18],))
    h = build_server([(add_to_server, eos_svc)], service_names=[SERVICE], port=0, settings=Settings())
    try:
        with make_channel(h.address, Settings()) as ch:
            c, last = _decode(decode_pb2_grpc.DecodeWorkerStub(ch), "d", 30, release_at_end=True)
    finally:
        h.stop(0)
        eos_svc.close()
    assert c == ref[16:19] and last.finish_reason == common_pb2.EOS
    assert w["ds"].engine.session_count() == 0  # release_at_end


def test_a_paced_stream_groups_tokens_and_keeps_them_exact(w, ref):
    """decode_worker/pacing.py: with a budget of 10 messages/s a release_at_end stream waits the most
    (25 ms) between messages, and the tokens queued meanwhile (its steps ran ahead) ride together; the
    tokens are those of the unpaced stream. A stream that does not run ahead (no release_at_end) is not
    paced: one token a message."""
    svc = DecodeServicer(w["ds"].engine, fingerprint=w["ds"].fingerprint, settings=Settings(stream_messages_per_s=10))
    h = build_server([(add_to_server, svc)], service_names=[SERVICE], port=0, settings=Settings())
    try:
        with make_channel(h.address, Settings()) as ch:
            D = decode_pb2_grpc.DecodeWorkerStub(ch)
            first = _load(w, "p")
            req = decode_pb2.DecodeRequest(session_id="p", max_new_tokens=10, ignore_eos=True)
            plain = list(D.Decode(req, timeout=T))
            assert [len(m.token_ids) for m in plain] == [1] * 10
            req = decode_pb2.DecodeRequest(session_id="p", max_new_tokens=40, ignore_eos=True, release_at_end=True)
            msgs = list(D.Decode(req, timeout=T))
            assert svc.pace.active == 0
    finally:
        h.stop(0)
        svc.close()
    toks = [t for m in plain + msgs for t in m.token_ids]
    assert [first] + toks == ref[:51] and msgs[-1].finish_reason == common_pb2.LENGTH
    assert len(msgs) <= 20 and max(len(m.token_ids) for m in msgs) >= 3, [len(m.token_ids) for m in msgs]


def test_mtp_decode_reports_acceptance(w, ref):
    first = _load(w, "m", engine=MTP)
    toks, last = _decode(w["D"], "m", 20, ignore_eos=True, release_at_end=True)
    assert [first] + toks == ref[:21] and last.mean_accept_len >= 1.0


def test_decode_cancel_and_deadline_release_the_session(w):
    D = w["D"]
    _load(w, "c")
    call = D.Decode(
        decode_pb2.DecodeRequest(session_id="c", max_new_tokens=200, ignore_eos=True, release_at_end=True), timeout=T
    )
    next(call), next(call)
    t0 = time.monotonic()
    call.cancel()
    assert _settled(D).sessions == 0 and time.monotonic() - t0 < 2.0
    _load(w, "t")
    code, _ = _err(
        D.Decode,
        decode_pb2.DecodeRequest(session_id="t", max_new_tokens=200, ignore_eos=True, release_at_end=True),
        timeout=0.3,
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _settled(D).sessions == 0


# ---------------------------------------------------------------- bad input
def test_bad_decode_and_draft_requests(w, ref):
    D = w["D"]
    first = _load(w, "ok", engine=BF16, mode=EXACT)
    cases = [
        (D.Decode, decode_pb2.DecodeRequest(session_id="nope", max_new_tokens=3), "NOT_FOUND", "session_id"),
        (D.Draft, decode_pb2.DraftRequest(session_id="nope", k=2), "NOT_FOUND", "session_id"),
        (D.Decode, decode_pb2.DecodeRequest(session_id="ok", max_new_tokens=0), "INVALID_ARGUMENT", "max_new_tokens"),
        (
            D.Decode,
            decode_pb2.DecodeRequest(session_id="ok", max_new_tokens=3, engine=MTP),
            "INVALID_ARGUMENT",
            "engine",
        ),
        (
            D.Decode,
            decode_pb2.DecodeRequest(session_id="ok", max_new_tokens=3, stop_token_ids=[512]),
            "INVALID_ARGUMENT",
            "stop_token_ids",
        ),
        (D.Decode, decode_pb2.DecodeRequest(session_id="ok", max_new_tokens=MAX_LEN), "OUT_OF_RANGE", "max_new_tokens"),
        (D.Draft, decode_pb2.DraftRequest(session_id="ok", k=0), "INVALID_ARGUMENT", "k"),
        (D.Draft, decode_pb2.DraftRequest(session_id="ok", k=W - 1), "INVALID_ARGUMENT", "k"),
        (D.Draft, decode_pb2.DraftRequest(session_id="ok", k=2, has_verdict=True), "INVALID_ARGUMENT", "has_verdict"),
        (D.Draft, decode_pb2.DraftRequest(session_id="ok", k=2, engine=9), "INVALID_ARGUMENT", "engine"),
    ]
    for fn, req, code, field in cases:
        got, details = _err(fn, req)
        assert (got.name, details.split(":")[0]) == (code, field), details
    d = D.Draft(decode_pb2.DraftRequest(session_id="ok", k=3), timeout=T)  # still serves this session
    assert list(d.draft_tokens) == ref[1:4]
    for verdict, field in [
        (dict(accepted=4, next_token=1), "accepted"),
        (dict(accepted=1, next_token=512), "next_token"),
    ]:
        got, details = _err(D.Draft, decode_pb2.DraftRequest(session_id="ok", k=2, has_verdict=True, **verdict))
        assert got == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
    # the exact worker's verdict on [first, ref1..3] (all right): m = 3, bonus ref[4]
    v = w["P"].Verify(prefill_pb2.VerifyRequest(session_id="ok", tokens=[first] + ref[1:4]), timeout=T)
    d = D.Draft(
        decode_pb2.DraftRequest(session_id="ok", k=2, has_verdict=True, accepted=v.accepted, next_token=v.next_token),
        timeout=T,
    )
    assert (v.accepted, v.next_token, list(d.draft_tokens)) == (3, ref[4], ref[5:7])
    _rel(w, "ok")


def test_draft_many_answers_each_session_as_its_own_draft_would(w, ref):
    """DraftMany of [a good first Draft, an unknown session, k out of range, a verdict without drafts out,
    the good session again] -> OK / NOT_FOUND / INVALID_ARGUMENT x2 / ABORTED; the good item's drafts equal
    the reference (and a twin session's unary Draft); the bad items leave their sessions as they were."""
    D, C = w["D"], grpc.StatusCode
    for sid in ("dm", "dt", "dk"):
        _load(w, sid, mode=EXACT)
    reqs = [
        decode_pb2.DraftRequest(session_id="dm", k=3),
        decode_pb2.DraftRequest(session_id="nope", k=2),
        decode_pb2.DraftRequest(session_id="dk", k=W - 1),
        decode_pb2.DraftRequest(session_id="dt", k=2, has_verdict=True, accepted=1, next_token=1),
        decode_pb2.DraftRequest(session_id="dm", k=3),
    ]
    out = D.DraftMany(decode_pb2.DraftManyRequest(requests=reqs), timeout=T).outcomes
    codes = [C.OK if not o.status.code else next(c for c in C if c.value[0] == o.status.code) for o in out]
    assert codes == [C.OK, C.NOT_FOUND, C.INVALID_ARGUMENT, C.INVALID_ARGUMENT, C.ABORTED], [o.status for o in out]
    assert [o.status.message.split(":")[0] for o in out[1:4]] == ["session_id", "k", "has_verdict"]
    assert list(out[0].response.draft_tokens) == ref[1:4]
    twin = D.Draft(decode_pb2.DraftRequest(session_id="dt", k=3), timeout=T)
    assert (twin.draft_tokens, twin.position) == (out[0].response.draft_tokens, out[0].response.position)
    assert list(D.Draft(decode_pb2.DraftRequest(session_id="dk", k=3), timeout=T).draft_tokens) == ref[1:4]
    for sid in ("dm", "dt", "dk"):
        _rel(w, sid)


def _with_hidden(sid: str, v, k: int = 2):
    """A Draft with the verdict of VerifyResponse v and its hidden rows."""
    return decode_pb2.DraftRequest(
        session_id=sid, k=k, has_verdict=True, accepted=v.accepted, next_token=v.next_token, verdict_hidden=v.hidden
    )


def test_bad_verdict_hidden_rows_are_refused_and_the_session_goes_on(w, ref):
    """DraftRequest.verdict_hidden: wrong rows, width, dtype or size, or without a verdict, or for bf16
    drafts -> INVALID_ARGUMENT naming the field, the session untouched; once a verdict came with them,
    one without is refused (the BF16 state did not advance) and so is a fast Decode (FAILED_PRECONDITION)."""
    from baton import hidden_rows

    P, D = w["P"], w["D"]
    first = _load(w, "hv", engine=MTP, mode=EXACT)
    d = D.Draft(decode_pb2.DraftRequest(session_id="hv", k=3), timeout=T)
    v = P.Verify(
        prefill_pb2.VerifyRequest(session_id="hv", tokens=[first, *d.draft_tokens], want_hidden=True), timeout=T
    )
    good, m = v.hidden, v.accepted
    bad = [
        (dict(rows=good.rows + 1), "verdict_hidden.rows"),
        (dict(width=good.width - 1), "verdict_hidden.width"),
        (dict(dtype="bfloat16" if good.dtype != "bfloat16" else "float32"), "verdict_hidden.dtype"),
        (dict(data=good.data[:-4]), "verdict_hidden.data"),
    ]
    verdict = dict(has_verdict=True, accepted=m, next_token=v.next_token)
    for change, field in bad:
        h = common_pb2.HiddenRows()
        h.CopyFrom(good)
        for k_, val in change.items():
            setattr(h, k_, val)
        got, details = _err(D.Draft, decode_pb2.DraftRequest(session_id="hv", k=2, verdict_hidden=h, **verdict))
        assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", field), details
    got, details = _err(D.Draft, decode_pb2.DraftRequest(session_id="hv", k=2, verdict_hidden=good))
    assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", "has_verdict"), details
    d = D.Draft(decode_pb2.DraftRequest(session_id="hv", k=2, verdict_hidden=good, **verdict), timeout=T)
    assert hidden_rows.decode(good, m + 1, good.width, hidden_rows.DTYPES[good.dtype]).shape == (m + 1, good.width)
    out = [first] + ref[1 : m + 1] + [v.next_token]
    assert d.position == len(PROMPT) + len(out) - 1  # the position moved past the kept rows, none run
    v = P.Verify(
        prefill_pb2.VerifyRequest(session_id="hv", tokens=[out[-1], *d.draft_tokens], want_hidden=True), timeout=T
    )
    out += list(d.draft_tokens[: v.accepted]) + [v.next_token]
    assert out == ref[: len(out)]
    got, details = _err(
        D.Draft,
        decode_pb2.DraftRequest(session_id="hv", k=2, has_verdict=True, accepted=v.accepted, next_token=v.next_token),
    )
    assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", "verdict_hidden"), details
    got, details = _err(D.Decode, decode_pb2.DecodeRequest(session_id="hv", max_new_tokens=2))
    assert got == grpc.StatusCode.FAILED_PRECONDITION, details
    d = D.Draft(_with_hidden("hv", v), timeout=T)
    assert d.position == len(PROMPT) + len(out) - 1
    _rel(w, "hv")
    first = _load(w, "hb", engine=BF16, mode=EXACT)
    d = D.Draft(decode_pb2.DraftRequest(session_id="hb", k=3), timeout=T)
    v = P.Verify(
        prefill_pb2.VerifyRequest(session_id="hb", tokens=[first, *d.draft_tokens], want_hidden=True), timeout=T
    )
    got, details = _err(D.Draft, _with_hidden("hb", v))
    assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", "verdict_hidden"), details
    _rel(w, "hb")


def test_penalty_history_is_checked_and_drafts_follow_it(w, lm):
    """A penalized session's first Decode / Draft after LoadState must carry the state's token history
    (PenaltyHistory); a wrong one is INVALID_ARGUMENT naming the field. With it, bf16 drafts are the exact
    engine's penalized picks and the exact worker accepts them all; generated_tokens is checked."""
    from baton.engine.sampling import Params

    D, pen = w["D"], common_pb2.SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)
    want = complete(
        None, PROMPT, 8, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True, sampling=Params.from_proto(pen)
    )
    r = w["P"].Prefill(
        prefill_pb2.PrefillRequest(
            session_id="pen", prompt_ids=PROMPT, mode=EXACT, engine=BF16, decode_target=w["target"], sampling=pen
        ),
        timeout=T,
    )
    assert r.first_token == want[0]
    hist = lambda ids, g=len(PROMPT): common_pb2.PenaltyHistory(token_ids=ids, generated_from=g)  # noqa: E731
    cases = [
        (D.Decode, decode_pb2.DecodeRequest(session_id="pen", max_new_tokens=3, sampling=pen), "history"),
        (D.Draft, decode_pb2.DraftRequest(session_id="pen", k=3, sampling=pen), "history"),
        (D.Draft, decode_pb2.DraftRequest(session_id="pen", k=3, sampling=pen, history=hist(PROMPT[1:])),
         "history.token_ids"),
        (D.Draft, decode_pb2.DraftRequest(session_id="pen", k=3, sampling=pen, history=hist(PROMPT[:-1] + [512])),
         "history.token_ids"),
        (D.Draft, decode_pb2.DraftRequest(session_id="pen", k=3, sampling=pen, history=hist(PROMPT, 7)),
         "history.generated_from"),
        (D.Draft, decode_pb2.DraftRequest(session_id="pen", k=3, sampling=pen, history=hist(PROMPT), has_verdict=True),
         "history"),
    ]  # fmt: skip
    for fn, req, field in cases:
        got, details = _err(fn, req)
        assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", field), details
    d = D.Draft(decode_pb2.DraftRequest(session_id="pen", k=3, sampling=pen, history=hist(PROMPT)), timeout=T)
    assert list(d.draft_tokens) == want[1:4]
    v = w["P"].Verify(prefill_pb2.VerifyRequest(session_id="pen", tokens=want[:4]), timeout=T)
    assert (v.accepted, v.next_token) == (3, want[4])
    _rel(w, "pen")
    req = prefill_pb2.PrefillRequest(session_id="g", prompt_ids=PROMPT, generated_tokens=len(PROMPT))
    got, details = _err(w["P"].Prefill, req)
    assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", "generated_tokens"), details


def _stream(w, sid, only=None, **over):
    """A valid state stream (small chunks) of PROMPT from the prefill engine, header fields overridden;
    only: those tensors alone (ExactEngine.export)."""
    eng = w["ps"].engine
    s, first = eng.prefill(PROMPT, session_id=sid + "-src")
    try:
        tensors, pos, nxt = eng.export(s.id, only=only)
        kw = dict(session_id=sid, fingerprint=w["ps"].fingerprint, position=pos, next_token=nxt, chunk_bytes=4096)
        kw.update(over)
        return list(push.stream_state([t for t in tensors], **kw))
    finally:
        eng.release(s.id)


def test_bad_state_streams_are_refused_and_nothing_is_half_loaded(w, ref):
    D = w["D"]
    first = _load(w, "keep")
    good = _stream(w, "bad")
    assert len(good) > 4 and good[0].WhichOneof("part") == "header"
    flipped = [state_pb2.StateChunk() for _ in good]
    for a, b in zip(flipped, good):
        a.CopyFrom(b)
    data = bytearray(flipped[2].data)
    data[100] ^= 0x01
    flipped[2].data = bytes(data)
    foreign = _stream(w, "bad", fingerprint="sha256:" + "0" * 64)
    beyond = _stream(w, "bad")
    beyond[0].header.position = MAX_LEN + 1
    engine9 = _stream(w, "bad")
    engine9[0].header.engine = 9
    cases = [
        (flipped, "DATA_LOSS"),
        (good[:-1], "DATA_LOSS"),
        (good[:-2], "DATA_LOSS"),
        (good[1:], "DATA_LOSS"),
        (foreign, "FAILED_PRECONDITION"),
        (beyond, "INVALID_ARGUMENT"),
        (engine9, "INVALID_ARGUMENT"),
    ]
    for chunks, code in cases:
        with pytest.raises(grpc.RpcError) as ei:
            D.LoadState(iter(chunks), timeout=T)
        assert ei.value.code().name == code, ei.value.details()
        assert w["ds"].engine.session_count() == 1  # only "keep": nothing half-loaded
    r = D.LoadState(iter(good), timeout=T)  # the intact stream loads
    assert (r.session_id, r.position, r.bridge.tokens) == ("bad", len(PROMPT), len(PROMPT))
    assert r.bridge.chunks == len(good) - 2 and r.bridge.seconds > 0
    toks, _ = _decode(D, "keep", 12, ignore_eos=True, release_at_end=True)  # the old session is intact
    assert [first] + toks == ref[:13]
    toks, _ = _decode(D, "bad", 5, ignore_eos=True, release_at_end=True)
    assert toks == ref[1:6]


def test_a_draft_only_load_is_a_fraction_of_the_state_and_serves_exact_drafts_only(w, ref, lm):
    """PrefillRequest.draft_only (EXACT, engine MTP): the hand-off ships the hidden row and the MTP KV rows
    alone (bridge.draft_only; StateHeader.draft_only), and the decode worker's session is draft_only from its
    load: a fast Decode is FAILED_PRECONDITION, a verdict without hidden rows INVALID_ARGUMENT naming
    verdict_hidden (the session untouched), one with them goes on with the exact tokens. draft_only for
    another session (FAST, bf16) is INVALID_ARGUMENT naming it, on Prefill and on ExportState."""
    P, D, cfg = w["P"], w["D"], lm.cfg
    full = _handoff(w, "whole", engine=MTP, mode=EXACT)
    slim = _handoff(w, "slim", engine=MTP, mode=EXACT, draft_only=True)
    assert slim.bridge.draft_only and not full.bridge.draft_only and slim.first_token == full.first_token == ref[0]
    row = cfg.num_key_value_heads * cfg.head_dim * 4  # one position's key (or value) row, fp32
    assert dict(slim.bridge.bytes_by_kind) == {"hidden": cfg.hidden_size * 4, "attn_kv": 2 * len(PROMPT) * row}
    assert slim.bridge.total_bytes * 10 < full.bridge.total_bytes, (slim.bridge, full.bridge)
    assert w["ds"].engine.get("slim").draft_only and not w["ds"].engine.get("whole").draft_only
    got, details = _err(D.Decode, decode_pb2.DecodeRequest(session_id="slim", max_new_tokens=2))
    assert got == grpc.StatusCode.FAILED_PRECONDITION, details
    d = D.Draft(decode_pb2.DraftRequest(session_id="slim", k=3), timeout=T)  # from the prompt's pending pair
    assert d.position == len(PROMPT)
    req = prefill_pb2.VerifyRequest(session_id="slim", tokens=[ref[0], *d.draft_tokens], want_hidden=True)
    v = P.Verify(req, timeout=T)
    out = [ref[0], *d.draft_tokens[: v.accepted], v.next_token]
    assert out == ref[: len(out)]
    plain = dict(has_verdict=True, accepted=v.accepted, next_token=v.next_token)
    got, details = _err(D.Draft, decode_pb2.DraftRequest(session_id="slim", k=2, **plain))
    assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", "verdict_hidden"), details
    d = D.Draft(_with_hidden("slim", v), timeout=T)  # the same verdict with its hidden rows: applied
    assert d.position == len(PROMPT) + len(out) - 1
    for sid in ("slim", "whole"):
        _rel(w, sid)
    cases = [
        (P.Prefill, prefill_pb2.PrefillRequest(session_id="f", prompt_ids=PROMPT, engine=MTP, draft_only=True)),
        (P.Prefill, prefill_pb2.PrefillRequest(session_id="b", prompt_ids=PROMPT, mode=EXACT, engine=BF16,
                                               draft_only=True)),
    ]  # fmt: skip
    for fn, req in cases:
        got, details = _err(fn, req)
        assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", "draft_only"), details
    _load(w, "kb", engine=BF16, mode=EXACT)
    req = prefill_pb2.ExportStateRequest(session_id="kb", decode_target=w["target"], draft_only=True)
    got, details = _err(P.ExportState, req)
    assert (got.name, details.split(":")[0]) == ("INVALID_ARGUMENT", "draft_only"), details
    _rel(w, "kb")


def test_draft_only_states_are_loaded_only_when_marked_and_for_mtp(w, ref):
    """LoadState: a state that lacks the GDN / attention entries is refused unless its header says
    draft_only (INVALID_ARGUMENT "tensors"), and a draft-only header with more than the hidden row and the
    MTP KV, for another engine or for FAST mode is refused too; the flag set in flight on a stream sent
    without it fails the manifest (DATA_LOSS: it is part of the header); nothing is half-loaded. The intact
    draft-only stream loads as a draft_only session."""
    from baton.handoff.policy import DRAFT_ONLY_NAMES

    D, names = w["D"], list(w["ds"].engine.runners["mtp"].state.layout())
    exact = dict(mode=EXACT, engine=MTP)
    good = _stream(w, "dro", DRAFT_ONLY_NAMES, draft_only=True, **exact)
    cleared = _stream(w, "dro", DRAFT_ONLY_NAMES, draft_only=True, **exact)
    cleared[0].header.draft_only = False
    flipped = _stream(w, "dro", DRAFT_ONLY_NAMES, **exact)  # sent unmarked: its manifest covers that header
    flipped[0].header.draft_only = True
    cases = [
        (cleared, "INVALID_ARGUMENT", "tensors"),
        (_stream(w, "dro", DRAFT_ONLY_NAMES, **exact), "INVALID_ARGUMENT", "tensors"),
        (_stream(w, "dro", [n for n in names if n != "layers.0.conv"], **exact), "INVALID_ARGUMENT", "tensors"),
        (_stream(w, "dro", draft_only=True, **exact), "INVALID_ARGUMENT", "tensors"),
        (_stream(w, "dro", DRAFT_ONLY_NAMES, draft_only=True, mode=EXACT, engine=BF16), "INVALID_ARGUMENT",
         "draft_only"),
        (_stream(w, "dro", DRAFT_ONLY_NAMES, draft_only=True, engine=MTP), "INVALID_ARGUMENT", "draft_only"),
        (flipped, "DATA_LOSS", "manifest_sha256"),
    ]  # fmt: skip
    for chunks, code, field in cases:
        with pytest.raises(grpc.RpcError) as ei:
            D.LoadState(iter(chunks), timeout=T)
        assert (ei.value.code().name, ei.value.details().split(" ")[0].rstrip(":")) == (code, field), ei.value.details()
        assert w["ds"].engine.session_count() == 0  # nothing half-loaded
    r = D.LoadState(iter(good), timeout=T)
    assert r.bridge.draft_only and r.session_id == "dro" and w["ds"].engine.get("dro").draft_only
    d = D.Draft(decode_pb2.DraftRequest(session_id="dro", k=2), timeout=T)
    assert d.position == len(PROMPT)
    assert D.Release(common_pb2.ReleaseRequest(session_id="dro"), timeout=T).released


def test_every_rpc_needs_the_token(w):
    settings = Settings(token="t0k3n")
    svc = DecodeServicer(w["ds"].engine, fingerprint=w["ds"].fingerprint)
    h = build_server([(add_to_server, svc)], service_names=[SERVICE], port=0, settings=settings)
    try:
        with make_channel(h.address, Settings()) as ch:
            s = decode_pb2_grpc.DecodeWorkerStub(ch)
            calls = {
                "LoadState": iter(_stream(w, "auth")),
                "Decode": decode_pb2.DecodeRequest(session_id="a", max_new_tokens=1),
                "Draft": decode_pb2.DraftRequest(session_id="a", k=1),
                "DraftMany": decode_pb2.DraftManyRequest(requests=[decode_pb2.DraftRequest(session_id="a", k=1)]),
                "Release": common_pb2.ReleaseRequest(session_id="a"),
                "GetStats": common_pb2.WorkerStatsRequest(),
            }
            assert set(calls) == set(decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].methods_by_name)
            for name, req in calls.items():
                assert _err(getattr(s, name), req)[0] == grpc.StatusCode.UNAUTHENTICATED, name
        with make_channel(h.address, settings) as ch:
            st = decode_pb2_grpc.DecodeWorkerStub(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
            assert (
                st.engine.split(",") == ["bf16", "fp8", "mtp"]
                and st.max_len == MAX_LEN
                and st.model_fingerprint == w["ds"].fingerprint
            )
            # this process's threads by group (baton/thread_cpu.py): the gRPC handlers answered this call
            assert "baton-rpc" in st.thread_cpu_s and st.thread_cpu_s["main"] > 0, dict(st.thread_cpu_s)
            # and their CPU by call: a LoadState and a Decode charge theirs when they end
            stub = decode_pb2_grpc.DecodeWorkerStub(ch)
            stub.LoadState(iter(_stream(w, "cpu")), timeout=T)
            _decode(stub, "cpu", 3, ignore_eos=True, release_at_end=True)
            after = stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=T).thread_cpu_s
            for name in ("LoadState", "Decode"):
                assert after[f"rpc:{name}"] > st.thread_cpu_s.get(f"rpc:{name}", 0.0), (name, dict(after))
    finally:
        h.stop(0)
        svc.close()
