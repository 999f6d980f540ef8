"""The prefill worker's prefix cache through the router, over real loopback gRPC and HTTP (the openai client):
a router, a prefill worker with the cache and a decode worker in this process on the embedded default model,
its prompts cut into 256-token pieces (so that a test prompt crosses piece boundaries; production cuts at
8192, baton/engine/prefill.py).

A request whose prompt begins with an earlier prompt's first pieces gets exactly the tokens of `baton complete`
(fast bf16 greedy, seeded sampling with a penalty, exact mode with mtp drafts), its usage says how many prompt
tokens were restored, and the worker's stats and the router's /metrics count them."""

from __future__ import annotations

import random

import grpc
import httpx
import pytest
from conftest import pick_free_port
from helpers import inprocess_cluster

from baton.engine.sampling import Params
from baton.v1 import common_pb2, prefill_pb2_grpc

MAX_LEN = 1024
CHUNK = 256
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stack():
    from baton.loading import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("baton.engine.runner.PREFILL_CHUNK", CHUNK)  # every runner made here, the reference's too
        lm = load_model(None, dtype="fp32", device="cpu", mtp=True)
        port = pick_free_port()
        c, _, close = inprocess_cluster(lm, MAX_LEN, default_engine="bf16", prefix_cache=8, http_port=port)
        yield lm, c, close.prefills[0].address, f"http://127.0.0.1:{port}"
        close()


def _ids(lm, n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, lm.cfg.vocab_size) for _ in range(n)]


def _run(c, ids, n=16, **kw):
    out, last = [], None
    for d in c.generate(token_ids=ids, max_new_tokens=n, ignore_eos=True, timeout=120, **kw):
        out += d.token_ids
        last = d
    return out, last.usage


def _complete(lm, ids, n=16, sampling=None):
    from baton.complete import complete

    return complete(None, ids, n, loaded=lm, max_len=MAX_LEN, ignore_eos=True, sampling=sampling)


def _prefill_stats(address):
    with grpc.insecure_channel(address) as ch:
        return prefill_pb2_grpc.PrefillWorkerStub(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=10)


def test_a_prompt_that_begins_with_a_cached_one_gives_the_reference_tokens(stack):
    lm, c, prefill, _ = stack
    a = _ids(lm, 600, 1)
    got, usage = _run(c, a)
    assert got == _complete(lm, a) and usage["cached_tokens"] == 0
    before = _prefill_stats(prefill)
    assert before.prefill_piece == CHUNK  # what the router groups prompts by (Registry.prefill_piece)
    b = a[:530] + _ids(lm, 200, 2)  # shares pieces [0, 256) and [256, 512)
    got, usage = _run(c, b)
    assert got == _complete(lm, b)
    assert usage["prompt_tokens"] == 730 and usage["cached_tokens"] == 512
    after = _prefill_stats(prefill)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 1
    assert after.prefix_cache_tokens - before.prefix_cache_tokens == 512
    assert (after.prefix_cache_entries, after.prefix_cache_pages) == (2, 2 * CHUNK // 256)  # 256 and 512
    assert after.prefix_cache_reclaimed == 0  # no request was short of pages


@pytest.mark.parametrize(
    "kw, sampling",
    [
        (
            {"temperature": 0.8, "seed": 5, "repetition_penalty": 1.3},
            Params(temperature=0.8, seed=5, repetition_penalty=1.3),
        ),
        ({"mode": "exact", "engine": "mtp"}, None),
    ],
    ids=["seeded-penalized", "exact-mtp"],
)
def test_sampled_and_exact_requests_from_a_cached_prefix_equal_the_reference(stack, kw, sampling):
    lm, c, _, _ = stack
    a = _ids(lm, 520, 3)
    _run(c, a, n=2, **kw)  # (exact mtp: its prefill writes the MTP layer's KV, which the entries then hold)
    b = a[:516] + _ids(lm, 40, 4)  # the boundary at 512 and the token after it: a's
    got, usage = _run(c, b, n=24, **kw)
    assert usage["cached_tokens"] == 512
    assert got == _complete(lm, b, 24, sampling)


def test_http_usage_reports_the_cached_tokens_and_metrics_count_them(stack):
    openai = pytest.importorskip("openai")
    lm, c, _, url = stack
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = api.models.list().data[0].id
    a = _ids(lm, 700, 6)
    first = api.completions.create(model=model, prompt=a, max_tokens=4)
    assert first.usage.prompt_tokens == 700 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = api.completions.create(model=model, prompt=a[:600] + [5, 6, 7], max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens == 512
    text = httpx.get(url + "/metrics", timeout=10).text
    hits = [ln for ln in text.splitlines() if ln.startswith("baton_worker_prefix_cache_hits_total{")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 1
    evictions = {  # no request was short of pages here: nothing reclaimed
        ln.split('reason="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("baton_worker_prefix_cache_evictions_total{")
    }
    assert set(evictions) == {"pages", "capacity"} and evictions["pages"] == 0


def test_prompts_that_begin_alike_meet_on_one_prefill_worker_unless_it_is_much_busier():
    """router/session.py prefix_affinity: the digest of a prompt's first piece picks its prefill worker (rendezvous
    hashing), passed over when it has more than PREFIX_SLACK more calls in flight than the least loaded."""
    from baton.engine.prefill import PREFILL_CHUNK
    from baton.settings import Settings
    from router.registry import Registry
    from router.session import PREFILL_PIECE, PREFIX_SLACK, prefix_affinity

    assert PREFILL_PIECE == PREFILL_CHUNK
    reg = Registry(Settings(), prefill=[f"127.0.0.1:{1000 + i}" for i in range(4)])
    try:
        for w in reg._workers["prefill"]:  # (no health checks run: marked up by hand)
            w.up = True
        base = list(range(PREFILL_PIECE))
        keys = [prefix_affinity(base + tail) for tail in ([1], [2, 3], list(range(500)))]
        assert len(set(keys)) == 1 and prefix_affinity([7] + base) != keys[0]
        home = reg.pick("prefill", affinity=keys[0], slack=PREFIX_SLACK)
        others = [w for w in reg.up("prefill") if w is not home]
        for _ in range(5):  # the same worker whatever the others' load order
            assert reg.pick("prefill", affinity=keys[0], slack=PREFIX_SLACK) is home
        home.outstanding = PREFIX_SLACK  # busier, within the slack: still home
        assert reg.pick("prefill", affinity=keys[0], slack=PREFIX_SLACK) is home
        home.outstanding = PREFIX_SLACK + 1  # past it: the least loaded instead
        assert reg.pick("prefill", affinity=keys[0], slack=PREFIX_SLACK) in others
        assert reg.pick("prefill", affinity=keys[0]) is home  # equal prompts (no slack) keep to it
        # workers that cut prompts finer (--prefill-piece): prompts group by their first piece of the finest
        assert reg.prefill_piece(PREFILL_PIECE) == PREFILL_PIECE  # none reported one
        for w, piece in zip(reg._workers["prefill"], (1024, 256, 0, 8192)):
            w.prefill_piece = piece
        assert reg.prefill_piece(PREFILL_PIECE) == 256
        reg._workers["prefill"][1].up = False  # a down worker's piece does not count
        assert reg.prefill_piece(PREFILL_PIECE) == 1024
        short = [prefix_affinity(base[:256] + tail, piece=256) for tail in ([1], list(range(300)))]
        assert short[0] == short[1] != prefix_affinity(base[:255] + [9, 1], piece=256)
        assert prefix_affinity(base[:256] + [1], "salt", 256) != short[0]
    finally:
        reg.stop()


def test_a_cache_salt_keeps_prompts_apart_over_grpc_and_http(stack):
    """GenerateRequest.cache_salt / vLLM's cache_salt: a salted prompt shares cached prefixes only with its salt;
    the tokens are the reference's either way; a bad salt is refused naming the field, and the next is served."""
    openai = pytest.importorskip("openai")
    lm, c, _, url = stack
    a = _ids(lm, 560, 40)
    _run(c, a, n=2)  # unsalted: its boundaries cached
    b = a[:520] + _ids(lm, 20, 41)
    got, usage = _run(c, b, cache_salt="tenant-1")
    assert usage["cached_tokens"] == 0 and got == _complete(lm, b)
    got, usage = _run(c, b + [9], cache_salt="tenant-1")  # b's own boundaries, salted "tenant-1", now cached
    assert usage["cached_tokens"] == 512 and got == _complete(lm, b + [9])
    with pytest.raises(grpc.RpcError) as e:
        _run(c, b, cache_salt="x" * 257)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = api.models.list().data[0].id
    r = api.completions.create(model=model, prompt=b + [10], max_tokens=2, extra_body={"cache_salt": "tenant-1"})
    assert r.usage.prompt_tokens_details.cached_tokens == 512
    r = api.completions.create(model=model, prompt=b + [10], max_tokens=2, extra_body={"cache_salt": "tenant-3"})
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=model, prompt=b, max_tokens=2, extra_body={"cache_salt": ""})
    assert "cache_salt" in str(bad.value)
