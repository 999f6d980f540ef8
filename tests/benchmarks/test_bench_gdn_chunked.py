"""benchmarks/bench_gdn_chunked.py: the CPU delta rule cut at 64-token multiples keeps the whole sequence's
bits (baton/models/gdn_ops.py chunked: one chunk at a time, in fixed shapes), and the JSON records its time."""

from benchmarks.bench_gdn_chunked import main


def test_cut_at_chunk_multiples_keeps_the_bits_and_the_json_is_sane(tmp_path):
    out = tmp_path / "r.json"
    r = main(["--tokens", "301", "--cuts", "64,192,256", "--reps", "2", "--out", str(out)])
    assert r["cut_bits_equal"] is True and r["cuts"] == [64, 192, 256] and r["tokens"] == 301
    assert 0 < r["ms_min"] <= r["ms_median"] and out.read_text().startswith("{")
