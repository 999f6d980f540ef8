"""benchmarks/serve_layouts.py and bench_serve --layout: which layouts run where (split refused or skipped
without two GPUs), the placement check, the comparison and its computed verdict, the report and plot of
a two-layout result, and one short CPU run end to end (shared runs, split is recorded skipped)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_serve as bs
from benchmarks import serve_layouts as sl


def test_layouts_of_the_option():
    assert sl.parse(None) == [] and sl.parse("both") == ["split", "shared"] and sl.parse("shared") == ["shared"]
    with pytest.raises(SystemExit):
        sl.parse("diagonal")
    a = bs.build_parser().parse_args(["--layout", "both"])
    bs.resolve(a)
    assert a.layouts == ["split", "shared"]


def test_split_needs_two_visible_gpus():
    one, two = {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(SystemExit, match="--layout split refused: the split layout needs two GPUs, 1 visible"):
        sl.refuse(["split"], "cuda", one)
    with pytest.raises(SystemExit, match="needs --device cuda"):
        sl.refuse(["split"], "cpu", two)
    sl.refuse(["split"], "cuda", two)
    sl.refuse(["split", "shared"], "cuda", one)  # both: recorded as skipped instead (plan)
    got = sl.plan(["split", "shared"], "cuda", "", one)
    assert got["split"] == {"gpus": 2, "serve_args": [], "skipped": sl.split_unavailable("cuda", one)}
    assert got["shared"] == {"gpus": 1, "serve_args": ["--colocate"]}
    got = sl.plan(["split", "shared"], "cuda", "--gpu-memory-fraction 0.3", two)
    assert got == {"split": {"gpus": 2, "serve_args": []}, "shared": {"gpus": 1, "serve_args": ["--colocate"]}}
    assert sl.plan(["shared"], "cpu") == {"shared": {"gpus": 1, "serve_args": []}}


def test_bench_serve_refuses_split_before_it_prepares(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(bs, "run", lambda a, argv: pytest.fail("ran"))
    with pytest.raises(SystemExit, match="refused"):
        bs.main(["--device", "cuda", "--layout", "split", "--random-init", "tiny"])


def test_placement_lines_and_their_check():
    err = ["baton: prefill-0 on GPU 0", "baton: decode-0 on GPU 1", "baton: decode-0 loading (pid 7)"]
    where = sl.placement(err)
    assert where == {"prefill-0": "0", "decode-0": "1"}
    assert sl.placement_problem("split", where, "cuda") is None
    assert "not on separate GPUs" in sl.placement_problem("split", {"prefill-0": "0", "decode-0": "0"}, "cuda")
    assert "no placement lines" in sl.placement_problem("split", {}, "cuda")  # one GPU, inherited
    assert sl.placement_problem("shared", {"prefill-0": "0", "decode-0": "0"}, "cuda") is None
    assert sl.placement_problem("shared", {}, "cuda") is None
    assert "several GPUs" in sl.placement_problem("shared", where, "cuda")


def _pt(layout, workload, mode, x, tok_s, ttft99, step99):
    p = {"workload": workload, "mode": mode, "tok_s": tok_s, "ttft_s_p50": ttft99 / 2, "ttft_s_p99": ttft99}
    p |= {"itl_s_p50": 0.006, "itl_s_p99": 0.02, "decode_step_s_p99": step99, "errors": {}, "mismatched": 0}
    p |= {"checked": 1, "completed": 4, "streams": 4, "stream_tok_s_p50": 1.0, "mean_inflight": 1.0}
    p |= {"concurrency": x} if mode == "concurrency" else {"rate": x, "num_prompts": 8, "requests_per_s": 1.0}
    return sl.annotate([p], layout, sl.GPUS[layout])[0]


RESULT = {
    "benchmark": "bench_serve",
    "command": "python benchmarks/bench_serve.py --layout both",
    "machine": {"gpu": "NVIDIA H200"},
    "config": {"engine": "bf16"},
    "layouts": {
        "split": {"gpus": 2, "serve_args": [], "serve": {"argv": "baton serve"}, "placement": {"prefill-0": "0"}},
        "shared": {"gpus": 1, "serve_args": ["--colocate"], "serve": {"argv": "baton serve --colocate"}},
    },
    "points": [
        _pt("split", "fixed", "concurrency", 1, 180.0, 0.2, 0.005),
        _pt("split", "fixed", "concurrency", 8, 700.0, 1.0, 0.006),
        _pt("split", "mixed", "rate", 4.0, 900.0, 2.0, 0.010),
        _pt("shared", "fixed", "concurrency", 1, 160.0, 0.2, 0.005),
        _pt("shared", "fixed", "concurrency", 8, 742.0, 1.5, 0.009),
        _pt("shared", "mixed", "rate", 4.0, 600.0, 6.0, 0.040),
    ],
}


def test_comparison_and_verdict_are_computed_from_the_points():
    rows = sl.compare(RESULT["points"])
    assert [r["point"] for r in rows] == ["fixed N=1", "fixed N=8", "mixed 4 req/s"]
    assert rows[0]["tok_s"] == {"split": 180.0, "shared": 160.0, "winner": "split", "ratio": 1.125}
    assert rows[0]["goodput_per_gpu"] == {"split": 90.0, "shared": 160.0, "winner": "shared", "ratio": 1.778}
    assert rows[0]["ttft_s_p99"]["winner"] == "tie" and rows[2]["decode_step_s_p99"]["ratio"] == 4.0
    v = sl.verdict(rows, RESULT["layouts"])
    assert v[0] == (
        "Output tok/s (higher is better): split at 2 of 3 (fixed N=1, mixed 4 req/s), ahead by 1.12x to 1.50x "
        "(most at mixed 4 req/s: 900 against 600); shared at 1 of 3 (fixed N=8), ahead by 1.06x "
        "(most at fixed N=8: 742 against 700)."
    )
    assert v[1].startswith("Goodput per GPU (tok/s / GPUs) (higher is better): shared at 3 of 3")
    assert v[3] == (
        "TTFT p99 (lower is better): split at 2 of 3 (fixed N=8, mixed 4 req/s), lower by 1.50x to 3.00x "
        "(most at mixed 4 req/s: 2.000 against 6.000 s); equal at fixed N=1."
    )
    assert v[-1].startswith("Decode step p99 (lower is better): split at 2 of 3") and "10.0 against 40.0 ms" in v[-1]
    skipped = {"split": {"gpus": 2, "skipped": "1 visible"}, "shared": {"gpus": 1}}
    only = [p for p in RESULT["points"] if p["layout"] == "shared"]
    assert sl.verdict(sl.compare(only), skipped) == ["No comparison: split: 1 visible."]


def test_report_and_plot_show_both_layouts(tmp_path):
    path = tmp_path / "serve-layouts.json"
    path.write_text(json.dumps(RESULT))
    assert bs.main(["--report", str(path)]) == 0
    md = path.with_suffix(".md").read_text()
    assert "| split | 2 | `baton serve` | prefill-0 on GPU 0 | ran |" in md
    assert "| fixed N=8 | 700.0 / **742.0** | 350.0 / **742.0** | **0.500** / 0.750 | **1.000** / 1.500 |" in md
    assert "- Output tok/s (higher is better): split at 2 of 3" in md
    assert "### split layout (2 GPUs), every point" in md and "### shared layout (1 GPU), every point" in md
    pytest.importorskip("matplotlib")
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_two_runs_one_layout_each_merge_into_one_comparison(tmp_path):
    """split from one command, shared from another (e.g. to keep each under a time limit): one report."""
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ab.json"
    for f, lay in ((a, "split"), (b, "shared")):
        other = "shared" if lay == "split" else "split"
        lays = {lay: RESULT["layouts"][lay], other: {"gpus": sl.GPUS[other], "serve_args": [], "skipped": "-"}}
        f.write_text(
            json.dumps({**RESULT, "layouts": lays, "points": [p for p in RESULT["points"] if p["layout"] == lay]})
        )
    assert bs.main(["--report", str(a), str(b), "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert not any(lay.get("skipped") for lay in m["layouts"].values())
    assert len(m["comparison"]) == 3 and m["verdict"] == sl.verdict(sl.compare(RESULT["points"]), RESULT["layouts"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_layout_both_on_the_cpu_end_to_end(tmp_path):
    """The embedded model, tiny sizes, --layout both on a machine without GPUs: shared runs every point
    (fixed closed-loop and mixed Poisson with long prompts), split is recorded skipped with its reason, and
    the JSON, .md and .png carry both layouts' fields."""
    out = tmp_path / "r.json"
    argv = ["--layout", "both", "--workload", "fixed,mixed", "--concurrency", "1,2", "--requests", "1"]
    argv += ["--input-len", "8", "--output-len", "4", "--rate", "50", "--num-prompts", "3", "--long-frac", "0.5"]
    argv += ["--long-input", "40:64", "--no-hf", "--warmup", "", "--out", str(out)]
    assert bs.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["layouts"]["split"]["skipped"].startswith("the split layout needs --device cuda")
    assert r["layouts"]["shared"]["serve"]["exit_code"] == 0 and r["layouts"]["shared"]["gpus"] == 1
    log = tmp_path / "r.serve-shared.log"  # the whole `baton serve` stderr beside the JSON
    assert r["layouts"]["shared"]["serve"]["log"] == str(log) and "decode-0 ready on" in log.read_text()
    got = [(p["layout"], p["workload"], p["mode"], p.get("concurrency"), p.get("rate")) for p in r["points"]]
    assert got == [
        ("shared", w, m, n, x)
        for w in ("fixed", "mixed")
        for m, n, x in (("concurrency", 1, None), ("concurrency", 2, None), ("rate", None, 50.0))
    ]
    for p in r["points"]:
        assert p["errors"] == {} and p["mismatched"] == 0 and p["checked"] == p["completed"] == p["streams"], p
        assert p["goodput_per_gpu"] == p["tok_s"] and p["decode_steps"] > 0 and p["decode_step_s_p99"] > 0
        shares = {k: v for k, v in p.items() if k.startswith("decode_phase_share_")}
        assert shares["decode_phase_share_launch"] > 0 and 0.99 <= sum(shares.values()) <= 1.01, shares
    assert r["workloads"]["mixed"]["long_prompts"] >= 1
    assert r["comparison"] == [] and r["verdict"] == [f"No comparison: split: {r['layouts']['split']['skipped']}."]
    md = out.with_suffix(".md").read_text()
    assert "| split | 2 |" in md and "skipped: the split layout needs" in md and "No comparison" in md


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_layout_whose_serve_fails_is_recorded_and_fails_the_run(tmp_path, monkeypatch):
    """split's `baton serve` refuses to start (a bad option stands in for a worker that cannot load): the
    run goes on with shared, records split as failed with serve's reason, and exits 1."""
    real = sl.plan

    def plan(layouts, device, serve_args="", env=None):
        out = real(layouts, device, serve_args, env)
        out["split"] = {"gpus": 2, "serve_args": ["--slots", "0"]}
        return out

    monkeypatch.setattr(sl, "plan", plan)
    out = tmp_path / "r.json"
    argv = ["--layout", "both", "--concurrency", "1", "--requests", "1", "--input-len", "8", "--output-len", "4"]
    assert bs.main(argv + ["--no-hf", "--warmup", "", "--no-plot", "--out", str(out)]) == 1
    r = json.loads(out.read_text())
    assert "--slots must be >= 1" in r["layouts"]["split"]["failed"] and "serve" not in r["layouts"]["split"]
    assert [(p["layout"], p["errors"]) for p in r["points"]] == [("shared", {})]
