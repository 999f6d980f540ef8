"""A decode worker started with one engine (`baton serve --engines bf16`, `python -m decode_worker --engines
bf16`) over real loopback gRPC, with a prefill worker and the router in this process on the tiny model: it
makes no FP8 copy, reports the one engine it offers (WorkerStats.engines), and the router refuses a request
for another engine with INVALID_ARGUMENT naming what is offered, before the prefill worker does any work;
a bf16 request gives `baton complete`'s tokens."""

from __future__ import annotations

import grpc
import pytest
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
    rh, rs = serve_router(prefill=[ph.address], decode=[dh.address], settings=st)
    c = Client(rh.address)
    wait_serving(c)
    yield dict(client=c, lm=lm, prefill=ps, decode=ds)
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
