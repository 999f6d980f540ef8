"""The router's one log line per request names the prefill and decode workers that served it and the engine
that actually ran (a request that names none runs the decode worker's default: the line says which; the
metrics' engine label stays the one asked, "default"). A real router over loopback gRPC with fake workers
(tests/fakes.py); after a fast-mode migration the line names the decode worker that finished the request."""

from __future__ import annotations

import json

from fakes import Cluster

PROMPT = [5, 6, 7]


def request_lines(caplog) -> list[dict]:
    msgs = [r.getMessage() for r in caplog.records if r.name == "baton.router"]
    return [json.loads(m.split("request ", 1)[1]) for m in msgs if m.startswith("request {")]


def test_the_line_names_the_workers_and_the_engine_that_ran(caplog):
    caplog.set_level("INFO", logger="baton.router")
    c = Cluster(n_prefill=1, n_decode=1, engines=("fp8", "bf16", "mtp"))  # fp8: the decode worker's default
    try:
        for kw in ({}, {"engine": "mtp"}, {"engine": "bf16", "mode": "exact"}):
            caplog.clear()
            c.run(PROMPT, max_new_tokens=4, **kw)
            (rec,) = request_lines(caplog)
            assert rec["status"] == "OK" and rec["prefill"] == c.prefill[0].address, rec
            assert rec["decode"] == c.decode[0].address, rec
            assert rec["engine"] == kw.get("engine", "fp8") and "priority" not in rec, (kw, rec)
        metrics = c.servicer.metrics.render().decode()
        assert 'baton_router_tokens_total{engine="default",mode="fast"} 4.0' in metrics
        caplog.clear()  # a request's priority (vLLM's) is on its line when set
        c.run(PROMPT, max_new_tokens=4, priority=-2, request_id="line-prio")
        (rec,) = request_lines(caplog)
        assert (rec["priority"], rec["request_id"], rec["status"]) == (-2, "line-prio", "OK"), rec
    finally:
        c.close()


def test_after_a_migration_the_line_names_the_decode_worker_that_finished(caplog):
    caplog.set_level("INFO", logger="baton.router")
    c = Cluster(n_prefill=1, n_decode=2)
    try:
        shared = {"Decode.token": 5}  # whichever decode worker streams dies at its 5th token
        for w in c.decode:
            w.servicer.die_on = shared
        out, deltas = c.run(PROMPT, max_new_tokens=20, engine="bf16")
        assert len(out) == 20 and deltas[-1].stats["migrations"] == 1
        (rec,) = request_lines(caplog)
        methods = [{m for m, _ in w.servicer.calls} for w in c.decode]
        (died,) = [w.address for w, m in zip(c.decode, methods) if "Decode.token" in m]  # it died on a token
        (finished,) = [w.address for w, m in zip(c.decode, methods) if "Decode" in m and "Decode.token" not in m]
        assert rec["migrations"] == 1 and rec["decode"] == finished != died, (rec, died)
    finally:
        c.close()
