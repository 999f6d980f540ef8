"""PrefillWorker over real loopback gRPC: Verify exactness (issue 4), bad input, deadlines, auth, TTL."""

import random
import time

import grpc
import pytest
from helpers import make_tiny_dir

from baton.complete import complete
from baton.engine.runner import ModelRunner
from baton.loading import load_model
from baton.rpc import build_server, make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prefill_worker.engine import ExactEngine
from prefill_worker.serve import serve_prefill
from prefill_worker.service import SERVICE, PrefillServicer

MAX_LEN, W, T = 256, 16, 30  # window (same for complete()), row width, per-call deadline (s)
N = 64  # tokens per prompt in the exactness test
EXACT = common_pb2.EXACT


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype="fp32")


@pytest.fixture(scope="module")
def server(lm):
    handle, svc = serve_prefill(lm, max_len=MAX_LEN, width=W, slots=4, settings=Settings())
    yield handle, svc
    handle.stop(0)


@pytest.fixture(scope="module")
def stub(server):
    with make_channel(server[0].address, Settings()) as ch:
        yield prefill_pb2_grpc.PrefillWorkerStub(ch)


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "stub" in request.fixturenames:
        stub = request.getfixturevalue("stub")
        for _ in range(200):  # up to 10 s: a cancelled call may still be finishing on the server
            st = stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
            if st.sessions == 0 and st.outstanding == 0:
                break
            time.sleep(0.05)
        assert (st.sessions, st.session_bytes, st.outstanding) == (0, 0, 0), st


@pytest.fixture(scope="module")
def refs(lm):
    """The exact AR reference (`baton complete`) for 10 prompts, N + 8 tokens each."""
    rng = random.Random(7)
    prompts = [[rng.randrange(lm.cfg.vocab_size) for _ in range(rng.randrange(3, 40))] for _ in range(10)]
    return [(p, complete(None, p, N + 8, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)) for p in prompts]


def _err(fn, *a, **kw):
    with pytest.raises(grpc.RpcError) as ei:
        fn(*a, timeout=T, **kw)
    return ei.value.code(), ei.value.details()


def _normal(stub, lm):
    """A normal EXACT request that must succeed after every bad one."""
    r = stub.Prefill(prefill_pb2.PrefillRequest(session_id="ok", prompt_ids=[1, 2, 3], mode=EXACT), timeout=T)
    v = stub.Verify(prefill_pb2.VerifyRequest(session_id="ok", tokens=[r.first_token, 0]), timeout=T)
    assert v.position == 3 + 1 + v.accepted
    assert stub.Release(common_pb2.ReleaseRequest(session_id="ok"), timeout=T).released


# ---------------------------------------------------------------- exactness (issue 4 Done-when)
@pytest.mark.parametrize("K", [1, 4, 8])
def test_verify_with_mixed_drafter_is_token_identical_to_complete(stub, lm, refs, K):
    rng, vocab = random.Random(K), lm.cfg.vocab_size
    rejected_at = set()
    for i, (prompt, ref) in enumerate(refs):
        sid = f"x{K}-{i}"
        r = stub.Prefill(prefill_pb2.PrefillRequest(session_id=sid, prompt_ids=prompt, mode=EXACT), timeout=T)
        assert r.first_token == ref[0] and r.prompt_tokens == len(prompt)
        out, rnd = [r.first_token], 0
        while len(out) < N:
            base = len(out)
            drafts = ref[base : base + K]
            # forced pattern: all right / wrong first / all right / wrong last / wrong middle / seeded
            kind = ("ok", "first", "ok", "last", "middle", "rng")[rnd % 6]
            j = {
                "ok": None,
                "first": 0,
                "last": K - 1,
                "middle": rng.randrange(1, K - 1) if K > 2 else None,
                "rng": rng.choice([None, rng.randrange(K)]),
            }[kind]
            if j is not None:
                drafts[j] = (drafts[j] + 1 + rng.randrange(vocab - 1)) % vocab
            v = stub.Verify(prefill_pb2.VerifyRequest(session_id=sid, tokens=[out[-1]] + drafts), timeout=T)
            assert v.accepted == (K if j is None else j)
            assert v.next_token == ref[base + v.accepted]
            if v.accepted < K:
                rejected_at.add("first" if v.accepted == 0 else "last" if v.accepted == K - 1 else "middle")
            out += drafts[: v.accepted] + [v.next_token]
            assert v.position == len(prompt) + len(out) - 1
            assert v.counters.verify_blocks == rnd + 1
            rnd += 1
        c = v.counters
        assert c.drafted == K * rnd and 0 < c.accepted < c.drafted and c.rejected_blocks > 0
        assert c.acceptance_rate == pytest.approx(c.accepted / c.drafted)
        assert stub.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T).released
        assert out[:N] == ref[:N], f"prompt {i}: verified output differs from complete()"
    assert rejected_at == ({"first"} if K == 1 else {"first", "middle", "last"})  # K=1: first is last


# ---------------------------------------------------------------- bad input, each then a normal request
def _prefill(stub, ids, **kw):
    return lambda timeout: stub.Prefill(prefill_pb2.PrefillRequest(prompt_ids=ids, **kw), timeout=timeout)


BAD_PREFILL = {
    "id out of range": ([1, 512, 2], {}, "prompt_ids"),
    "empty prompt": ([], {}, "prompt_ids"),
    "prompt longer than window": ([1] * (MAX_LEN - W + 1), {}, "prompt_ids"),
    "exact without session_id": ([1, 2], {"mode": EXACT}, "session_id"),
    "unknown mode": ([1, 2], {"mode": 9}, "mode"),
    "unknown engine": ([1, 2], {"engine": 9}, "engine"),
}


@pytest.mark.parametrize("case", BAD_PREFILL)
def test_prefill_bad_input_is_invalid_argument(stub, lm, case):
    ids, kw, field = BAD_PREFILL[case]
    code, details = _err(_prefill(stub, ids, **kw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
    _normal(stub, lm)


def test_longest_prompt_that_fits_is_accepted(stub):
    r = stub.Prefill(prefill_pb2.PrefillRequest(prompt_ids=[3] * (MAX_LEN - W)), timeout=T)
    assert r.prompt_tokens == MAX_LEN - W and r.prefill_seconds > 0


def _verify(stub, sid, tokens):
    return lambda timeout: stub.Verify(prefill_pb2.VerifyRequest(session_id=sid, tokens=tokens), timeout=timeout)


def test_verify_bad_input(stub, lm):
    code, details = _err(_verify(stub, "nope", [1, 2]))
    assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details and "nope" in details
    _normal(stub, lm)
    r = stub.Prefill(prefill_pb2.PrefillRequest(session_id="b", prompt_ids=[4, 5, 6], mode=EXACT), timeout=T)
    t0 = r.first_token
    cases = [
        ([t0], "tokens"),  # K = 0
        ([t0] + [1] * W, "tokens"),  # K = W
        ([t0, 512], "tokens"),  # id out of range
        ([(t0 + 1) % 512, 1], "tokens[0]"),
    ]  # not the pending token
    for tokens, field in cases:
        code, details = _err(_verify(stub, "b", tokens))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
        v = stub.Verify(prefill_pb2.VerifyRequest(session_id="b", tokens=[t0, 0]), timeout=T)  # still serves
        t0 = v.next_token
    assert stub.Release(common_pb2.ReleaseRequest(session_id="b"), timeout=T).released
    assert not stub.Release(common_pb2.ReleaseRequest(session_id="b"), timeout=T).released
    code, details = _err(_verify(stub, "b", [t0, 1]))  # after Release
    assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details
    _normal(stub, lm)


def test_verify_past_the_window_is_out_of_range(stub, lm):
    prompt = [7] * (MAX_LEN - W)
    r = stub.Prefill(prefill_pb2.PrefillRequest(session_id="w", prompt_ids=prompt, mode=EXACT), timeout=T)
    wrong = (r.first_token + 1) % 512
    v = stub.Verify(prefill_pb2.VerifyRequest(session_id="w", tokens=[r.first_token] + [wrong] * (W - 1)), timeout=T)
    assert v.position == MAX_LEN - W + 1  # m = 0: one row consumed
    code, details = _err(_verify(stub, "w", [v.next_token] + [1] * (W - 1)))  # 16 rows at 241 > 256
    assert code == grpc.StatusCode.OUT_OF_RANGE and details.startswith("tokens") and "window" in details
    stub.Verify(prefill_pb2.VerifyRequest(session_id="w", tokens=[v.next_token, 1]), timeout=T)  # fits
    stub.Release(common_pb2.ReleaseRequest(session_id="w"), timeout=T)
    _normal(stub, lm)


def test_duplicate_session_and_export_errors(stub, lm):
    stub.Prefill(prefill_pb2.PrefillRequest(session_id="d", prompt_ids=[1, 2], mode=EXACT), timeout=T)
    code, details = _err(_prefill(stub, [1, 2], session_id="d", mode=EXACT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("session_id")
    export = stub.ExportState
    code, details = _err(export, prefill_pb2.ExportStateRequest(session_id="d"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("decode_target")
    code, details = _err(export, prefill_pb2.ExportStateRequest(session_id="zz", decode_target="127.0.0.1:1"))
    assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details
    stub.Release(common_pb2.ReleaseRequest(session_id="d"), timeout=T)
    _normal(stub, lm)


def test_stats_and_counters(stub, server, lm):
    st = stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
    assert st.model_fingerprint == lm.fingerprint and st.max_len == MAX_LEN and st.engine == "exact"
    before = st.requests_total
    stub.Prefill(prefill_pb2.PrefillRequest(session_id="s", prompt_ids=[1, 2, 3], mode=EXACT), timeout=T)
    st = stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
    state = server[1].engine.runner.state
    held = state.o1_slot_bytes() + 1 * state.page_bytes()  # a 3-token prompt holds one KV page (of the window's)
    assert (st.sessions, st.session_bytes, st.requests_total) == (1, held, before + 1)
    stub.Release(common_pb2.ReleaseRequest(session_id="s"), timeout=T)


def test_expired_deadline_leaves_no_session(stub, lm):
    for mode in (EXACT, common_pb2.FAST):
        code, details = _err(
            lambda timeout: stub.Prefill(
                prefill_pb2.PrefillRequest(session_id=f"late{mode}", prompt_ids=[5] * 200, mode=mode), timeout=0.001
            )
        )
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
    # no_leaks (autouse) waits for the server side to finish and checks sessions == 0
    _normal(stub, lm)


def test_ttl_reaper_releases_idle_sessions(lm):
    engine = ExactEngine(ModelRunner(lm.model, slots=1, max_len=64, width=W), ttl_s=0.2)
    svc = PrefillServicer(engine, fingerprint=lm.fingerprint, reap_interval_s=0.05)
    try:
        engine.prefill([1, 2, 3], session_id="idle")
        assert engine.session_count() == 1
        for _ in range(100):
            if engine.session_count() == 0:
                break
            time.sleep(0.02)
        assert engine.session_count() == 0
    finally:
        svc.close()


def test_every_rpc_needs_the_token(lm):
    settings = Settings(token="t0k3n")
    svc = PrefillServicer(ExactEngine(ModelRunner(lm.model, slots=1, max_len=64, width=W)), fingerprint=lm.fingerprint)
    handle = build_server(
        [(prefill_pb2_grpc.add_PrefillWorkerServicer_to_server, svc)],
        service_names=[SERVICE],
        port=0,
        settings=settings,
    )
    try:
        with make_channel(handle.address, Settings()) as ch:  # no token
            s = prefill_pb2_grpc.PrefillWorkerStub(ch)
            calls = {
                "Prefill": prefill_pb2.PrefillRequest(prompt_ids=[1]),
                "PrefillStream": prefill_pb2.PrefillRequest(prompt_ids=[1]),
                "Verify": prefill_pb2.VerifyRequest(session_id="a", tokens=[1, 2]),
                "VerifyMany": prefill_pb2.VerifyManyRequest(requests=[prefill_pb2.VerifyRequest(session_id="a")]),
                "Release": common_pb2.ReleaseRequest(session_id="a"),
                "ExportState": prefill_pb2.ExportStateRequest(session_id="a"),
                "GetStats": common_pb2.WorkerStatsRequest(),
            }
            assert set(calls) == set(prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].methods_by_name)
            for name, req in calls.items():
                fn = getattr(s, name)
                call = (lambda r, fn=fn, **kw: list(fn(r, **kw))) if name == "PrefillStream" else fn  # a stream
                assert _err(call, req)[0] == grpc.StatusCode.UNAUTHENTICATED, name
        with make_channel(handle.address, settings) as ch:  # with the token: served
            r = prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(prefill_pb2.PrefillRequest(prompt_ids=[1]), timeout=T)
            assert r.prompt_tokens == 1
        assert svc.engine.session_count() == 0
    finally:
        handle.stop(0)
        svc.close()


class _FlakyRelease(decode_pb2_grpc.DecodeWorkerServicer):  # the other RPCs: UNIMPLEMENTED
    """A decode worker whose Release answers `codes` in turn (then OK), counting the calls."""

    def __init__(self, codes):
        self.codes, self.calls = list(codes), 0

    def Release(self, request, context):
        self.calls += 1
        if self.codes:
            context.abort(self.codes.pop(0), "not now")
        return common_pb2.ReleaseResponse(released=True)


@pytest.mark.parametrize(
    "codes,calls",
    [
        ([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED], 3),  # transient: retried until OK
        ([grpc.StatusCode.UNAVAILABLE] * 5, 3),  # gives up after 3 attempts
        ([grpc.StatusCode.NOT_FOUND], 1),  # never loaded: no retry
    ],
)
def test_release_after_a_cancelled_prefill_is_retried_on_transient_errors(codes, calls):
    """PrefillServicer._release_remote (a cancelled Prefill whose state may have landed), against a real
    loopback decode worker endpoint whose Release fails first."""
    from types import SimpleNamespace

    from baton.handoff.channels import ChannelPool
    from decode_worker.service import SERVICE as DECODE

    svc = _FlakyRelease(codes)
    h = build_server(
        [(decode_pb2_grpc.add_DecodeWorkerServicer_to_server, svc)], service_names=[DECODE], port=0, settings=Settings()
    )
    me = SimpleNamespace(channels=ChannelPool(), settings=Settings())
    try:
        t0 = time.perf_counter()
        PrefillServicer._release_remote(me, h.address, "s1", backoff_s=0.01)
        assert svc.calls == calls and time.perf_counter() - t0 < 5
    finally:
        me.channels.close()
        h.stop(0)


def test_warm_up_prefills_leave_no_session_and_exact_results(tmp_path):
    """ExactEngine.warm_up (run before a CUDA prefill worker serves) releases every slot it used and
    leaves later results bitwise unchanged."""
    from helpers import make_tiny_dir

    from baton.engine.runner import ModelRunner
    from baton.loading import load_model
    from prefill_worker.engine import ExactEngine

    lm = load_model(make_tiny_dir(tmp_path), dtype="fp32")
    eng = ExactEngine(ModelRunner(lm.model, max_len=128, width=8, slots=2))
    prompt = [5, 17, 33, 200, 7]
    before = eng.generate(prompt, 6)
    assert eng.warm_up(lengths=(1, 17, 500)) > 0  # 500 is capped at max_len - W
    assert eng.session_count() == 0
    assert eng.generate(prompt, 6) == before


def test_verify_draft_probs_follow_the_sessions_exact_policy(stub, lm):
    """A REJECTION-policy session (T > 0) must send each draft's q' (TokenDistribution); a malformed one,
    or one sent for a COUPLING / greedy session, is INVALID_ARGUMENT naming draft_probs."""
    D = common_pb2.TokenDistribution
    sp = common_pb2.SamplingParams(temperature=0.8, seed=3, exact_policy=common_pb2.REJECTION)
    req = prefill_pb2.PrefillRequest(session_id="rj", prompt_ids=[4, 5, 6], mode=EXACT, sampling=sp)
    t0 = stub.Prefill(req, timeout=T).first_token
    bad = [
        ([], "draft_probs: 0 distributions"),  # none
        ([D(token_ids=[2], probs=[1.0])], "draft_probs[0]: the draft 1"),  # draft outside the support
        ([D(token_ids=[1], probs=[0.5])], "draft_probs[0]: probs"),
    ]
    for probs, why in bad:
        code, details = _err(stub.Verify, prefill_pb2.VerifyRequest(session_id="rj", tokens=[t0, 1], draft_probs=probs))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(why), details
    ok = [D(token_ids=[1, 2], probs=[0.5, 0.5])]
    v = stub.Verify(prefill_pb2.VerifyRequest(session_id="rj", tokens=[t0, 1], draft_probs=ok), timeout=T)
    assert v.position == 3 + 1 + v.accepted
    assert stub.Release(common_pb2.ReleaseRequest(session_id="rj"), timeout=T).released
    r = stub.Prefill(prefill_pb2.PrefillRequest(session_id="cp", prompt_ids=[4, 5, 6], mode=EXACT), timeout=T)
    code, details = _err(
        stub.Verify, prefill_pb2.VerifyRequest(session_id="cp", tokens=[r.first_token, 1], draft_probs=ok)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("draft_probs: only"), details
    assert stub.Release(common_pb2.ReleaseRequest(session_id="cp"), timeout=T).released


def test_verify_many_answers_each_block_as_its_own_verify_would(stub, lm, refs):
    """VerifyMany of [a good block, an unknown session, a block whose t0 is not the pending token, the same
    session twice, a block too long] -> OK / NOT_FOUND / INVALID_ARGUMENT / ABORTED / INVALID_ARGUMENT
    item by item (past the window: OUT_OF_RANGE); the good verdict equals a twin session's unary Verify."""
    (p1, ref1), (p2, _) = refs[0], refs[1]
    first = {}
    for sid, p in (("m1", p1), ("t1", p1), ("m2", p2), ("w", [7] * (MAX_LEN - W))):
        r = stub.Prefill(prefill_pb2.PrefillRequest(session_id=sid, prompt_ids=p, mode=EXACT), timeout=T)
        first[sid] = r.first_token
    block = [first["m1"], *ref1[1:4], (ref1[4] + 1) % 512]  # three right drafts, then a wrong one
    wrong = (first["m2"] + 1) % 512
    reqs = [
        prefill_pb2.VerifyRequest(session_id="m1", tokens=block),
        prefill_pb2.VerifyRequest(session_id="nope", tokens=[1, 2]),
        prefill_pb2.VerifyRequest(session_id="m2", tokens=[wrong, 1]),
        prefill_pb2.VerifyRequest(session_id="m1", tokens=block),
        prefill_pb2.VerifyRequest(session_id="w", tokens=[first["w"]] + [1] * W),
    ]
    out = stub.VerifyMany(prefill_pb2.VerifyManyRequest(requests=reqs), timeout=T).outcomes
    C = grpc.StatusCode
    codes = [o.status.code for o in out]
    assert codes == [
        0,
        C.NOT_FOUND.value[0],
        C.INVALID_ARGUMENT.value[0],
        C.ABORTED.value[0],
        C.INVALID_ARGUMENT.value[0],
    ]
    assert out[2].status.message.startswith("tokens[0]") and "nope" in out[1].status.message
    twin = stub.Verify(prefill_pb2.VerifyRequest(session_id="t1", tokens=block), timeout=T)
    assert out[0].response.accepted == 3 and out[0].response == twin
    # m2 was left untouched by its bad item: its right block still verifies; then a batch past the window
    ok = stub.VerifyMany(
        prefill_pb2.VerifyManyRequest(requests=[prefill_pb2.VerifyRequest(session_id="m2", tokens=[first["m2"], 1])]),
        timeout=T,
    )
    assert (
        ok.outcomes[0].status.code == 0
        and ok.outcomes[0].response.position == len(p2) + 1 + ok.outcomes[0].response.accepted
    )
    v = stub.Verify(
        prefill_pb2.VerifyRequest(session_id="w", tokens=[first["w"]] + [(first["w"] + 1) % 512] * (W - 1)), timeout=T
    )
    far = stub.VerifyMany(
        prefill_pb2.VerifyManyRequest(
            requests=[prefill_pb2.VerifyRequest(session_id="w", tokens=[v.next_token] + [1] * (W - 1))]
        ),
        timeout=T,
    )
    assert far.outcomes[0].status.code == C.OUT_OF_RANGE.value[0] and far.outcomes[0].status.message.startswith(
        "tokens"
    )
    assert stub.VerifyMany(prefill_pb2.VerifyManyRequest(), timeout=T).outcomes == []
    for sid in ("m1", "t1", "m2", "w"):
        stub.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T)
    _normal(stub, lm)


def test_the_pool_holds_the_prefix_cache_beside_every_slots_full_window(lm):
    """serve_prefill sizes the KV pool for every slot's full window plus the prefix cache's entries (a piece's
    pages each), so that sessions filling every slot still leave the cached prefixes their pages (on an H100 a
    pool capped at the slots' windows restored 4 of 16 prompts sharing a 17K-token system prompt)."""
    from baton.engine.pages import pages_for
    from baton.engine.prefill import PREFILL_CHUNK

    handle, svc = serve_prefill(lm, max_len=MAX_LEN, width=W, slots=2, settings=Settings(), prefix_cache=3)
    try:
        with make_channel(handle.address, Settings()) as ch:
            st = prefill_pb2_grpc.PrefillWorkerStub(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
        assert st.kv_pages == 2 * pages_for(MAX_LEN) + 3 * pages_for(PREFILL_CHUNK)
        assert st.kv_pages_free == st.kv_pages and st.prefix_cache_entries == 0
    finally:
        handle.stop(0)
    handle, _ = serve_prefill(lm, max_len=MAX_LEN, width=W, slots=2, settings=Settings(), prefix_cache=0)
    try:
        with make_channel(handle.address, Settings()) as ch:
            st = prefill_pb2_grpc.PrefillWorkerStub(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
        assert st.kv_pages == 2 * pages_for(MAX_LEN)  # no cache: the slots' windows alone
    finally:
        handle.stop(0)
