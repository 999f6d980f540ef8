"""More concurrent streams than a worker's old 16 gRPC handler threads, over real loopback gRPC (router,
prefill worker, decode worker in this process, a tiny random model): 24 Generate streams at once all
complete, each with exactly the tokens it gets alone, and the decode worker steps all 24 sessions in one
step. With a fixed 16-thread pool the Decode streams past 16 queued behind the others (and the
LoadState hand-offs behind them), so no step held more than 16 rows and bursts timed out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import make_tiny_dir, wait_serving

from baton.client import Client
from baton.settings import Settings

N, NEW = 24, 40
# router, prefill and decode workers on threads of this process: tiny ops on 2 cores, one torch thread
pytestmark = pytest.mark.usefixtures("one_torch_thread")
CLUSTER_ADDR: dict[str, str] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from baton.loading import load_model
    from decode_worker.serve import serve_decode
    from prefill_worker.serve import serve_prefill
    from router.__main__ import serve_router, stop_router

    d = make_tiny_dir(tmp_path_factory.mktemp("many"), seed=4, layers=4, hidden=64, vocab=400)
    lm = load_model(d, dtype="fp32", mtp=False)
    st = Settings()
    ph, _ = serve_prefill(lm, max_len=160, slots=N, settings=st)
    dh, ds = serve_decode(lm, engines=("bf16",), max_len=160, slots=N, settings=st, default_engine="bf16")
    rh, rs = serve_router(prefill=[ph.address], decode=[dh.address], settings=st)
    CLUSTER_ADDR["decode"] = dh.address
    c = Client(rh.address)
    wait_serving(c)
    yield c, ds
    c.close()
    stop_router(rh, rs, 0)
    ph.stop(0)
    dh.stop(0)


def _gen(c, i):
    ids = [(13 * i + j) % 390 + 5 for j in range(6 + i % 5)]
    out = []
    for d in c.generate(token_ids=ids, max_new_tokens=NEW, ignore_eos=True, timeout=120):
        out += d.token_ids
    return out


def test_24_streams_at_once_complete_exactly_and_step_together(cluster):
    c, ds = cluster
    alone = [_gen(c, i) for i in range(N)]
    with ThreadPoolExecutor(N) as ex:
        together = list(ex.map(lambda i: _gen(c, i), range(N)))
    assert together == alone
    assert all(len(t) == NEW for t in together)
    sched = ds.engine._scheduler
    assert sched.max_rows > 16, sched.max_rows  # the 24 sessions decoded in the same steps


def test_get_stats_reports_the_batched_steps(cluster):
    """WorkerStats over gRPC: the decode worker's steps, their rows, durations and periods; reset_steps
    clears the duration windows only."""
    import grpc

    from baton import stalls
    from baton.v1 import common_pb2, decode_pb2_grpc

    stalls.start()  # what a worker's process main starts (this process's probe: it stays on)
    c, ds = cluster
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: _gen(c, i), range(4)))
    sched = ds.engine._scheduler  # the in-process servicer's: compare the RPC's numbers with it
    ch = grpc.insecure_channel(CLUSTER_ADDR["decode"])
    stub = decode_pb2_grpc.DecodeWorkerStub(ch)
    st = stub.GetStats(common_pb2.WorkerStatsRequest(reset_steps=True), timeout=5)
    assert st.steps == sched.steps > 0 and st.step_rows == sched.rows and st.max_step_rows == sched.max_rows
    assert 0 < st.step_s_p50 <= st.step_s_p99
    assert 0 < st.step_interval_s_p50 <= st.step_interval_s_p99  # steps back to back: their period
    assert st.step_interval_s_p50 <= st.step_s_p50 * 1.5  # a step spans about two periods (pipelined)
    assert st.step_device_s_p50 == st.step_device_s_p99 == 0.0  # no device events on the CPU
    assert 0 < st.stall_s_p99 <= st.stall_s_max and 0 < st.stall_share < 1  # the process's probe
    assert 0 < st.first_tokens_s_p50 <= st.first_tokens_s_p99 < 30  # each Decode's join -> its first token
    assert 0 < st.decode_called_s_p50 <= st.decode_called_s_p99 < 30  # LoadState's commit -> the Decode call
    # a call's entry -> its first message holds its join -> first tokens: call by call, so at each percentile
    assert st.first_tokens_s_p50 <= st.decode_first_message_s_p50 <= st.decode_first_message_s_p99 < 30
    assert st.first_tokens_s_p99 <= st.decode_first_message_s_p99
    assert 0 < st.decode_setup_s_p50 <= st.decode_first_message_s_p50  # the handler's part of it, call by call
    st2 = stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=5)
    assert st2.steps == st.steps and st2.step_s_p99 == 0.0  # the window was reset, the counters not
    assert st2.first_tokens_s_p99 == 0.0
    assert st2.decode_called_s_p99 == st2.decode_first_message_s_p99 == 0.0
    assert st2.step_interval_s_p99 == 0.0
    ch.close()
