"""benchmarks/bench_shared_prompt.py runs on the CPU with the embedded model and reports its three passes."""

from __future__ import annotations

import json

from benchmarks import bench_shared_prompt


def test_it_times_equal_distinct_and_one_prompt(tmp_path):
    out = tmp_path / "r.json"
    res = bench_shared_prompt.main(["--prompt", "12", "--n", "3", "--reps", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert res["benchmark"] == "bench_shared_prompt" and res["n"] == 3 and res["prompt_tokens"] == 12
    assert all(res[k] > 0 for k in ("equal_ms", "distinct_ms", "one_ms"))
    assert res["command"].startswith("python benchmarks/bench_shared_prompt.py --prompt 12")
