"""benchmarks/bench_serve.py and benchmarks/baselines.py: the seeded workloads and arrival schedule, the
bandwidth floor against DESIGN.md §1's figures for the 9B shape, the summary of streams, the report and
plot from a result file, and one short end-to-end run on the CPU (`baton serve --processes`)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from benchmarks import baselines, suite
from benchmarks import bench_serve as bs


# ---------------------------------------------------------------------------------------- workloads
def test_poisson_schedule_is_seeded_and_has_the_asked_rate():
    a = bs.poisson_schedule(4000, 8.0, seed=3)
    assert a == bs.poisson_schedule(4000, 8.0, seed=3)
    assert a != bs.poisson_schedule(4000, 8.0, seed=4)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(1 / 8.0, rel=0.05)  # mean gap 1/rate (seeded: deterministic)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(g > 1 / 8.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)  # exponential
    assert bs.poisson_schedule(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        bs.poisson_schedule(3, 0.0)


def test_mixed_workload_is_seeded_and_in_its_ranges():
    kw = dict(input_range=(16, 64), output_range=(4, 12), vocab=100, seed=7, long_frac=0.25, long_range=(200, 300))
    w = bs.mixed_workload(400, **kw)
    again = bs.mixed_workload(400, **kw)
    assert (w.prompts, w.requests) == (again.prompts, again.requests)
    assert w.prompts != bs.mixed_workload(400, **{**kw, "seed": 8}).prompts
    lens = [len(p) for p in w.prompts]
    long = [n for n in lens if n >= 200]
    assert all(16 <= n <= 64 or 200 <= n <= 300 for n in lens)
    assert len(long) / len(lens) == pytest.approx(0.25, abs=0.06) and w.info["long_prompts"] == len(long)
    assert all(4 <= n <= 12 for _, n in w.requests) and [p for p, _ in w.requests] == list(range(400))
    assert all(0 <= t < 100 for p in w.prompts for t in p)
    assert {n for _, n in w.requests} == set(range(4, 13))  # both bounds reached: inclusive
    assert not any(len(p) >= 200 for p in bs.mixed_workload(50, **{**kw, "long_frac": 0.0}).prompts)


def test_fixed_workload_and_the_checked_prompts():
    w = bs.fixed_workload(10, 4, 8, 5, vocab=50, seed=1)
    assert w.prompts == bs.fixed_workload(10, 4, 8, 5, vocab=50, seed=1).prompts
    assert len(w.prompts) == 4 and len({tuple(p) for p in w.prompts}) == 4 and all(len(p) == 8 for p in w.prompts)
    assert [p for p, _ in w.requests] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert w.ref_lengths(2) == {0: 5, 1: 5} and w.ref_lengths(-1) == {0: 5, 1: 5, 2: 5, 3: 5}
    jobs = w.jobs({1: list(range(9))}, 0, 3)
    assert [j.ref for j in jobs] == [None, tuple(range(9)), None] and all(j.max_new == 5 for j in jobs)
    m = bs.mixed_workload(6, (3, 3), (2, 9), vocab=10, seed=0)
    assert m.ref_lengths(-1) == dict(m.requests)


def test_resolve_fills_the_device_defaults():
    p = bs.build_parser()
    cpu = p.parse_args([])
    bs.resolve(cpu)
    assert (cpu.points, cpu.input_len, cpu.output_len, cpu.check, cpu.check_prompts) == (
        [1, 2, 4, 8],
        32,
        48,
        "complete",
        -1,
    )
    assert cpu.max_len == 512 and cpu.slots == 8
    gpu = p.parse_args(["--device", "cuda", "--engine", "fp8", "--random-init", "qwen3.5-9b", "--rate", "4"])
    bs.resolve(gpu)
    assert gpu.points == [1, 8, 32, 64, 128] and (gpu.input_len, gpu.output_len) == (512, 256)
    assert gpu.check == "alone" and gpu.slots == 128 and gpu.num_prompts == 512 and gpu.max_len == 1024
    assert gpu.ckpt_dir == "/tmp/baton-bench-ckpt/qwen3.5-9b-seed0" and gpu.n_requests == 512
    long = p.parse_args(["--workload", "fixed,mixed", "--long-frac", "0.1", "--concurrency", "32"])
    bs.resolve(long)
    assert long.max_len >= 16384 + 2 * 48 and long.max_len % 256 == 0
    with pytest.raises(argparse.ArgumentTypeError):
        bs.span("9:3")


# ---------------------------------------------------------------------------------------- the floor
def test_floor_gives_the_design_figures_for_the_9b_shape():
    from baton.random_init import shape

    cfg = shape("qwen3.5-9b")
    assert baselines.weight_bytes(cfg) / 1e9 == pytest.approx(15.9, rel=0.01)  # DESIGN.md §1: 15.9 GB bf16
    assert baselines.weight_bytes(cfg, "fp8") / 1e9 == pytest.approx(7.9, rel=0.01)  # 7.9 GB fp8
    assert baselines.row_bytes(cfg, 512) / 1e9 == pytest.approx(0.12, rel=0.05)  # ≈ 0.12 GB per row at 512
    bw = 4.24e12  # the H200's measured copy bandwidth of the README's decode table
    for rows, want in ((1, 266), (8, 2000), (32, 6900), (64, 11600)):  # DESIGN.md §1 / issue 20
        assert baselines.floor_tok_s(cfg, rows, 512, bw) == pytest.approx(want, rel=0.02), rows
    assert baselines.floor_tok_s(cfg, 8, 512, bw, "fp8") > 1.8 * baselines.floor_tok_s(cfg, 8, 512, bw)


def test_floor_weights_are_the_model_matrices():
    """matmul_params from the config alone = the model's own weight matrices (not the embedding)."""
    from baton.loading import random_model
    from baton.random_init import shape

    cfg = shape("tiny")
    lm = random_model(cfg, dtype="bf16", mtp=False)
    n = sum(p.numel() for k, p in lm.model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in k)
    assert baselines.matmul_params(cfg) == n
    assert baselines.step_bytes(cfg, 3, 100) == baselines.weight_bytes(cfg) + 3 * baselines.row_bytes(cfg, 100)


# ---------------------------------------------------------------------------------------- summary, report
def _sample(start, times, tokens, status="OK", ref=None, n=None):
    job = bs.Job((1, 2, 3), n or len(tokens), ref)
    return bs.Sample(start, times, tokens, status, end=(times[-1] if times else start) + 0.01, job=job)


def test_timeline_ms_gives_each_marks_offsets_after_the_compute():
    a, b, c = _sample(0.0, [0.5], [1]), _sample(0.0, [0.5], [1]), _sample(0.0, [0.5], [1])
    a.timeline = {"prefill.rpc_start": 1_000_000, "prefill.compute_end": 5_000_000, "decode.loaded": 9_000_000}
    b.timeline = {"prefill.compute_end": 10_000_000, "decode.loaded": 30_000_000}
    got = bs.timeline_ms([a, b, c])  # c asked for none
    assert got["prefill.rpc_start"] == {"p50": -4.0, "p99": -4.0, "n": 1}
    assert got["prefill.compute_end"] == {"p50": 0.0, "p99": 0.0, "n": 2}
    assert got["decode.loaded"]["n"] == 2 and 4.0 <= got["decode.loaded"]["p50"] <= got["decode.loaded"]["p99"] == 20.0
    assert bs.timeline_ms([c]) == {}


def test_summarize_streams():
    s = [
        _sample(0.0, [0.5, 0.6, 0.7], [1, 2, 3], ref=(1, 2, 3, 4)),
        _sample(0.0, [1.0, 1.5, 2.0], [1, 2, 9], ref=(1, 2, 3)),
        _sample(0.1, [], [], status="RESOURCE_EXHAUSTED"),
        _sample(0.2, [0.4, 0.5], [5, 6]),
        _sample(0.3, [], [], status="RESOURCE_EXHAUSTED"),
    ]
    s[2].detail, s[4].detail = "decode workers: all session slots are in use", "another"
    r = bs.summarize(s[:4], wall=2.0, cpu_s=0.5)
    assert r["error_details"] == {"RESOURCE_EXHAUSTED": "decode workers: all session slots are in use"}
    assert bs.summarize(s, wall=2.0, cpu_s=0.5)["error_details"] == r["error_details"]  # the first one
    assert (r["streams"], r["completed"], r["tokens"], r["tok_s"]) == (4, 3, 8, 4.0)
    assert (r["checked"], r["mismatched"], r["errors"]) == (2, 1, {"RESOURCE_EXHAUSTED": 1})
    assert r["ttft_s_p50"] == 0.5 and r["ttft_s_max"] == 1.0 and r["client_cpu"] == 0.25
    assert r["stream_tok_s_min"] == 2.0 and r["stream_tok_s_max"] == 10.0 and r["short"] == 0


RESULT = {
    "benchmark": "bench_serve",
    "command": "python benchmarks/bench_serve.py --concurrency 1,8",
    "date": "2026-12-01T00:00:00+00:00",
    "git": {"commit": "abc", "dirty": False},
    "machine": {"host": "h", "cpu": "c", "torch": "2.11", "gpu": "NVIDIA H200"},
    "config": {"engine": "bf16"},
    "model": {"random_init": "qwen3.5-9b"},
    "serve": {"argv": "baton serve --processes"},
    "bandwidth_bytes_per_s": 4.24e12,
    "prepare": {"bandwidth": {"how": "copy"}},
    "hf": {"1": {"tok_s": 7.0}, "8": {"batch": 8, "skipped": "OutOfMemoryError"}},
    "points": [
        {
            "workload": "fixed",
            "mode": "concurrency",
            "concurrency": n,
            "tok_s": t,
            "scaling": t / 169.0,
            "stream_tok_s_p50": t / n,
            "stream_tok_s_min": t / n / 2,
            "ttft_s_p50": 0.15 * n,
            "ttft_s_p99": 0.2 * n,
            "itl_s_p50": 0.005 * n,
            "itl_s_p99": 0.01 * n,
            "errors": {},
            "checked": 8,
            "mismatched": 0,
            "floor_tok_s": f,
            "pct_of_floor": 100 * t / f,
            **({"hf_tok_s": 7.0, "hf_decode_tok_s": 7.5} if n == 1 else {}),
        }
        for n, t, f in ((1, 169.0, 266.0), (8, 187.0, 2000.0))
    ]
    + [
        {
            "workload": "mixed",
            "mode": "rate",
            "rate": r,
            "num_prompts": 16,
            "tok_s": 100.0 * r,
            "requests_per_s": r,
            "mean_inflight": 2.0,
            "ttft_s_p50": 0.2,
            "ttft_s_p99": 0.4,
            "itl_s_p50": 0.01,
            "itl_s_p99": 0.02,
            "errors": {"RESOURCE_EXHAUSTED": 1},
            "checked": 4,
            "mismatched": 0,
        }
        for r in (1.0, 4.0, math.inf)
    ],
}


def test_report_from_a_result_file(tmp_path):
    path = tmp_path / "serve-x.json"
    path.write_text(json.dumps(RESULT))
    assert bs.main(["--report", str(path)]) == 0
    md = path.with_suffix(".md").read_text()
    assert "| fixed | 8 | 187.0 |" in md and "| 7.0 (7.5) | 266.0 |" in md
    assert "| mixed | inf | 16 |" in md and "RESOURCE_EXHAUSTED" in md
    assert "HF generate at batch 8 skipped: OutOfMemoryError" in md and "abc" in md
    lines = suite.summary("serve", RESULT)
    assert any(ln.startswith("| fixed | 1 |") for ln in lines)


def test_plot_from_a_result_file(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    assert bs.plot(RESULT, png) and png.read_bytes()[:4] == b"\x89PNG"
    only_rate = {**RESULT, "points": [p for p in RESULT["points"] if p["mode"] == "rate"]}
    assert bs.plot(only_rate, tmp_path / "r.png")


def test_suite_runs_bench_serve_on_the_gpu(tmp_path):
    p = argparse.ArgumentParser()
    suite.add_arguments(p)
    args = p.parse_args(["--random-init", "qwen3.5-9b", "--new", "256"])
    argv = suite._script("serve", args, tmp_path / "s.json")
    assert argv[1].endswith("bench_serve.py") and argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--concurrency") + 1] == "1,8,32,64,128" and argv[argv.index("--output-len") + 1] == "256"
    fp8 = suite._script("serve_fp8", args, tmp_path / "s.json")
    assert fp8[fp8.index("--engine") + 1] == "fp8"
    assert bs.build_parser().parse_args(argv[2:]).random_init == "qwen3.5-9b"


# ---------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_cpu_run_end_to_end(tmp_path):
    """The embedded model through `baton serve --processes`, every request sampling (T 0.8, top-p 0.9,
    seeded per prompt): concurrency 1, 2 and a Poisson point; every stream equals `baton complete` with
    the same sampling and seed; HF and the floor sit beside each closed point."""
    out = tmp_path / "r.json"
    argv = ["--concurrency", "1,2", "--requests", "1", "--input-len", "8", "--output-len", "4", "--rate", "50"]
    argv += ["--num-prompts", "3", "--hf-new", "4", "--warmup", "", "--out", str(out)]
    argv += ["--temperature", "0.8", "--top-p", "0.9", "--timeline-every", "1"]
    assert bs.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["sampling"] == {"temperature": 0.8, "top_p": 0.9, "seed": 1}
    assert [(p["mode"], p.get("concurrency"), p.get("rate")) for p in r["points"]] == [
        ("concurrency", 1, None),
        ("concurrency", 2, None),
        ("rate", None, 50.0),
    ]
    for p in r["points"]:
        assert p["errors"] == {} and p["mismatched"] == 0 and p["checked"] == p["completed"] == p["streams"], p
        assert p["tokens"] == 4 * p["streams"]
        # every stream's prompt (one piece) in one of the prefill worker's passes of the point
        assert 1 <= p["prefill_passes"] <= p["streams"], p
        assert round(p["prefill_pass_mean_pieces"] * p["prefill_passes"]) == p["streams"], p
        assert p["prefill_pass_ms_mean"] > 0
        # every request asked for its hand-off's timeline: the marks, on the host's one clock, after the compute
        tl = p["handoff_timeline_ms"]
        assert tl["decode.loaded"]["n"] == tl["prefill.compute_end"]["n"] == p["completed"], tl
        assert tl["prefill.rpc_start"]["p99"] <= 0 == tl["prefill.compute_end"]["p50"] <= tl["decode.loaded"]["p50"]
    for p in r["points"][:2]:
        assert p["hf_tok_s"] > 0 and p["floor_tok_s"] > 0
    assert r["git"]["commit"] and r["machine"]["cores_usable"] >= 1 and r["command"].startswith("python benchmarks/")
    assert out.with_suffix(".md").is_file()


def test_sampled_workload_seeds_each_prompt_and_greedy_sends_nothing():
    w = bs.fixed_workload(6, 3, 5, 2, 100, seed=0)
    assert all(j.sampling == () for j in w.jobs({}))
    w.sampling = {"temperature": 0.7, "top_p": 0.5, "seed": 11}
    jobs = w.jobs({1: [4, 5]})
    assert [dict(j.sampling)["seed"] for j in jobs] == [11, 12, 13, 11, 12, 13]  # one seed per prompt
    assert dict(jobs[0].sampling) == {"temperature": 0.7, "top_p": 0.5, "seed": 11}
    assert jobs[1].ref == (4, 5) and jobs[0].ref is None and jobs[4].prompt == tuple(w.prompts[1])


def test_random_checkpoint_loads_bitwise_and_is_reused(tmp_path):
    """`--random-init tiny` written as a checkpoint: the workers' load_model gives the same tensors; a
    second call with the same shape and seed reuses the files, another seed rewrites them."""
    import torch

    from baton.loading import load_model

    d, lm, _ = baselines.write_random_checkpoint("tiny", tmp_path / "ck", seed=2)
    got = load_model(d, dtype="bf16", mtp=False).model.state_dict()
    want = lm.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert baselines.write_random_checkpoint("tiny", d, seed=2)[1] is None
    _, again, _ = baselines.write_random_checkpoint("tiny", d, seed=3)
    assert again is not None and not torch.equal(again.model.state_dict()["lm_head.weight"], want["lm_head.weight"])


def test_report_merges_two_runs(tmp_path):
    """N = 1, 8 from one command and N = 64 (HF measured in the first) from another: one table and plot."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    first = {**RESULT, "hf": {**RESULT["hf"], "64": {"tok_s": 300.0, "decode_tok_s": 390.0}}}
    a.write_text(json.dumps(first))
    p64 = {**RESULT["points"][1], "concurrency": 64, "tok_s": 338.0, "scaling": None}
    p64.pop("hf_tok_s", None)
    b.write_text(
        json.dumps({**RESULT, "command": "python benchmarks/bench_serve.py --concurrency 64", "points": [p64]})
    )
    with pytest.raises(SystemExit):
        bs.main(["--report", str(a), str(b)])
    out = tmp_path / "ab.json"
    assert bs.main(["--report", str(a), str(b), "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    closed = [p for p in m["points"] if p["mode"] == "concurrency"]
    assert [p["concurrency"] for p in closed] == [1, 8, 64] and closed[-1]["hf_decode_tok_s"] == 390.0
    assert closed[-1]["scaling"] == 2.0 and len(m["merged_from"]) == 2
    assert "Merged with `python benchmarks/bench_serve.py --concurrency 64`" in out.with_suffix(".md").read_text()


def test_a_shared_prefix_begins_every_prompt_and_keeps_the_rest():
    """--shared-prefix N: every prompt of every workload begins with the same N tokens (the prefill workers'
    prefix cache then serves them), the rest of each prompt and its length as drawn; prompts not longer stop."""
    p = bs.build_parser()
    a = p.parse_args(
        ["--workload", "fixed,mixed", "--input-len", "40", "--mixed-input", "30:60", "--shared-prefix", "24"]
    )
    bs.resolve(a)
    a.shared_prefix = 0
    want = bs.make_workloads(a, 100)
    a.shared_prefix = 24
    got = bs.make_workloads(a, 100)
    heads = {tuple(q[:24]) for w in got for q in w.prompts}
    assert len(heads) == 1 and all(w.info["shared_prefix"] == 24 for w in got)
    for w, v in zip(got, want):
        assert [q[24:] for q in w.prompts] == [q[24:] for q in v.prompts] and w.requests == v.requests
    a.shared_prefix = 40  # the fixed prompts of 40 tokens are not longer
    with pytest.raises(SystemExit, match="shared-prefix"):
        bs.make_workloads(a, 100)
