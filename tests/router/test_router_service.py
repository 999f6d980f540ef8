"""Router Generate against fake workers over loopback: relays, stop conditions, validation, limits,
cancellation, deadlines, prefill retry, migration on decode death (both modes)."""

import threading
import time

import fakes
import grpc
import pytest
from fakes import EOS, SAY_EOS, Cluster, draft_next, exact_next, reference

from baton.v1 import common_pb2
from router.service import RouterConfig

PROMPT = [5, 6, 7]


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def _code(fn):
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code(), ei.value.details()


def _fast_chain_ok(prompt, out, engine):
    """Every token follows the context before it, by the exact or the engine's rule: a lost or
    repeated token breaks the chain."""
    ctx = list(prompt)
    for t in out:
        assert t in (exact_next(ctx), draft_next(ctx, engine)), (ctx, t)
        ctx.append(t)


# ---- relays -------------------------------------------------------------------------------------
def test_fast_bf16_relay_and_final_message(cluster):
    out, deltas = cluster.run(PROMPT, max_new_tokens=12, engine="bf16", request_id="r-1")
    assert out == reference(PROMPT, 12)
    last = deltas[-1]
    assert last.finish_reason == "LENGTH" and all(d.finish_reason is None for d in deltas[:-1])
    assert last.usage == {"prompt_tokens": 3, "completion_tokens": 12, "cached_tokens": 0}
    assert last.stats["request_id"] == "r-1" and last.stats["ttft_ms"] > 0 and last.stats["bridge_bytes"] > 0
    # the hand-off as the router saw it: the first token -> the state landed -> the decode worker's tokens
    assert last.stats["handoff_ms"] > 0 and last.stats["first_decode_ms"] > 0
    decodes = [r for w in cluster.decode for m, r in w.servicer.calls if m == "Decode"]
    assert [r.max_new_tokens for r in decodes] == [11]  # the first token comes from Prefill
    assert cluster.wait_sessions_zero()


def test_fast_fp8_tokens_come_from_the_decode_engine(cluster):
    out, _ = cluster.run(PROMPT, max_new_tokens=20, engine="fp8")
    ctx = list(PROMPT) + [out[0]]
    want = [out[0]]
    for _ in range(19):
        want.append(draft_next(ctx, "fp8"))
        ctx.append(want[-1])
    assert out[0] == exact_next(PROMPT) and out == want


@pytest.mark.parametrize("engine", ["fp8", "mtp"])
@pytest.mark.parametrize("k", [1, 4, 14])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_exact_mode_is_token_identical(engine, k, policy):
    """Either draft-length policy: the verified tokens; fixed sends the request's K every round, adaptive
    any K in 1..max(K_max, the request's K) (baton/engine/draft_length.py)."""
    cluster = Cluster(config=RouterConfig(call_timeout_s=2.0, migrate_wait_s=1.0, draft_length=policy))
    try:
        _exact_identical(cluster, engine, k, policy)
    finally:
        cluster.close()


def _exact_identical(cluster, engine, k, policy):
    for prompt in ([5, 6, 7], [1], [40, 2, 9, 33]):
        out, deltas = cluster.run(prompt, max_new_tokens=30, mode="exact", engine=engine, draft_block=k)
        assert out == reference(prompt, 30)
        st = deltas[-1].stats
        # the fake drafter is sometimes wrong: under fixed K in every request; adaptive K follows the timing, and
        # a K = 1 schedule can meet only right drafts (CI at 2a3cc10: 19 of 19)
        assert 0 < st["accepted"] < st["drafted"] if policy == "fixed" else 0 < st["accepted"] <= st["drafted"]
        assert st["acceptance_rate"] == pytest.approx(st["accepted"] / st["drafted"])
    assert cluster.wait_sessions_zero()
    ks = {r.k for w in cluster.decode for m, r in w.servicer.calls if m == "Draft"}
    if policy == "fixed":
        assert max(ks) == min(k, 29)
    else:
        assert 1 <= min(ks) and max(ks) <= max(k, RouterConfig.max_adaptive_k)


def test_text_prompt_and_text_deltas():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from baton.tokenizer import Tokenizer
    from router.service import ModelMeta

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    tok = Tokenizer(hf, (EOS,))
    c = Cluster(meta=ModelMeta("bytes", 256, (EOS,), tok))
    try:
        prompt = tok.encode("héllo")
        out, deltas = c.run("héllo", max_new_tokens=16)
        assert out == reference(prompt, 16)
        assert "".join(d.text for d in deltas) == tok.decode(out)
    finally:
        c.close()


# ---- stop conditions ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_stop_eos_and_max_new_tokens(cluster, mode):
    ref = reference(PROMPT, 20)
    stop = ref[6]
    out, d = cluster.run(PROMPT, max_new_tokens=20, mode=mode, stop_token_ids=[stop])
    assert out == ref[: ref.index(stop) + 1] and d[-1].finish_reason == "STOP"
    eos_prompt = [SAY_EOS, 3]
    out, d = cluster.run(eos_prompt, max_new_tokens=20, mode=mode)
    assert out[-1] == EOS and out == reference(eos_prompt, 20) and d[-1].finish_reason == "EOS"
    out, d = cluster.run(eos_prompt, max_new_tokens=20, mode=mode, ignore_eos=True)
    assert len(out) == 20 and EOS in out and d[-1].finish_reason == "LENGTH"
    out, d = cluster.run(PROMPT, max_new_tokens=1, mode=mode)
    assert out == ref[:1] and d[-1].finish_reason == "LENGTH" and len(d) == 1
    assert d[-1].stats["first_decode_ms"] == 0  # no tokens after the first: no decode to time
    out, d = cluster.run(PROMPT, max_new_tokens=20, mode=mode, stop_token_ids=[ref[0]])
    assert out == ref[:1] and d[-1].finish_reason == "STOP"
    assert cluster.wait_sessions_zero()


# ---- validation and limits ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1, fakes.VOCAB]), "token_ids"),
        (dict(prompt=[1] * 4090), "prompt"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=5000), "max_new_tokens"),
        (dict(max_new_tokens=4090), "max_new_tokens"),
        (dict(draft_block=15), "draft_block"),
        (dict(stop_token_ids=[fakes.VOCAB + 1]), "stop_token_ids"),
        (dict(request_id="x" * 200), "request_id"),
        (dict(prompt="text"), "prompt"),  # this router has no tokenizer
    ],
)
def test_invalid_arguments_name_the_field(cluster, kw, field):
    kw = {"prompt": PROMPT, "max_new_tokens": 8, **kw}
    code, details = _code(lambda: cluster.run(kw.pop("prompt"), **kw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":"), details
    assert cluster.run(PROMPT, max_new_tokens=3)[0] == reference(PROMPT, 3)  # still serving


def test_unknown_enum_values(cluster):
    from baton.v1 import router_pb2

    for field, value in (("mode", 7), ("engine", 9)):
        req = router_pb2.GenerateRequest(max_new_tokens=4, **{field: value})
        req.token_ids.ids.extend(PROMPT)
        code, details = _code(lambda: list(cluster.client._stub.Generate(req, timeout=5)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":")


def test_engine_not_offered():
    c = Cluster(engines=("bf16", "mtp"))
    try:
        code, details = _code(lambda: c.run(PROMPT, max_new_tokens=4, engine="fp8"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("engine:") and "bf16, mtp" in details
        info = c.client.model_info()
        assert list(info.engines) == [1, 3] and info.vocab_size == fakes.VOCAB and info.fingerprint == "fake-fp"
        assert info.max_context == 4096 and info.max_draft_block == 14 and info.default_draft_block == 4
    finally:
        c.close()


def test_a_generate_s_equal_prompts_reach_its_prefill():
    """GenerateRequest.equal_prompts (baton.client generate(equal_prompts=N)) is relayed to the Prefill of the
    request's prompt: the prefill worker's pass waits for the announced others (prefill_worker/announced.py)."""
    c = Cluster(n_prefill=1, n_decode=1)
    try:
        c.run(PROMPT, max_new_tokens=2, equal_prompts=3)
        c.run(PROMPT, max_new_tokens=2)
        got = [r.equal_prompts for m, r in c.prefill[0].servicer.calls if m == "Prefill"]
        assert got == [3, 0]
    finally:
        c.close()


@pytest.mark.parametrize("engines,want", [(("fp8", "bf16", "mtp"), "FP8"), (("mtp", "bf16"), "MTP")])
def test_unspecified_engine_is_named_in_the_prefill_as_the_decode_workers_default(engines, want):
    """The prefill worker ships the MTP KV only to sessions that can read it (baton.handoff.policy.needs_mtp_kv),
    so the router names the picked decode worker's default engine instead of leaving it UNSPECIFIED;
    an explicit engine passes through as asked."""
    from baton.v1 import common_pb2

    c = Cluster(n_prefill=1, n_decode=1, engines=engines)
    try:
        for kw in ({}, {"engine": "bf16"}):
            out, _ = c.run(PROMPT, max_new_tokens=4, **kw)
            assert out[0] == exact_next(PROMPT)
        got = [common_pb2.Engine.Name(r.engine) for m, r in c.prefill[0].servicer.calls if m == "Prefill"]
        assert got == [want, "BF16"]
    finally:
        c.close()


def test_resource_exhausted_past_max_inflight():
    c = Cluster(config=RouterConfig(max_inflight=2))
    try:
        for w in c.decode:
            w.servicer.delay = 0.05
        streams = [c.client.generate(PROMPT, max_new_tokens=40, timeout=10) for _ in range(2)]
        for s in streams:
            next(s)  # both admitted and streaming
        t0 = time.monotonic()
        code, details = _code(lambda: c.run(PROMPT, max_new_tokens=4))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - t0 < 1.0
        for s in streams:
            s.close()
        assert c.wait_sessions_zero()
        time.sleep(0.2)
        assert c.run(PROMPT, max_new_tokens=3)[0] == reference(PROMPT, 3)
    finally:
        c.close()


def test_full_decode_worker_is_resource_exhausted_not_unavailable():
    """A decode target's slots are full (the prefill worker passes the refusal on, naming the
    decode_target): another decode worker is tried; with none left the client gets RESOURCE_EXHAUSTED,
    the documented "retry later", not UNAVAILABLE (found by tests/system/test_reliability_load.py)."""
    full = (grpc.StatusCode.RESOURCE_EXHAUSTED, "decode_target x: hand-off failed: all 8 session slots are in use")
    for n_decode in (1, 2):
        c = Cluster(n_prefill=1, n_decode=n_decode)
        try:
            for mode in ("fast", "exact"):
                c.prefill[0].servicer.fail["Prefill"] = full
                if n_decode == 1:
                    code, details = _code(lambda: c.run(PROMPT, max_new_tokens=4, mode=mode))
                    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "session slots" in details, details
                else:
                    assert c.run(PROMPT, max_new_tokens=4, mode=mode)[0] == reference(PROMPT, 4)
                for w in c.servicer.registry.workers("decode"):
                    w.full_until = 0.0  # end the router's hold on a worker that refused (tested below)
            assert c.run(PROMPT, max_new_tokens=4)[0] == reference(PROMPT, 4)
            assert c.wait_sessions_zero()
        finally:
            c.close()


def test_a_full_decode_worker_gets_no_prefill_until_one_of_its_requests_ends():
    """After a decode worker refused for full slots, new requests are refused at the router (no Prefill,
    no hand-off spent on them) while it holds as many of our requests; one ending frees it at once."""
    full = (grpc.StatusCode.RESOURCE_EXHAUSTED, "decode_target x: hand-off failed: all 8 session slots are in use")
    c = Cluster(n_prefill=1, n_decode=1)
    try:
        c.decode[0].servicer.delay = 0.02
        running = c.client.generate(PROMPT, max_new_tokens=40, timeout=10)
        first = next(running)  # one request holds a session on the decode worker
        c.prefill[0].servicer.fail["Prefill"] = full
        assert _code(lambda: c.run(PROMPT, max_new_tokens=4))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        prefills = sum(m == "Prefill" for m, _ in c.prefill[0].servicer.calls)
        code, details = _code(lambda: c.run(PROMPT, max_new_tokens=4))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "all session slots" in details, details
        assert sum(m == "Prefill" for m, _ in c.prefill[0].servicer.calls) == prefills  # refused before Prefill
        assert first.token_ids + [t for d in running for t in d.token_ids] == reference(PROMPT, 40)
        assert c.wait_sessions_zero()
        assert c.run(PROMPT, max_new_tokens=4)[0] == reference(PROMPT, 4)  # its slot is free: served
    finally:
        c.close()


# ---- cancellation and deadlines -----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_client_cancel_releases_both_sessions(cluster, mode):
    for w in cluster.workers:
        w.servicer.delay = 0.05
    stream = cluster.client.generate(PROMPT, max_new_tokens=200, mode=mode, timeout=30)
    got = [next(stream) for _ in range(3)]
    assert len(got) == 3 and cluster.sessions() >= 1
    t0 = time.monotonic()
    stream.close()  # cancels the call
    assert cluster.wait_sessions_zero(2.0), [w.sessions for w in cluster.workers]
    assert time.monotonic() - t0 < 2.0


def test_deadline_reaches_downstream_calls(cluster):
    for w in cluster.decode:
        w.servicer.hang.add("Decode")
    t0 = time.monotonic()
    code, _ = _code(lambda: cluster.run(PROMPT, max_new_tokens=10, timeout=0.5))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1.5
    assert cluster.wait_sessions_zero(2.0)


# ---- failures -----------------------------------------------------------------------------------
def test_prefill_failure_is_retried_once(cluster):
    assert cluster.wait_up()
    cluster.prefill[0].servicer.fail["Prefill"] = grpc.StatusCode.INTERNAL
    cluster.prefill[1].servicer.fail["Prefill"] = grpc.StatusCode.INTERNAL
    code, _ = _code(lambda: cluster.run(PROMPT, max_new_tokens=5))
    assert code == grpc.StatusCode.UNAVAILABLE  # two failures: no third try
    assert sum(m == "Prefill" for w in cluster.prefill for m, _ in w.servicer.calls) == 2
    cluster.prefill[0].servicer.fail["Prefill"] = grpc.StatusCode.UNAVAILABLE
    for mode in ("fast", "exact"):
        assert cluster.wait_up()  # the faults marked the workers down until the health poll answers
        out, _ = cluster.run(PROMPT, max_new_tokens=8, mode=mode)
        assert out == reference(PROMPT, 8)
    assert b"baton_router_prefill_retries_total 2.0" in cluster.servicer.metrics.render()
    assert cluster.wait_sessions_zero()


def test_prefill_refusal_is_passed_through(cluster):
    cluster.prefill[0].servicer.fail["Prefill"] = grpc.StatusCode.INVALID_ARGUMENT
    cluster.prefill[1].servicer.fail["Prefill"] = grpc.StatusCode.INVALID_ARGUMENT
    code, details = _code(lambda: cluster.run(PROMPT, max_new_tokens=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fake Prefill failure" in details


def test_unavailable_without_workers():
    c = Cluster(n_decode=1)
    try:
        c.decode[0].stop()
        deadline = time.monotonic() + 3
        while c.servicer.registry.up("decode") and time.monotonic() < deadline:
            time.sleep(0.05)
        code, details = _code(lambda: c.run(PROMPT, max_new_tokens=5))
        assert code == grpc.StatusCode.UNAVAILABLE and "decode" in details
    finally:
        c.close()


@pytest.mark.parametrize("engine", ["bf16", "fp8"])
def test_fast_migration_on_decode_death(cluster, engine):
    shared = {"Decode.token": 5}  # whichever decode worker streams dies at its 5th
    for w in cluster.decode:
        w.servicer.die_on = shared
    out, deltas = cluster.run(PROMPT, max_new_tokens=40, engine=engine)
    assert len(out) == 40 and deltas[-1].stats["migrations"] == 1
    if engine == "bf16":
        assert out == reference(PROMPT, 40)
    _fast_chain_ok(PROMPT, out, engine)
    assert cluster.wait_sessions_zero()


@pytest.mark.parametrize("engine", ["fp8", "mtp"])
def test_exact_migration_on_decode_death(cluster, engine):
    shared = {"Draft": 3}
    for w in cluster.decode:
        w.servicer.die_on = shared
    out, deltas = cluster.run(PROMPT, max_new_tokens=40, mode="exact", engine=engine)
    assert out == reference(PROMPT, 40) and deltas[-1].stats["migrations"] == 1
    assert any(m == "ExportState" for w in cluster.prefill for m, _ in w.servicer.calls)
    assert cluster.wait_sessions_zero()


def test_exact_migration_on_hung_decode_worker(cluster):
    cluster.decode[0].servicer.hang.add("Draft")  # a fresh cluster picks decode[0] first
    out, deltas = cluster.run(PROMPT, max_new_tokens=12, mode="exact", engine="fp8", timeout=15)
    assert out == reference(PROMPT, 12) and deltas[-1].stats["migrations"] == 1
    assert cluster.wait_sessions_zero()


def test_fast_migration_on_frozen_decode_stream(cluster):
    cluster.decode[0].servicer.freeze_after = 4  # a fresh cluster picks decode[0] first
    t0 = time.monotonic()
    out, deltas = cluster.run(PROMPT, max_new_tokens=20, engine="bf16", timeout=15)
    assert out == reference(PROMPT, 20) and deltas[-1].stats["migrations"] == 1
    assert 2.0 <= time.monotonic() - t0 < 6.0  # call_timeout_s = 2 in the fake cluster
    assert cluster.wait_sessions_zero()


def test_exact_worker_death_restarts_the_session_on_the_other(cluster):
    """Exact mode: the exact worker holding the session dies in a Verify; the router re-prefills prompt + the
    tokens sent on the other prefill worker (generated_tokens = their count, so it replays them as AR rows)
    with a fresh decode session, and goes on from its first token: the output is the reference, one migration."""
    stream = cluster.client.generate(PROMPT, max_new_tokens=30, mode="exact", timeout=10)
    first = next(stream)
    (holder,) = [w for w in cluster.prefill if any(m.startswith("Prefill") for m, _ in w.servicer.calls)]
    (other,) = [w for w in cluster.prefill if w is not holder]
    holder.servicer.die_on = {"Verify": 2}
    rest = list(stream)
    assert first.token_ids + [t for d in rest for t in d.token_ids] == reference(PROMPT, 30)
    assert rest[-1].stats["migrations"] == 1
    (re,) = [r for m, r in other.servicer.calls if m.startswith("Prefill")]
    sent = list(re.prompt_ids)[len(PROMPT) :]
    assert re.mode == common_pb2.EXACT and re.generated_tokens == len(sent) > 0
    assert sent == reference(PROMPT, len(sent))  # prompt + exactly the tokens sent before the death
    assert cluster.wait_sessions_zero()


def test_every_exact_worker_dead_is_unavailable(cluster):
    for w in cluster.prefill:
        w.servicer.die_on = {"Verify": 2}
    code, details = _code(lambda: cluster.run(PROMPT, max_new_tokens=30, mode="exact"))
    assert code == grpc.StatusCode.UNAVAILABLE and "prefill" in details, details
    assert cluster.wait_sessions_zero()


def test_concurrent_requests_spread_over_workers(cluster):
    for w in cluster.decode:
        w.servicer.delay = 0.01
    results = {}

    def one(i):
        results[i] = cluster.run([i + 1, 2], max_new_tokens=15, mode="exact" if i % 2 else "fast", engine="bf16")[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == reference([i + 1, 2], 15) for i in range(8))
    used = [sum(m == "LoadState" for m, _ in w.servicer.calls) for w in cluster.decode]
    assert all(u > 0 for u in used), used
    assert cluster.wait_sessions_zero()


def test_a_prompt_queued_past_the_call_timeout_is_served_through_heartbeats(cluster):
    """A prefill worker whose prompt waits 3.5 s for its pass (longer than call_timeout_s = 2): the router
    asked for heartbeats (call_timeout / HEARTBEATS_PER_TIMEOUT), they keep the stream from counting as
    stalled, and the request completes on that worker with the reference tokens; nothing is marked down.
    Without them (the same wait, no heartbeat_ms asked) the stream is a stalled worker: see the next test."""
    from router.session import HEARTBEATS_PER_TIMEOUT

    for w in cluster.prefill:
        w.servicer.early, w.servicer.queued_s = True, 3.5
    t0 = time.monotonic()
    out, deltas = cluster.run(PROMPT, max_new_tokens=8, engine="bf16", timeout=20)
    assert out == reference(PROMPT, 8) and time.monotonic() - t0 >= 3.5
    assert deltas[-1].stats["migrations"] == 0
    reqs = [r for w in cluster.prefill for m, r in w.servicer.calls if m == "Prefill"]
    assert len(reqs) == 1 and reqs[0].heartbeat_ms == int(2.0 * 1e3 / HEARTBEATS_PER_TIMEOUT)
    assert len(cluster.servicer.registry.up("prefill")) == 2
    assert cluster.wait_sessions_zero()


def test_a_silent_queued_prompt_past_the_call_timeout_is_a_stalled_worker(cluster):
    """The same 3.5 s wait on both prefill workers without heartbeats (an older worker): each stream counts
    as stalled after call_timeout_s, its worker is marked down, and the request ends UNAVAILABLE: what 32
    prompts of 16K tokens on one H200 did before heartbeats (benchmarks/results/gpu-h200-2026-12-03-ring.md)."""
    for w in cluster.prefill:
        w.servicer.early, w.servicer.queued_s, w.servicer.heartbeats = True, 3.5, False
    code, details = _code(lambda: cluster.run(PROMPT, max_new_tokens=8, engine="bf16", timeout=20))
    assert code == grpc.StatusCode.UNAVAILABLE and "stalled" in details, details
    assert [len([m for m, _ in w.servicer.calls if m == "Prefill"]) for w in cluster.prefill] == [1, 1]


def test_handoff_timeline_is_asked_of_the_prefill_worker_only_when_the_client_asks(cluster):
    """GenerateRequest.handoff_timeline -> PrefillRequest.timeline (the marks come back in the bridge, then in
    the last Stats: tests/benchmarks/test_bench_serve.py runs it end to end); without it P is asked for none."""
    out, _ = cluster.run(PROMPT, max_new_tokens=4, engine="bf16", handoff_timeline=True)
    out2, deltas = cluster.run(PROMPT, max_new_tokens=4, engine="bf16")
    assert out == out2 == reference(PROMPT, 4) and "handoff_timeline" not in deltas[-1].stats
    asked = [r.timeline for w in cluster.prefill for m, r in w.servicer.calls if m == "Prefill"]
    assert sorted(asked) == [False, True]
