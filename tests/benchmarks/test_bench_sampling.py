"""benchmarks/bench_sampling.py on the CPU: every case timed, and the bf16 logits sort in the z order."""

from benchmarks.bench_sampling import main


def test_bench_sampling_reports_each_path(tmp_path):
    out = main(["--device", "cpu", "--vocab", "512", "--width", "4", "--reps", "2", "--out", str(tmp_path / "s.json")])
    assert set(out["ms"]) == {
        "greedy",
        "temperature",
        "top_p",
        "top_k_top_p",
        "graph_path",
        "greedy_one_row",
        "top_p_one_row",
    }
    assert out["timing"] == "eager, wall"
    assert all(v >= 0 for v in out["ms"].values())
    assert set(out["sort_ms"]) == {"fp32_z", "bf16_logits"}
    assert out["sort_same_order"] is True  # distinct bf16 logits stay distinct in z = x / T
    assert out["shape"] == [4, 512]
    assert (tmp_path / "s.json").read_text().startswith("{")
