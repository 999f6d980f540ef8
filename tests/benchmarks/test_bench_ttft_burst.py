"""benchmarks/bench_ttft_burst.py, run small on the embedded model: bursts of 1 and 3 prompts through a
real prefill worker and decode worker process; every request's marks are ordered in time, each pass is
logged (with the hand-off and without), and --profile writes the op tables."""

import json


def test_bench_ttft_burst_cpu_smoke(capsys, tmp_path):
    from benchmarks import bench_ttft_burst as b

    res = b.main(["--device", "cpu", "--prompt", "12", "--bursts", "1,3", "--runs", "1", "--warmup", "0",
                  "--profile", str(tmp_path / "prof.txt")])  # fmt: skip
    assert json.loads(capsys.readouterr().out) == res
    one, three = res["results"]
    assert (one["burst"], one["requests"], three["burst"], three["requests"]) == (1, 1, 3, 3)
    for r in (one, three):
        assert 1 <= sum(r["passes_per_burst"]) <= r["burst"]
        q, c, lo, rep = (r[k]["max"] for k in ("queued_ms", "compute_end_ms", "loaded_ms", "reply_ms"))
        assert 0 <= q <= c <= lo <= rep and r["tail_ms"]["p50"] >= 0
        assert 0 < r["first_ms"]["max"] <= rep  # the first token (PrefillStream's first message) by the reply
        # every prompt in one of the logged passes, with and without the hand-off
        for log in (r["passes"][0], r["plain_passes"][0]):
            assert sum(x["pieces"] for x in log) == r["burst"] and sum(x["tokens"] for x in log) == 12 * r["burst"]
            assert all(x["ms"] > 0 for x in log)
        assert r["plain_reply_ms"]["p50"] > 0
    assert "self CPU" in (tmp_path / "prof.txt").read_text()
    assert res["prefill_budget"] > 0 and res["command"].startswith("python benchmarks/")


def test_bench_ttft_burst_with_the_prefill_worker_in_its_own_process(capsys):
    """--prefill-process: the prefill worker is `python -m prefill_worker`; each burst's passes come from its
    WorkerStats (one summary: passes, pieces, tokens, mean ms), with the hand-off and without."""
    from benchmarks import bench_ttft_burst as b

    res = b.main(
        ["--device", "cpu", "--prompt", "12", "--bursts", "3", "--runs", "1", "--warmup", "0", "--prefill-process"]
    )
    assert json.loads(capsys.readouterr().out) == res and res["prefill_process"] is True
    (three,) = res["results"]
    assert three["requests"] == 3 and 1 <= sum(three["passes_per_burst"]) <= 3
    for (summary,) in (three["passes"][0], three["plain_passes"][0]):
        assert summary["pieces"] == 3 and summary["tokens"] == 36 and summary["ms"] > 0
        assert 1 <= summary["passes"] <= 3
    assert three["first_ms"]["max"] <= three["reply_ms"]["max"]
