"""benchmarks/bench_gather.py: sessions calling once a round through exact mode's two Gathers on one lock."""

from __future__ import annotations

import json

from benchmarks import bench_gather


def test_every_session_joins_one_batch_a_round_and_the_round_is_at_least_its_two_passes(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert bench_gather.main(["--sessions", "1,6", "--rounds", "12", "--pass-ms", "3", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == r
    assert r["benchmark"] == "bench_gather" and r["command"].startswith("python benchmarks/bench_gather.py --sessions")
    one, six = r["points"]
    assert (one["sessions"], six["sessions"]) == (1, 6) and one["batches"] == 12 and one["mean_calls"] == 1
    assert six["batches"] >= 12 and six["mean_calls"] >= 3  # merged rounds (a late wake-up may split one)
    for p in (one, six):
        assert p["round_ms"] >= p["ideal_round_ms"] == 6.0 and p["cpu_ms_per_round"] >= 0
        assert set(p["draft_batch_ms"]) == {"wait", "lock", "run"} and p["draft_batch_ms"]["run"] >= 3.0


def test_process_cpu_counts_this_process_s_own_cpu_time():
    """benchmarks/load.py process_cpu_s (bench_serve's router_cpu): half a second of busy loop here shows as
    ~0.5 s more; a process that does not exist gives None."""
    import os
    import time

    from benchmarks.load import process_cpu_s

    before, t = process_cpu_s(os.getpid()), time.process_time()
    while time.process_time() - t < 0.5:
        pass
    spent = process_cpu_s(os.getpid()) - before
    assert 0.4 <= spent <= 0.7, spent
    assert process_cpu_s(2**22 + 12345) is None
