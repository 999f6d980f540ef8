"""benchmarks/bench_exact_passes.py on the CPU (eager, the tiny random shape): every part of a round is
timed at each batch size, and the round and its tok/s are what the parts add up to."""

from __future__ import annotations

import json

from benchmarks import bench_exact_passes


def test_the_parts_of_a_round_add_up(tmp_path):
    out = tmp_path / "r.json"
    res = bench_exact_passes.main(
        ["--device", "cpu", "--random-init", "tiny", "--batch", "1,3", "--k", "3", "--accepted", "2",
         "--prompt", "12", "--reps", "1", "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text())["points"] == res["points"]
    assert res["benchmark"] == "bench_exact_passes" and res["k"] == 3 and res["captured"] is None
    assert [p["batch"] for p in res["points"]] == [1, 3]
    for p in res["points"]:
        parts = ("verify_ms", "verdict_ms", "pairs_ms", "step_ms", "ar_ms", "rewind_ms")
        assert all(p[k] > 0 for k in parts), p
        assert "rewind_eager_ms" not in p  # no captured slot copies on the CPU: nothing to set against
        round_ms = p["verify_ms"] + p["verdict_ms"] + p["pairs_ms"] + 2 * p["step_ms"]
        assert abs(p["round_ms"] - round_ms) < 0.01
        assert abs(p["tok_s"] - p["batch"] * 3 / p["round_ms"] * 1e3) < 0.2
