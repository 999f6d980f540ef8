"""benchmarks/bench_decode_host.py: the real Decode path (engine, step scheduler, servicer, loopback gRPC, a
client process) over a fake device; the JSON's counts come from the client and the worker's stats."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_decode_host as bdh


@pytest.mark.timeout(300)
def test_paced_and_unpaced_points_count_every_token(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--streams", "2", "--tokens", "40", "--device-ms", "2", "--pace", "10,0", "--out", str(out)]
    assert bdh.main(argv) == 0
    r = json.loads(out.read_text())
    paced, plain = r["points"]
    for p in (paced, plain):
        assert p["tokens"] == 80 and p["steps"] >= 40 and 1.0 <= p["mean_rows"] <= 2.0
        assert p["steps_per_s"] <= p["device_steps_per_s"] * 1.05  # the fake device bounds the steps
        shares = [v for k, v in p.items() if k.startswith("decode_phase_share_")]
        assert 0.99 <= sum(shares) <= 1.01 and p["decode_phase_share_collect"] > 0
    # 10 messages/s for 2 streams: each waits 25 ms between messages, ~12 steps of 2 ms (8 run ahead at most)
    assert paced["messages"] <= 80 // 3 and paced["tokens_per_message"] >= 3
    assert plain["messages"] > paced["messages"]
