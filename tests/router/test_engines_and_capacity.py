"""A decode worker started with one engine (`baton serve --engines bf16`, `python -m decode_worker --engines
bf16`) over real loopback gRPC, with a prefill worker and the router in this process on the tiny model: it
makes no FP8 copy, reports the one engine it offers (WorkerStats.engines), and the router refuses a request
for another engine with INVALID_ARGUMENT naming what is offered, before the prefill worker does any work;
a bf16 request gives `baton complete`'s tokens. The router's /metrics shows each worker's sessions and KV pages,
read from its GetStats at each scrape (router/worker_metrics.py)."""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
from conftest import pick_free_port
from helpers import make_tiny_dir, wait_serving

from baton.client import Client
from baton.complete import complete
from baton.loading import load_model
from baton.settings import Settings

MAX_LEN = 128
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from decode_worker.serve import serve_decode
    from prefill_worker.serve import serve_prefill
    from router.__main__ import serve_router, stop_router

    lm = load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype="fp32")
    st = Settings()
    ph, ps = serve_prefill(lm, max_len=MAX_LEN, slots=2, settings=st)
    dh, ds = serve_decode(load_model(lm.model_dir, dtype="fp32"), engines=("bf16",), max_len=MAX_LEN, settings=st)
    rh, rs = serve_router(prefill=[ph.address], decode=[dh.address], settings=st, metrics_port=pick_free_port())
    c = Client(rh.address)
    wait_serving(c)
    yield dict(client=c, lm=lm, prefill=ps, decode=ds, router=rs, addr=dict(prefill=ph.address, decode=dh.address))
    c.close()
    stop_router(rh, rs, 0)
    ph.stop(0)
    dh.stop(0)


@pytest.mark.parametrize("mode,engine", [("fast", "fp8"), ("fast", "mtp"), ("exact", "fp8")])
def test_an_engine_the_workers_do_not_offer_is_refused_before_any_work(cluster, mode, engine):
    before = cluster["prefill"].requests_total
    with pytest.raises(grpc.RpcError) as ei:
        list(cluster["client"].generate([5, 6, 7], max_new_tokens=4, mode=mode, engine=engine, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == f"engine: {engine} is not offered by any decode worker (offered: bf16)"
    assert cluster["prefill"].requests_total == before


def test_the_offered_engine_serves_and_no_fp8_copy_is_made(cluster):
    assert set(cluster["decode"].engine.runners) == {"bf16"}
    got = [
        t
        for d in cluster["client"].generate([5, 6, 7], max_new_tokens=12, engine="bf16", ignore_eos=True)
        for t in d.token_ids
    ]
    want = complete(None, [5, 6, 7], 12, loaded=cluster["lm"], max_len=MAX_LEN, ignore_eos=True)
    assert got == want


def _scrape(cluster) -> dict[str, float]:
    port = cluster["router"].metrics._server.server_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(baton_worker_\S+) (\S+)$", body, re.M)}


def test_metrics_show_each_workers_sessions_and_kv_pages(cluster):
    """A session handed to the decode worker (a Prefill with its decode_target: it stays until released) shows
    as one session and its pages as used; once released, every page is free again."""
    from baton.rpc import make_channel
    from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    d, p = cluster["addr"]["decode"], cluster["addr"]["prefill"]
    pool = cluster["decode"].engine.runners["bf16"].state.pages
    lab = f'{{role="decode",worker="{d}"}}'
    with make_channel(p, Settings()) as pc, make_channel(d, Settings()) as dc:
        req = prefill_pb2.PrefillRequest(session_id="m", prompt_ids=[5] * 40, decode_target=d)
        prefill_pb2_grpc.PrefillWorkerStub(pc).Prefill(req, timeout=30)
        got = _scrape(cluster)
        assert got["baton_worker_kv_pages" + lab] == pool.pages and got["baton_worker_slots" + lab] == pool.slots
        assert got["baton_worker_sessions" + lab] == 1 and got["baton_worker_kv_pages_free" + lab] == pool.pages - 1
        assert got["baton_worker_kv_usage" + lab] == pytest.approx(1 / pool.pages)
        prefill_pages = cluster["prefill"].engine.runner.state.pages.pages
        assert got[f'baton_worker_kv_pages{{role="prefill",worker="{p}"}}'] == prefill_pages
        assert (
            decode_pb2_grpc.DecodeWorkerStub(dc).Release(common_pb2.ReleaseRequest(session_id="m"), timeout=30).released
        )
    got = _scrape(cluster)
    assert got["baton_worker_sessions" + lab] == 0 and got["baton_worker_kv_pages_free" + lab] == pool.pages
    assert got["baton_worker_kv_usage" + lab] == 0.0 and got["baton_worker_scrape_errors_total"] == 0


def test_metrics_count_the_workers_gathered_batches_by_part(cluster):
    """An exact-mode request's rounds are gathered Verify batches on the prefill worker and Draft batches on
    the decode worker: /metrics counts them, with their seconds by part (wait, lock, run), and the router's
    batched round RPCs (DraftMany, VerifyMany) with their requests."""
    p, d = cluster["addr"]["prefill"], cluster["addr"]["decode"]
    before = _scrape(cluster)
    deltas = list(cluster["client"].generate([5, 6, 7], max_new_tokens=12, mode="exact", ignore_eos=True))
    rounds = deltas[-1].stats["rounds"]
    assert rounds >= 1 and deltas[-1].stats["verify_ms"] > 0 and deltas[-1].stats["draft_ms"] > 0
    got = _scrape(cluster)
    for role, addr in (("prefill", p), ("decode", d)):
        lab = f'{{role="{role}",worker="{addr}"}}'
        key = "baton_worker_gathered_batches_total" + lab
        assert 1 <= got[key] - before.get(key, 0.0) <= rounds + 1, (role, got)
        items = "baton_worker_gathered_items_total" + lab
        assert got[items] - before.get(items, 0.0) >= got[key] - before.get(key, 0.0)
        run = f'baton_worker_gathered_seconds_total{{part="run",role="{role}",worker="{addr}"}}'
        assert got[run] > before.get(run, 0.0), (role, got)
        for part in ("wait", "lock"):
            assert got[f'baton_worker_gathered_seconds_total{{part="{part}",role="{role}",worker="{addr}"}}'] >= 0
        # the run by part (baton/engine/parts.py): every part the batches passed through, adding up to at most the run
        names = {"prefill": ("checks", "pass", "finish"), "decode": ("checks", "verdicts", "snapshot", "chains", "ar")}
        parts = {k: v for k, v in got.items() if 'part="run_' in k and f'worker="{addr}"' in k}
        for part in names[role]:
            key = f'baton_worker_gathered_seconds_total{{part="run_{part}",role="{role}",worker="{addr}"}}'
            assert got[key] > before.get(key, 0.0), (role, part, parts)
        assert sum(parts.values()) <= got[run] + 1e-6, (role, parts)
        # one session: each round's Draft and Verify went as a batched RPC of one request (router/batcher.py)
        rpcs = "baton_worker_batched_rpcs_total" + lab
        assert got[rpcs] - before.get(rpcs, 0.0) == rounds, (role, got)
        reqs = "baton_worker_batched_items_total" + lab
        assert got[reqs] - before.get(reqs, 0.0) == rounds


def test_metrics_count_fast_mtp_rounds_by_draft_length():
    """A decode worker's fast mtp rounds by the K its draft-length controller ran (WorkerStats.mtp_rounds_by_k,
    filled by the worker: tests/benchmarks/test_bench_serve_spec.py) become /metrics counters, each K a label,
    with their seconds; a worker without such rounds adds no sample."""
    from types import SimpleNamespace

    from baton.v1 import common_pb2
    from router.worker_metrics import _gathered

    st = common_pb2.WorkerStats(mtp_rounds_by_k={0: 40, 4: 3}, mtp_round_s_by_k={0: 0.28, 4: 0.25})
    w, p = SimpleNamespace(role="decode", address="d:1"), SimpleNamespace(role="prefill", address="p:1")
    fams = {f.name: f for f in _gathered([(w, st), (p, common_pb2.WorkerStats())])}
    rounds = {(x.labels["worker"], x.labels["k"]): x.value for x in fams["baton_worker_mtp_rounds"].samples}
    secs = {(x.labels["worker"], x.labels["k"]): x.value for x in fams["baton_worker_mtp_round_seconds"].samples}
    assert rounds == {("d:1", "0"): 40.0, ("d:1", "4"): 3.0}
    assert secs == pytest.approx({("d:1", "0"): 0.28, ("d:1", "4"): 0.25})
    assert all(x.name.endswith("_total") for x in fams["baton_worker_mtp_rounds"].samples)


def test_metrics_show_the_decode_workers_waits_before_first_tokens(cluster):
    """baton_worker_decode_wait_seconds: after fast requests the decode worker's p50 / p99 of a session's
    LoadState -> Decode call, the call -> its first message, and the join -> first tokens within it; the
    prefill worker has none."""
    for _ in range(2):
        list(cluster["client"].generate([5, 6, 7], max_new_tokens=6, engine="bf16", ignore_eos=True))
    got = _scrape(cluster)
    d, p = cluster["addr"]["decode"], cluster["addr"]["prefill"]

    def wait(part, q):
        return got[f'baton_worker_decode_wait_seconds{{part="{part}",quantile="{q}",role="decode",worker="{d}"}}']

    for part in ("called", "first_message", "setup", "first_tokens"):
        assert 0 < wait(part, "0.5") <= wait(part, "0.99") < 30, (part, got)
    assert wait("first_tokens", "0.5") <= wait("first_message", "0.5")  # the join is within the call's wait
    assert wait("setup", "0.5") <= wait("first_message", "0.5")  # as the handler's set-up is
    assert not any("decode_wait" in k and f'worker="{p}"' in k for k in got)


def test_cpu_served_workers_pipeline_exact_rounds_and_one_gpu_shared_merges_them(cluster, monkeypatch):
    """serve_prefill / serve_decode on the CPU (each worker on its own cores): exact mode's Verify and Draft
    gathers are pipelined: no round barrier on the Draft side, no settling on the Verify side
    (baton/engine/exact_rounds.py rounds_share_a_device); the same serve on one GPU shared by two workers would
    keep them (the rule itself: tests/engine/test_gather.py)."""
    monkeypatch.delenv("BATON_GATHER_PERIODIC", raising=False)
    drafts, verifies = cluster["decode"].engine.drafts, cluster["prefill"].engine.verifies
    assert drafts._key is None and not drafts.barrier and verifies._key is None and verifies.settle_s == 0
    assert cluster["decode"].engine.mtp_rounds._key is not None  # one worker's own rounds: still merged


def test_a_worker_that_does_not_answer_is_left_out_and_counted():
    """GetStats to a port nothing listens on (real socket): that worker has no figure in the scrape, and
    baton_worker_scrape_errors counts it."""
    from prometheus_client import CollectorRegistry, generate_latest

    from baton.rpc import make_channel
    from baton.v1 import decode_pb2_grpc
    from router.worker_metrics import WorkerCollector

    class Down:
        role, address = "decode", f"127.0.0.1:{pick_free_port()}"
        stub = decode_pb2_grpc.DecodeWorkerStub(make_channel(address, Settings()))

    class Reg:
        def up(self, role):
            return [Down] if role == "decode" else []

    prom = CollectorRegistry()
    col = WorkerCollector(Reg(), deadline_s=0.5).register(prom)
    try:
        body = generate_latest(prom).decode()
        assert "baton_worker_scrape_errors_total 1.0" in body and Down.address not in body
    finally:
        col.close()
