"""Faults against real processes (tests/realcluster.py): 2 prefill + 2 decode workers + the router on a tiny
checkpoint, window 256, router --call-timeout 3, worker session TTL 6 s. Every case states what must
happen and asserts it: the request completes with `baton complete`'s tokens, or ends with the documented
status within its bound; health / the router's worker gauges show what happened; no session is left;
the next request is served. Killed workers are restarted on their ports before the next case (what
`baton serve --processes` does); test_deploy_serve.py covers that supervisor itself.

Placing a kill at a point of the protocol, without timing luck: the router picks the least-loaded
worker, a frozen (SIGSTOP) process still accepts TCP, and a live worker's GetStats shows whether it has
a call in flight (`outstanding`) and holds a session. E.g. "between Draft rounds": freeze the exact
worker, so the router waits in Verify; the decode worker then shows 1 session and 0 calls in flight;
SIGKILL it; thaw.

Already covered elsewhere, not repeated: SIGKILL of the serving decode worker mid-stream (exact and fast,
tests/system/test_router_e2e.py), corrupt / truncated / reordered chunk lists sent to LoadState
(tests/decode_worker/test_decode_service.py), hung fake workers (tests/router/test_router_service.py).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from faultkit import CutProxy
from faultkit import until as _until
from helpers import make_tiny_dir
from realcluster import RealCluster, grpc_code, reference, tokens

from baton.rpc import make_channel
from baton.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

CALL_TIMEOUT = 3.0
TTL = 6.0
MAX_LEN = 256
LONG = 200  # tokens of a "long" request: still running when the fault lands
UP = "baton_router_workers_up"
C = grpc.StatusCode
pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    tiny = make_tiny_dir(tmp)
    c = RealCluster(
        tmp,
        prefill=2,
        decode=2,
        max_len=MAX_LEN,
        model_dir=tiny,
        worker_args=("--ttl", str(TTL)),
        router_args=("--call-timeout", str(CALL_TIMEOUT)),
    )
    try:
        c.ref = reference(tiny, MAX_LEN)  # loads the model here while the processes boot
        c.start()
        yield c
    finally:
        c.close()


@pytest.fixture(autouse=True)
def healthy(cl):
    """Each case starts with every worker up, seen up by the router, no session anywhere."""
    cl.ensure_up(timeout=15)
    assert cl.client.health() == "SERVING"
    yield


def _gen(cl, prompt, n=LONG, **kw):
    return cl.client.generate(prompt, max_new_tokens=n, ignore_eos=True, timeout=kw.pop("timeout", 60), **kw)


def _first_tokens(streams) -> list:
    """Each stream's first delta, the streams started together: a client stream's Generate call starts at
    its first next(), so taking them one by one would start request i + 1 only after request i's first token,
    and on a loaded 2-core box the first sessions could decode all their tokens before the last one lands."""
    with ThreadPoolExecutor(len(streams)) as pool:
        return list(pool.map(next, streams))


def _holder(cl, role: str) -> str:
    """The live worker of `role` that holds a session (exactly one must). The first token can come before the
    state has landed (docs/CONTRACTS.md, "Early first token"): wait a moment for it."""

    def busy():
        return [n for n in cl.live(role) if n not in cl.frozen and cl.stats(n).sessions]

    try:
        _until(lambda: len(busy()) == 1, 5, f"one {role} worker holding the session")
    except AssertionError:
        raise AssertionError({n: cl.stats(n).sessions for n in cl.live(role)}) from None
    return busy()[0]


def _took(cl, role: str, before: dict) -> str:
    """The live worker of `role` whose served RPCs (WorkerStats.requests_total) grew since `before` (exactly
    one must): the one a request went to, even once its session has ended (the tiny model decodes 200
    tokens in well under a second, and a loaded machine polled _holder after that)."""

    def grew():
        return [n for n in cl.live(role) if cl.stats(n).requests_total > before.get(n, 0)]

    _until(lambda: len(grew()) == 1, 5, f"one {role} worker serving the request")
    return grew()[0]


def _next_request_is_served(cl, mode="exact"):
    assert tokens(_gen(cl, "x = 1", 12, mode=mode)) == cl.ref("x = 1", 12)


# ---- decode worker SIGKILLed ---------------------------------------------------------------------
def test_decode_killed_during_loadstate_is_retried_on_the_other(cl):
    """The hand-off stream is in flight to decode worker D (frozen, so it stays in LoadState) when D is
    SIGKILLed: the prefill worker's Prefill fails UNAVAILABLE naming the target, the router retries the
    Prefill with the other decode worker; the client sees nothing of it: same tokens, no migration."""
    want, busy_want = cl.ref("import json", 20), cl.ref("def main(", LONG)
    before = {n: cl.stats(n).requests_total for n in cl.live("decode")}
    busy = _gen(cl, "def main(")  # keeps one decode worker loaded (or, ended, picked last): the next pick is the other
    first_busy = next(busy)
    dx = _took(cl, "decode", before)
    (dy,) = [n for n in cl.live("decode") if n != dx]
    retries0 = cl.metric("baton_router_prefill_retries_total")
    cl.freeze(dy)
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(lambda: list(_gen(cl, "import json", 20, engine="bf16")))
        _until(lambda: any(cl.stats(p).outstanding for p in cl.live("prefill")), 5, "the Prefill in the hand-off")
        time.sleep(0.1)
        assert not fut.done()  # stuck in LoadState on the frozen worker
        t0 = time.monotonic()
        cl.kill(dy)
        deltas = fut.result(timeout=CALL_TIMEOUT + 5)
    assert tokens(deltas) == want and deltas[-1].stats["migrations"] == 0
    assert time.monotonic() - t0 < CALL_TIMEOUT
    assert cl.metric("baton_router_prefill_retries_total") == retries0 + 1
    assert first_busy.token_ids + tokens(busy) == busy_want  # the other stream never noticed
    cl.wait_metric(UP, 1, 5, role="decode")
    assert cl.client.health() == "SERVING"
    _next_request_is_served(cl)
    cl.wait_no_sessions(5)


def test_decode_killed_during_decode_streams_migrate(cl):
    """4 fast bf16 streams over 2 decode workers; the first decode worker seen holding a session with a
    Decode call in flight is frozen at once (so none of its streams can run to its end: the tiny model
    decodes 200 tokens in well under a second, and a worker polled a moment later had often finished every
    stream it held, all tokens already sent) and SIGKILLed: every stream that was on it, landed or still
    landing, is re-prefilled (prompt + tokens sent so far) onto the survivor. All 4 outputs equal
    `baton complete`; the migrations are the streams cut (at least the one seen decoding, at most all but
    the survivor's); the router's counter says the same."""
    prompts = ["def main(", "import json", "class Counter:", "for token in tokens:"]
    fast0 = cl.metric("baton_router_migrations_total", mode="fast")
    streams = [_gen(cl, p, engine="bf16") for p in prompts]
    firsts = _first_tokens(streams)  # all 4 admitted and streaming
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(list, s) for s in streams]  # read the streams from now on
        victim = []

        def decoding():  # a decode worker holding a session whose Decode call is in flight: frozen at once
            for n in cl.live("decode"):
                st = cl.stats(n)
                if st.sessions and st.outstanding:
                    cl.freeze(n)
                    victim.append(n)
                    return True
            return all(f.done() for f in futs)  # all ended first: a clear failure below, not a hang

        _until(decoding, 10, "a decode worker decoding a session")
        assert victim, "every stream ended before any decode worker was seen decoding"
        cl.kill(victim[0])
        rest = [f.result(timeout=60) for f in futs]
    migrated = 0
    for p, f, r in zip(prompts, firsts, rest):
        assert f.token_ids + tokens(r) == cl.ref(p, LONG), p
        migrated += r[-1].stats["migrations"]
    assert 1 <= migrated <= len(prompts)
    assert cl.metric("baton_router_migrations_total", mode="fast") == fast0 + migrated
    cl.wait_metric(UP, 1, 5, role="decode")
    _next_request_is_served(cl, "fast")
    cl.wait_no_sessions(5)


def test_decode_worker_holding_eight_sessions_killed_all_migrate(cl):
    """8 fast bf16 streams all on one decode worker (the other is down while they start), stepping
    together in its batch; the worker is frozen, the other comes back, then the frozen one is SIGKILLed:
    every stream is re-prefilled onto the survivor and each output equals `baton complete`."""
    prompts = [f"def f{i}(x):" for i in range(8)]
    fast0 = cl.metric("baton_router_migrations_total", mode="fast")
    cl.kill("decode-1")
    cl.wait_metric(UP, 1, 15, role="decode")
    streams = [_gen(cl, p, engine="bf16") for p in prompts]
    firsts = _first_tokens(streams)  # all 8 admitted and streaming, on decode-0
    _until(lambda: cl.stats("decode-0").sessions == 8, 10, "all 8 states landed on decode-0")  # early first tokens
    cl.freeze("decode-0")
    cl.restart("decode-1")
    cl.wait_metric(UP, 1, 30, role="decode")  # decode-1 up (decode-0 frozen: down or about to be)
    cl.kill("decode-0")
    with ThreadPoolExecutor(8) as pool:
        rest = list(pool.map(list, streams, timeout=120))
    for p, f, r in zip(prompts, firsts, rest):
        assert f.token_ids + tokens(r) == cl.ref(p, LONG), p
        assert r[-1].stats["migrations"] == 1, p
    assert cl.metric("baton_router_migrations_total", mode="fast") == fast0 + 8
    _next_request_is_served(cl, "fast")


def test_decode_worker_holding_eight_exact_sessions_killed_mid_round_all_resume(cl):
    """Issue 21's fault case: 8 exact-mode sessions (fp8 and mtp drafts; half greedy, half sampling at
    T = 0.8 with a seed) all on one decode worker, whose Draft calls it serves in shared steps; it is
    frozen mid-round (the router waits in Draft), the other decode worker comes back, then the frozen one
    is SIGKILLed: each session's exact state is re-exported from its prefill worker (ExportState) to the
    survivor, and every output equals `baton complete` with the same sampling and seed."""
    from baton.engine.sampling import Params

    prompts = [f"x{i} = [" for i in range(8)]
    sampled = [dict(temperature=0.8, seed=50 + i) if i % 4 >= 2 else {} for i in range(8)]
    exact0 = cl.metric("baton_router_migrations_total", mode="exact")
    cl.kill("decode-1")
    cl.wait_metric(UP, 1, 15, role="decode")
    streams = [_gen(cl, p, 96, mode="exact", engine=("fp8", "mtp")[i % 2], **sampled[i]) for i, p in enumerate(prompts)]
    firsts = _first_tokens(streams)  # all 8 admitted and in their draft / verify rounds, on decode-0
    _until(lambda: cl.stats("decode-0").sessions == 8, 10, "all 8 states landed on decode-0")  # early first tokens
    cl.freeze("decode-0")
    cl.restart("decode-1")
    cl.wait_metric(UP, 1, 30, role="decode")
    cl.kill("decode-0")
    with ThreadPoolExecutor(8) as pool:
        rest = list(pool.map(list, streams, timeout=120))
    for i, (p, f, r) in enumerate(zip(prompts, firsts, rest)):
        want = cl.ref(p, 96, sampling=Params(**sampled[i]) if sampled[i] else None)
        assert f.token_ids + tokens(r) == want, (p, sampled[i])
        assert r[-1].stats["migrations"] == 1, p
        assert r[-1].stats["draft_only_handoffs"] == (2 if i % 2 else 0), p  # mtp: the first and the migration's
    assert cl.metric("baton_router_migrations_total", mode="exact") == exact0 + 8
    _next_request_is_served(cl)
    cl.wait_no_sessions(5)


def test_decode_killed_between_draft_rounds_exact_same_tokens(cl):
    """Exact mode; the exact worker is frozen for a moment so the router waits in Verify and the decode
    worker has no call in flight (1 session, 0 outstanding); SIGKILL it, thaw: the next Draft fails, the
    exact state is re-exported to the other decode worker (ExportState): identical tokens, 1 migration."""
    stream = _gen(cl, "class Counter:", 64, mode="exact", engine="fp8")
    got = [next(stream) for _ in range(3)]
    p, d = _holder(cl, "prefill"), _holder(cl, "decode")
    cl.freeze(p)
    time.sleep(0.3)
    st = cl.stats(d)
    assert (st.sessions, st.outstanding) == (1, 0), st  # between rounds
    cl.kill(d)
    cl.thaw(p)
    got += list(stream)
    assert tokens(got) == cl.ref("class Counter:", 64) and got[-1].stats["migrations"] == 1
    cl.wait_metric(UP, 1, 5, role="decode")
    _next_request_is_served(cl)
    cl.wait_no_sessions(5)


@pytest.mark.slow
def test_decode_killed_during_a_draft_call_exact_same_tokens(cl):
    """Exact mode; the decode worker is frozen, so the router waits in Draft (the exact worker shows 0
    calls in flight), then SIGKILLed: the Draft fails at once (no wait for the call timeout), the
    session migrates by ExportState: identical tokens, 1 migration."""
    stream = _gen(cl, "return [e / total", 64, mode="exact", engine="mtp")
    got = [next(stream) for _ in range(3)]
    p, d = _holder(cl, "prefill"), _holder(cl, "decode")
    cl.freeze(d)
    time.sleep(0.3)
    assert cl.stats(p).outstanding == 0  # the router is in Draft on the frozen worker
    t0 = time.monotonic()
    cl.kill(d)
    got.append(next(stream))
    assert time.monotonic() - t0 < CALL_TIMEOUT
    got += list(stream)
    assert tokens(got) == cl.ref("return [e / total", 64) and got[-1].stats["migrations"] == 1
    _next_request_is_served(cl)
    cl.wait_no_sessions(5)


# ---- prefill worker SIGKILLed --------------------------------------------------------------------
def _kill_prefill_in_handoff(cl, start) -> str:
    """Decode workers frozen for a moment, then start() sends the request: its Prefill blocks in the hand-off
    (frozen first: a Prefill sent before could have landed already, CI at 36c9bc6); SIGKILL the prefill worker
    running it (its state stream to the decode worker is cut mid-way), thaw."""
    decs = cl.live("decode")
    cl.freeze(*decs)
    try:
        start()
        p = _until(
            lambda: next((n for n in cl.live("prefill") if cl.stats(n).outstanding), None), 5, "a Prefill in flight"
        )
        cl.kill(p)
    finally:
        cl.thaw(*decs)
    return p


def test_prefill_killed_during_prefill_is_retried_on_the_other(cl):
    """A prefill worker dies in the middle of a Prefill (in its state hand-off): the router retries once on
    the other prefill worker: same tokens. The decode worker that got a partial state stream from the
    killed sender keeps nothing of it."""
    with ThreadPoolExecutor(1) as pool:
        futs = []
        _kill_prefill_in_handoff(
            cl, lambda: futs.append(pool.submit(lambda: list(_gen(cl, "values: list[float]", 16, engine="bf16"))))
        )
        deltas = futs[0].result(timeout=CALL_TIMEOUT + 5)
    assert tokens(deltas) == cl.ref("values: list[float]", 16)
    cl.wait_metric(UP, 1, 5, role="prefill")
    assert cl.client.health() == "SERVING"
    _next_request_is_served(cl)
    cl.wait_no_sessions(5)


@pytest.mark.slow
def test_last_prefill_worker_killed_during_prefill_is_unavailable(cl):
    """With no other prefill worker the same fault ends UNAVAILABLE at once ("prefill failed ..."); health
    turns NOT_SERVING, and SERVING again once the worker is back; then requests are served."""
    cl.kill("prefill-0")
    cl.wait_metric(UP, 1, 5, role="prefill")
    with ThreadPoolExecutor(1) as pool:
        futs = []
        _kill_prefill_in_handoff(
            cl, lambda: futs.append(pool.submit(lambda: grpc_code(lambda: _gen(cl, "values: list[float]", 16))))
        )
        code, details = futs[0].result(timeout=CALL_TIMEOUT + 5)
    assert code == C.UNAVAILABLE and "prefill" in details, details
    cl.wait_health("NOT_SERVING", 5)
    cl.restart("prefill-0", "prefill-1")
    cl.wait_health("SERVING", 10)
    _next_request_is_served(cl)


def test_prefill_killed_during_verify_resumes_on_the_other(cl):
    """Exact mode; the exact worker holding the session is SIGKILLed while the router waits on its Verify:
    the router re-prefills prompt + the tokens sent on the other prefill worker, which replays them as AR
    rows (bitwise the lost exact state), with a fresh decode session, and goes on: the whole output equals
    `baton complete`, with one migration; the old decode session is released; the router stays SERVING."""
    prompt = "raise ValueError(f\""
    stream = _gen(cl, prompt, 64, mode="exact", engine="fp8")
    got = [next(stream) for _ in range(2)]
    p, d = _holder(cl, "prefill"), _holder(cl, "decode")
    cl.freeze(p)
    time.sleep(0.3)
    assert cl.stats(d).outstanding == 0  # the router waits on Verify
    exact0 = cl.metric("baton_router_migrations_total", mode="exact")
    cl.kill(p)
    got.extend(stream)
    assert tokens(got) == cl.ref(prompt, 64)
    assert got[-1].stats["migrations"] == 1
    assert cl.metric("baton_router_migrations_total", mode="exact") == exact0 + 1
    cl.wait_no_sessions(5)
    cl.wait_metric(UP, 1, 5, role="prefill")
    assert cl.client.health() == "SERVING"
    _next_request_is_served(cl)


def test_prefill_worker_holding_exact_sessions_killed_all_resume(cl):
    """8 exact-mode sessions (fp8 and mtp drafts; half greedy, half sampling at T = 0.8 with a seed) over both
    prefill workers; the one holding more is frozen (its sessions wait in Verify), then SIGKILLed: each of its
    sessions is re-prefilled (prompt + tokens sent, replayed as AR rows) on the survivor, and every output
    equals `baton complete` with the same sampling and seed."""
    from baton.engine.sampling import Params

    prompts = [f"y{i} = {{" for i in range(8)]
    sampled = [dict(temperature=0.8, seed=70 + i) if i % 4 >= 2 else {} for i in range(8)]
    exact0 = cl.metric("baton_router_migrations_total", mode="exact")
    streams = [_gen(cl, p, 96, mode="exact", engine=("fp8", "mtp")[i % 2], **sampled[i]) for i, p in enumerate(prompts)]
    firsts = _first_tokens(streams)
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(list, s) for s in streams]
        held = {n: cl.stats(n).sessions for n in cl.live("prefill")}
        victim = max(held, key=held.get)
        cl.freeze(victim)
        time.sleep(0.3)
        cl.kill(victim)
        rest = [f.result(timeout=120) for f in futs]
    migrated = 0
    for i, (p, f, r) in enumerate(zip(prompts, firsts, rest)):
        want = cl.ref(p, 96, sampling=Params(**sampled[i]) if sampled[i] else None)
        assert f.token_ids + tokens(r) == want, (p, sampled[i])
        migrated += r[-1].stats["migrations"]
    assert held[victim] - 1 <= migrated <= held[victim] and migrated >= 1, held  # NOTE: one may end before the freeze
    assert cl.metric("baton_router_migrations_total", mode="exact") == exact0 + migrated
    cl.wait_no_sessions(5)
    cl.wait_metric(UP, 1, 5, role="prefill")
    _next_request_is_served(cl)


# ---- SIGSTOP past the router's call timeout ------------------------------------------------------
def test_frozen_decode_stream_migrates_after_the_call_timeout(cl):
    """A decode worker frozen mid-stream sends nothing: after --call-timeout the router's watchdog gives up
    on it (marked down), re-prefills elsewhere: the stream pauses ~call_timeout, then completes with the
    right tokens (1 migration). After SIGCONT the worker is back up and its session was released."""
    stream = _gen(cl, "self.seen += len(", engine="bf16")
    got = [next(stream) for _ in range(3)]
    d = _holder(cl, "decode")
    cl.freeze(d)
    t0 = time.monotonic()
    stamps = []
    for delta in stream:
        stamps.append(time.monotonic())
        got.append(delta)
    assert tokens(got) == cl.ref("self.seen += len(", LONG) and got[-1].stats["migrations"] == 1
    gap = max(b - a for a, b in zip([t0] + stamps, stamps))
    assert CALL_TIMEOUT - 0.5 < gap < CALL_TIMEOUT + 3, gap
    assert cl.metric(UP, role="decode") == 1  # the frozen one is down
    cl.thaw(d)
    cl.wait_metric(UP, 2, 5, role="decode")
    cl.wait_no_sessions(5)
    _next_request_is_served(cl, "fast")


@pytest.mark.slow
def test_frozen_prefill_workers_past_the_call_timeout(cl):
    """Every prefill worker frozen: the Prefill gets no answer within --call-timeout, the worker is marked
    down and the request ends UNAVAILABLE within two call timeouts; health reads NOT_SERVING while they
    are frozen, SERVING soon after SIGCONT; the late Prefill leaves no session behind; requests are served."""
    ps = cl.live("prefill")
    cl.freeze(*ps)
    t0 = time.monotonic()
    code, details = grpc_code(lambda: _gen(cl, "def", 8))
    took = time.monotonic() - t0
    assert code == C.UNAVAILABLE and "prefill" in details, details
    assert took < 2 * CALL_TIMEOUT + 2, took
    cl.wait_health("NOT_SERVING", 3)
    cl.thaw(*ps)
    assert cl.wait_health("SERVING", 5) < 5
    cl.wait_no_sessions(5)
    _next_request_is_served(cl)


@pytest.mark.slow
def test_frozen_exact_worker_in_verify_resumes_and_its_session_expires(cl):
    """Exact mode; the exact worker is frozen past --call-timeout during Verify: after about the call timeout
    the router re-prefills prompt + the tokens sent on the other prefill worker and the request completes
    with `baton complete`'s tokens (one migration). The router's Release cannot reach the frozen worker, so
    its session outlives the request, but not the TTL: after SIGCONT the reaper frees it within TTL + the
    reap interval."""
    prompt = "@dataclass(frozen=True)"
    stream = _gen(cl, prompt, 64, mode="exact", engine="fp8")
    got = [next(stream) for _ in range(2)]
    p = _holder(cl, "prefill")
    cl.freeze(p)
    stamps = [time.monotonic()]
    for d in stream:  # a block already on its way may still come; then the stall, then the restarted session
        got.append(d)
        stamps.append(time.monotonic())
    stall = max(b - a for a, b in zip(stamps, stamps[1:]))
    assert CALL_TIMEOUT - 0.5 < stall < CALL_TIMEOUT + 2.5, stall
    assert tokens(got) == cl.ref(prompt, 64) and got[-1].stats["migrations"] == 1
    cl.thaw(p)
    t1 = time.monotonic()
    cl.wait_no_sessions(TTL + 4)
    print(f"frozen exact worker's session freed {time.monotonic() - t1:.1f} s after SIGCONT (TTL {TTL} s)")
    _next_request_is_served(cl)


# ---- state streams cut or corrupted on the wire --------------------------------------------------
def test_state_stream_cut_or_corrupted_on_the_wire(cl):
    """The prefill worker's state stream to a decode worker passes a proxy that (a) resets the connection
    after 10 %, 50 %, 90 % of the stream's bytes (inside the one data chunk: a message cut mid-way), or
    (b) flips one byte in the data chunk. The Prefill fails with the documented code naming the
    decode_target (UNAVAILABLE for a cut, DATA_LOSS for a flip: the per-chunk SHA-256 catches it); neither
    worker keeps a session; the next hand-off through the same proxy and the router are fine."""
    p, d = "prefill-0", "decode-0"
    proxy = CutProxy(cl.addr[d])
    prompt = list(range(3, 43))
    try:
        with make_channel(cl.addr[p], cl.settings) as ch:
            stub = prefill_pb2_grpc.PrefillWorkerStub(ch)

            def prefill(sid):
                return stub.Prefill(
                    prefill_pb2.PrefillRequest(
                        session_id=sid, prompt_ids=prompt, mode=common_pb2.EXACT, decode_target=proxy.address
                    ),
                    timeout=20,
                )

            def release(sid):
                for n in (p, d):
                    cl.release(n, sid)

            prefill("warm")  # the connection through the proxy exists
            release("warm")
            proxy.arm()
            r = prefill("measure")
            size = proxy.count
            release("measure")
            assert r.bridge.total_bytes > 0.8 * size > 10_000, (r.bridge.total_bytes, size)
            cases = [("cut", f) for f in (0.1, 0.5, 0.9)] + [("flip", f) for f in (0.3, 0.7)]
            for kind, frac in cases:
                proxy.arm(**{f"{kind}_at": int(frac * size)})
                code, details = grpc_code(lambda: prefill(f"{kind}{frac}"))
                want = C.UNAVAILABLE if kind == "cut" else C.DATA_LOSS
                assert code == want and "decode_target" in details, (kind, frac, code, details)
                assert cl.stats(p).sessions == 0 and cl.stats(d).sessions == 0, (kind, frac)
            proxy.arm()
            prefill("after")  # the same path works again
            release("after")
    finally:
        proxy.close()
    _next_request_is_served(cl)
    cl.wait_no_sessions(5)


# ---- shutdown -------------------------------------------------------------------------------------------
def test_zz_workers_exit_0_on_sigterm_with_connections_open(cl):
    """Last: SIGTERM to every worker while the router still polls them (open connections): each drains and
    exits 0 within its grace. (They used to abort in interpreter teardown now and then: exit -6.)"""
    codes = {}
    for n in list(cl.procs):
        t0 = time.monotonic()
        codes[n] = cl.procs[n].stop(grace=10)
        assert time.monotonic() - t0 < 5, n
    assert codes == {n: 0 for n in codes}, codes
    cl.wait_health("NOT_SERVING", 5)
