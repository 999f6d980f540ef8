"""The router's /metrics as a Prometheus scrape sees it (router/metrics.py), against loopback fakes: the
request latency histogram by mode and status, the line of requests waiting for a session slot
(baton_router_queued, read from the SlotLine at the scrape), and no `*_created` series."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc
import pytest
from conftest import pick_free_port
from fakes import Cluster, reference

from router.service import RouterConfig

FULL = (grpc.StatusCode.RESOURCE_EXHAUSTED, "decode_target x: hand-off failed: all 8 session slots are in use")


def _value(body: str, series: str) -> float | None:
    m = re.search(rf"^{re.escape(series)} (\S+)$", body, re.M)
    return float(m.group(1)) if m else None


def test_scrape_shows_latency_by_status_the_line_and_no_created_series():
    c = Cluster(n_prefill=1, n_decode=1, config=RouterConfig(call_timeout_s=2.0, migrate_wait_s=1.0, queue_s=5.0))
    try:
        port = c.servicer.metrics.start(pick_free_port())

        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

        assert _value(scrape(), "baton_router_queued") == 0.0
        c.prefill[0].servicer.fail["Prefill"] = FULL  # refused once for full slots: the request waits in line
        out: list = []
        t = threading.Thread(target=lambda: out.append(c.run([1, 2], max_new_tokens=5)[0]))
        t.start()
        seen = []
        while t.is_alive():
            seen.append(_value(scrape(), "baton_router_queued"))
            time.sleep(0.02)
        t.join()
        assert out == [reference([1, 2], 5)] and 1.0 in seen and _value(scrape(), "baton_router_queued") == 0.0
        with pytest.raises(grpc.RpcError) as e:
            c.run([1, 2], max_new_tokens=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        body = scrape()
        ok = 'baton_router_request_seconds_count{mode="fast",status="OK"}'
        bad = 'baton_router_request_seconds_count{mode="fast",status="INVALID_ARGUMENT"}'
        assert _value(body, ok) == 1.0 and _value(body, bad) == 1.0
        waited = _value(body, 'baton_router_request_seconds_sum{mode="fast",status="OK"}')
        assert waited >= 0.4  # it waited in line (the head tries again after router/slot_line.py RETRY_S)
        assert "_created" not in body
        assert "# HELP baton_router_queued Generate calls waiting in line for a session slot" in body
    finally:
        c.close()
