"""benchmarks/bench_stream_messages.py: a real loopback Decode server and a client process; the JSON counts
every message and the CPU time per message is measured, not assumed."""

from __future__ import annotations

import json

from benchmarks import bench_stream_messages as bsm


def test_it_counts_every_message_and_prints_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--streams", "2", "--tokens", "1,3", "--messages", "40", "--servers", "sync,aio", "--out", str(out)]
    assert bsm.main(argv) == 0
    r = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == r
    got = [(p["server"], p["streams"], p["tokens_per_message"], p["messages"]) for p in r["points"]]
    assert got == [("sync", 2, 1, 80), ("sync", 2, 3, 80), ("aio", 2, 1, 80), ("aio", 2, 3, 80)]
    for p in r["points"]:
        assert p["server_cpu_s"] > 0 and p["cpu_us_per_message"] > 0
        want = p["messages"] * p["tokens_per_message"] / p["wall_s"]  # (wall_s is rounded to ms)
        assert abs(p["tokens_per_s"] - want) <= 0.01 * want
