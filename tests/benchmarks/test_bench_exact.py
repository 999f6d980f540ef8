"""benchmarks/bench_exact.py on CPU: real worker processes, tiny random model, 1 run, p in {0.5, 1.0}.

Also the pieces it rests on: the acceptance-controlled drafter in process (p = 1 proposes the exact
tokens, p = 0 never does, the state follows the proposals), the bound arithmetic, and that nothing on
the production path can reach the benchmark-only worker."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_exact as be  # noqa: E402

TINY = str(ROOT / "baton" / "assets" / "default-model")
N, K = 12, 4


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_exact") / "exact.json"
    cmd = [
        sys.executable,
        "benchmarks/bench_exact.py",
        "--random-init",
        TINY,
        "--seed",
        "3",
        "--prompt-len",
        "20",
        "--new",
        str(N),
        "--real-new",
        str(N - 4),
        "--runs",
        "1",
        "--warmup",
        "0",
        "--ks",
        str(K),
        "--ps",
        "0.5,1.0",
        "--controlled-engine",
        "bf16",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stderr[-4000:]}"
    res = json.loads(r.stdout)
    assert json.loads(out.read_text()) == res
    return res


@pytest.mark.slow  # 19-30 s on a busy 2-core box: three worker processes start
@pytest.mark.timeout(450)
def test_json_sane_and_token_identical(result):
    r = result
    assert r["complete"] and r["all_identical"] and r["mismatches"] == []
    assert r["command"].startswith("python benchmarks/bench_exact.py --random-init")
    assert r["machine"]["torch"] and r["date"][:2] == "20"
    assert r["setup"]["new_tokens"] == N and r["setup"]["ks"] == [K] and r["setup"]["ps"] == [0.5, 1.0]
    assert r["bf16_ar"]["tok_s"] > 0 and r["bf16_ar"]["identical_to_bf16_ar"]
    real = {x["drafter"]: x for x in r["exact_real"]}
    assert set(real) == {"fp8", "mtp"}
    assert r["setup"]["real_draft_new_tokens"] == N - 4
    for x in real.values():
        assert x["identical_to_bf16_ar"] and x["tok_s"] > 0 and x["K"] == K and x["new_tokens"] == N - 4
        assert 0 <= x["accepted"] <= x["drafted"] and x["rounds"] >= 1
    c = r["costs"][str(K)]
    assert c["t_draft"] > 0 and c["t_verify"] > 0 and c["t_rpc"] > 0
    s = r["summary"]
    assert s["all_identical_to_bf16_ar"] and s["min_measured_over_bound"] > 0


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_controlled_acceptance(result):
    rows = {x["p"]: x for x in result["controlled"]}
    assert set(rows) == {0.5, 1.0}
    for x in rows.values():
        assert x["identical_to_bf16_ar"] and x["K"] == K
        assert x["tok_s"] > 0 and x["bound_tok_s"] > 0 and x["direct_tok_s"] > 0 and x["measured_over_bound"] > 0
    one = rows[1.0]
    # p = 1: every block accepted whole, as many rounds as the router's schedule allows
    assert one["accepted"] == one["drafted"]
    assert one["rounds"] == one["rounds_expected_at_p1"] == be.rounds_at_p1(N, K)
    assert one["direct_tokens_per_round"] == pytest.approx((N - 1) / be.rounds_at_p1(N, K))
    assert one["E_tokens_per_round"] == K + 1
    half = rows[0.5]
    assert half["accepted"] < half["drafted"] and half["rounds"] > one["rounds"]


def test_bound_arithmetic():
    assert be.rounds_at_p1(128, 8) == 15  # 14 rounds of 9, then 1 (k = 1, cut to 1 token)
    assert be.schedule(12, 4, [5, 5, 1]) == [(4, 4), (4, 4), (1, 0)]
    c = {
        "K": 4,
        "t_draft": 0.01,
        "D": {"none": 0.05, "skip": 0.05, "full": 0.06, "back": 0.06},
        "V": {"all": 0.02, "rej": 0.03},
        "c_full": 0.01,
        "c_back": 0.01,
        "t_fix": 0.01,
    }
    st = be.bound_steady(c, 1.0, 4)
    assert st["E_tokens_per_round"] == 5 and st["t_round_ms"] == pytest.approx(80.0)
    assert be.bound_steady(c, 0.5, 4)["E_tokens_per_round"] == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    # p = 1 and a schedule of full blocks only: the run bound is the realized bound of that schedule
    n = 1 + 5 * 6 + 1
    sched = [(4, 4)] * 6 + [(1, 1)]
    assert be.bound_run(c, 1.0, 4, n) == pytest.approx(be.bound_realized(c, sched, n))
    assert be.bound_run(c, 0.9, 4, 129) < be.bound_run(c, 1.0, 4, 129)


def test_controlled_engine_in_process(tmp_path):
    """p = 1: the drafts are the reference; p = 0: none is, and the state consumed what was proposed."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: 2 OpenMP threads on a busy 2-core box: 30 s instead of 0.4 s
    try:
        _controlled_round_trips(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _controlled_round_trips(tmp_path):
    from baton.engine.runner import ModelRunner
    from baton.loading import load_model
    from benchmarks.controlled_decode_worker import Control, ControlledDrafter
    from decode_worker.engine import DecodeEngine
    from prefill_worker.engine import ExactEngine

    lm = load_model(TINY, dtype="fp32", device="cpu", mtp=False)
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=96))
    prompt = list(range(5, 25))
    ref = exact.generate(prompt, 20)
    path = tmp_path / "ref.json"
    for p in (1.0, 0.0):
        path.write_text(json.dumps({"references": [{"prompt_len": len(prompt), "tokens": ref}], "p": p, "seed": 1}))
        eng = DecodeEngine(
            {"bf16": ModelRunner(lm.model, slots=1, max_len=96)},
            default_engine="bf16",
            drafter=ControlledDrafter(Control(path, 0.5, 0)),
        )
        s, first = exact.prefill(prompt)
        tensors, pos, nxt = exact.export(s.id)
        d = eng.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt)
        out, verdict = [first], None
        while len(out) < 16:
            drafts = eng.draft(d.id, K, verdict)
            if p == 1.0:
                assert drafts == ref[len(out) : len(out) + K]
            else:
                assert drafts[0] != ref[len(out)]
            v = exact.verify(s.id, [out[-1]] + drafts)
            assert v.accepted == (K if p == 1.0 else 0)
            out += drafts[: v.accepted] + [v.next_token]
            verdict = (v.accepted, v.next_token)
        assert out[:16] == ref[:16]
        exact.release(s.id)
        eng.release(d.id)
        with pytest.raises(ValueError, match="reference: none"):
            eng.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=(nxt + 1) % 100)
        assert eng.session_count() == 0  # the refused load left no session behind


def test_benchmark_worker_is_not_reachable_from_production():
    def imports_it(text: str) -> bool:
        return (
            "benchmarks.controlled_decode_worker" in text
            or re.search(r"from\s+benchmarks\s+import[^\n]*controlled_decode_worker", text) is not None
        )

    hits = [
        str(f.relative_to(ROOT))
        for d in ("baton", "router", "decode_worker", "prefill_worker", "deploy")
        for f in (ROOT / d).rglob("*.py")
        if imports_it(f.read_text("utf-8"))
    ]
    assert hits == []
    assert imports_it("from benchmarks import shapes, controlled_decode_worker")
