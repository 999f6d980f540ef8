"""Paged KV over real loopback gRPC (a prefill and a decode worker, the tiny model, a decode pool of 3
pages): a full pool refuses a new hand-off or a Decode that needs more pages with RESOURCE_EXHAUSTED
naming the pages, before any work, and the worker goes on serving the sessions it holds with their exact
tokens; a cancelled Decode frees its pages; a soak of many requests of random lengths leaves every page
of both workers free."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from helpers import make_tiny_dir

from baton.complete import complete
from baton.engine.pages import PAGE
from baton.loading import load_model
from baton.rpc import make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from decode_worker.serve import serve_decode
from prefill_worker.serve import serve_prefill

MAX_LEN, W, T, PAGES = 2 * PAGE, 16, 60, 3
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype="fp32")


@pytest.fixture(scope="module")
def w(lm):
    ph, ps = serve_prefill(lm, max_len=MAX_LEN, width=W, slots=4, settings=Settings())
    dh, ds = serve_decode(
        load_model(lm.model_dir, dtype="fp32"),
        engines=("bf16",),
        max_len=MAX_LEN,
        width=W,
        slots=4,
        kv_pages=PAGES,
        settings=Settings(),
    )
    with make_channel(ph.address, Settings()) as pc, make_channel(dh.address, Settings()) as dc:
        yield dict(
            P=prefill_pb2_grpc.PrefillWorkerStub(pc),
            D=decode_pb2_grpc.DecodeWorkerStub(dc),
            pool=ds.engine.runners["bf16"].state.pages,
            ppool=ps.engine.runner.state.pages,
            target=dh.address,
        )
    ph.stop(0)
    dh.stop(0)


def _load(w, sid, prompt):
    r = w["P"].Prefill(
        prefill_pb2.PrefillRequest(session_id=sid, prompt_ids=prompt, decode_target=w["target"]), timeout=T
    )
    return r.first_token


def _decode(w, sid, n, release=True):
    req = decode_pb2.DecodeRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, release_at_end=release)
    return [t for m in w["D"].Decode(req, timeout=T) for t in m.token_ids]


def _code(fn):
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code(), ei.value.details()


def _all_free(w):
    for _ in range(1500):  # up to 30 s: the servers finish their calls' clean-up after the reply (a busy box)
        if w["pool"].free_pages == PAGES and w["ppool"].free_pages == w["ppool"].pages:
            break
        time.sleep(0.02)
    for k in ("pool", "ppool"):
        w[k].check()
    return (w["pool"].free_pages, w["ppool"].free_pages) == (PAGES, w["ppool"].pages)


def test_a_full_pool_refuses_new_work_and_keeps_serving(w, lm):
    a, b = [11, 22, 33, 44, 55, 66], [7] * (PAGE + 10)  # one page, two pages
    ref_a = complete(None, a, 21, max_len=MAX_LEN, width=W, loaded=lm, ignore_eos=True)
    assert _load(w, "a", a) == ref_a[0]
    assert _load(w, "b", b) is not None and w["pool"].free_pages == 0
    code, details = _code(lambda: _load(w, "c", [5, 6, 7]))  # the hand-off is refused at its header
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pages" in details, details
    code, details = _code(lambda: _decode(w, "a", PAGE, release=False))  # a needs a 2nd page: none free
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pages" in details, details
    assert [ref_a[0]] + _decode(w, "a", 20) == ref_a  # a is untouched and still exact
    assert len(_decode(w, "b", 5)) == 5
    assert _all_free(w), (w["pool"]._owned, w["ppool"]._owned)


def test_a_cancelled_decode_frees_its_pages(w):
    _load(w, "x", [3] * 40)
    it = w["D"].Decode(
        decode_pb2.DecodeRequest(session_id="x", max_new_tokens=200, ignore_eos=True, release_at_end=True), timeout=T
    )
    next(it), next(it)
    it.cancel()
    assert _all_free(w), (w["pool"]._owned, w["D"].GetStats(common_pb2.WorkerStatsRequest(), timeout=T))


def test_soak_random_lengths_leaves_every_page_free(w):
    """Concurrent requests of random prompt and output lengths; some are refused (RESOURCE_EXHAUSTED) while
    the pool is full. Every one either gives all its tokens or is refused whole, and every page comes back."""
    rng = random.Random(0)
    jobs = [(f"s{i}", rng.randint(1, MAX_LEN - 60), rng.randint(1, 40)) for i in range(14)]
    done, refused, bad = [], [], []

    def run(part):
        for sid, n, m in part:
            try:
                _load(w, sid, [rng.randrange(500) for _ in range(n)])
                got = _decode(w, sid, m)
                (done if len(got) == m else bad).append(sid)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    bad.append((sid, e.code(), e.details()))
                else:
                    refused.append(sid)
                    w["D"].Release(common_pb2.ReleaseRequest(session_id=sid), timeout=T)

    threads = [threading.Thread(target=run, args=(jobs[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and len(done) + len(refused) == len(jobs) and done, (bad, refused)
    assert _all_free(w), (w["pool"]._owned, w["ppool"]._owned)


def test_get_stats_reports_engines_slots_and_pages(w):
    """GetStats' capacity (WorkerStats.engines, slots, kv_pools, kv_pages, kv_pages_free, kv_page_tokens) is
    what each worker sized and holds: a session of PAGE + 10 tokens takes 2 of the decode worker's 3 pages,
    and they come back when it is released. The decode worker lists its one engine (the router then knows
    it offers no other)."""

    def stats(role):
        return w[role].GetStats(common_pb2.WorkerStatsRequest(), timeout=T)

    d, p = stats("D"), stats("P")
    assert list(d.engines) == ["bf16"] and list(p.engines) == []
    assert (d.slots, d.kv_pools, d.kv_pages, d.kv_pages_free, d.kv_page_tokens) == (4, 1, PAGES, PAGES, PAGE)
    assert (p.slots, p.kv_pools, p.kv_pages, p.kv_page_tokens) == (4, 1, w["ppool"].pages, PAGE)
    _load(w, "cap", [9] * (PAGE + 10))
    assert stats("D").kv_pages_free == PAGES - 2
    w["D"].Release(common_pb2.ReleaseRequest(session_id="cap"), timeout=T)
    assert _all_free(w) and stats("D").kv_pages_free == PAGES and stats("P").kv_pages_free == w["ppool"].pages
