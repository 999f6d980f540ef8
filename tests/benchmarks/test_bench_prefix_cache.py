"""benchmarks/bench_prefix_cache.py, run small on a tiny checkpoint: B's pieces before A's end are restored, the
rest computed, and warm B's first token and state are bitwise cold B's; one JSON object with the command."""

import json

from helpers import make_tiny_dir


def test_bench_prefix_cache_cpu_smoke(tmp_path, capsys):
    from benchmarks import bench_prefix_cache as b

    d = make_tiny_dir(tmp_path, seed=3)
    argv = ["--model", str(d), "--lengths", "600,800", "--chunk", "256", "--tail", "100", "--repeat", "1"]
    res = b.main(argv)
    assert json.loads(capsys.readouterr().out) == res
    # A = B's first 500 / 700 tokens: boundary 256 / 256 and 512 cached (each boundary's key holds the next token)
    assert [p["restored_tokens"] for p in res["points"]] == [256, 512]
    assert [p["computed_tokens"] for p in res["points"]] == [344, 288]
    assert all(p["first_token_equal"] and p["state_bitwise_equal"] for p in res["points"])
    assert res["command"].endswith(" ".join(argv)) and res["machine"]["cpu"] and res["cache_gdn_bytes"] > 0
