"""benchmarks/gil_probe.py on CPU with a short context: every scenario streams (child processes for the
other side of send and receive) and the probe reports its stalls."""

import json

from benchmarks import gil_probe


def test_gil_probe_scenarios(tmp_path):
    out = tmp_path / "probe.json"
    res = gil_probe.main(["--tokens", "16", "--streams", "1", "--chunk-mib", "1", "--idle-s", "0.2", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert list(res["results"]) == ["idle", "send", "send_process", "receive", "both"]
    for name, r in res["results"].items():
        assert r["steps"] > 0 and r["wall_s"] > 0 and r["max_ms"] >= 0
        assert 0 <= r["stalled_share"] <= 1 and r["stall_p50_ms"] <= r["stall_p99_ms"] <= r["max_ms"]
        assert name == "idle" or r["stream_GBps"] > 0
