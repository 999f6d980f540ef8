"""bench_serve's speculating runs (issue 21, point 5): fast-mode mtp and exact mode, real and controlled drafts.

In process: the controlled drafter drives fast-mode mtp rounds and exact-mode mtp drafts (p = 1: every
block accepted whole, p = 0: none), tells apart references that share a prompt length and first token;
the speculation fields from streamed messages; the option checks; the report's columns. End to end (slow,
real processes over loopback gRPC, the embedded trained model): `--engine mtp --concurrency 1,2` through
`baton serve --processes`, and `--mode exact --engine fp8 --draft-p 0.9` through the controlled topology
(benchmarks/topology.py): every stream equals `baton complete`, the speculation fields are there and
sane (controlled: acceptance near the law), and every field of a point is documented."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from benchmarks import bench_serve as bs

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "baton" / "assets" / "default-model")
K = 4


# ---------------------------------------------------------------------------------------- controlled mtp
@pytest.fixture(scope="module")
def engines():
    import torch

    from baton.engine.runner import ModelRunner
    from baton.loading import load_model
    from prefill_worker.engine import ExactEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: 2 OpenMP threads on a busy 2-core box are far slower
    lm = load_model(TINY, dtype="fp32", device="cpu", mtp=True)
    exact = ExactEngine(ModelRunner(lm.model, slots=2, max_len=96))
    prompt = list(range(5, 25))
    yield lm, exact, prompt, exact.generate(prompt, 24)
    torch.set_num_threads(threads)


def _controlled(lm, path, refs, p):
    from baton.engine.runner import ModelRunner
    from benchmarks.controlled_decode_worker import Control, ControlledDrafter
    from decode_worker.engine import DecodeEngine

    path.write_text(json.dumps({"references": refs, "p": p, "seed": 1}))
    r = ModelRunner(lm.model, slots=2, max_len=96)
    drafter = ControlledDrafter(Control(path, 0.5, 0))  # fixed K: the law is the one at K
    return DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", drafter=drafter, draft_length="fixed")


def _load(exact, eng, prompt):
    s, first = exact.prefill(prompt)
    tensors, pos, nxt = exact.export(s.id)
    d = eng.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine="mtp")
    return s, d, first


def _fast(eng, d, first, n):
    out, sizes = [first], []
    for batch in eng.decode(d.id, n, k=K):
        out += batch
        sizes.append(len(batch))
    return out, sizes


def test_controlled_drafter_drives_fast_mtp_rounds(engines, tmp_path, monkeypatch):
    """Fast mode, engine mtp: p = 1 accepts every block whole (K + 1 tokens a round), p = 0 none (one
    token a round); the tokens are the reference either way (the BF16 verify). The drafter's host-side
    round start (position, pending token) is the state's own at every round."""
    from benchmarks import controlled_decode_worker as cdw

    host = cdw._round_start
    seen = []

    def checked(s):
        st = s.runner.state
        seen.append(host(s) == (int(st.position[s.slot]), int(st.next_token[s.slot])))
        return host(s)

    monkeypatch.setattr(cdw, "_round_start", checked)
    lm, exact, prompt, ref = engines
    for p, want in ((1.0, [K + 1] * 3), (0.0, [1] * 15)):
        eng = _controlled(lm, tmp_path / "ref.json", [{"prompt_len": len(prompt), "tokens": ref}], p)
        s, d, first = _load(exact, eng, prompt)
        exact.release(s.id)
        out, sizes = _fast(eng, d, first, 15)
        assert out == ref[:16] and sizes == want, p
        eng.release(d.id)
    assert len(seen) == 3 + 14 and all(seen)  # p = 0: the last round has one token left, so K = 0 (no drafts)


def test_controlled_drafter_drives_exact_mode_mtp_drafts(engines, tmp_path):
    lm, exact, prompt, ref = engines
    eng = _controlled(lm, tmp_path / "ref.json", [{"prompt_len": len(prompt), "tokens": ref}], 1.0)
    s, d, first = _load(exact, eng, prompt)
    out, verdict = [first], None
    while len(out) < 16:
        drafts = eng.draft(d.id, K, verdict)
        assert drafts == ref[len(out) : len(out) + K]
        v = exact.verify(s.id, [out[-1]] + drafts)
        assert v.accepted == K
        out += drafts + [v.next_token]
        verdict = (v.accepted, v.next_token)
    assert out[:16] == ref[:16]
    exact.release(s.id)
    eng.release(d.id)


def test_references_sharing_a_first_token_are_told_apart(engines, tmp_path):
    """Another prompt's reference with the same length and first token, listed first, parting at index 6:
    p = 1 follows it until then (one forced miss, at 6), then only the true one is left."""
    lm, exact, prompt, ref = engines
    other = ref[:6] + [(ref[6] + 1) % lm.cfg.vocab_size] + ref[7:]
    refs = [{"prompt_len": len(prompt), "tokens": t} for t in (other, ref)]
    eng = _controlled(lm, tmp_path / "ref.json", refs, 1.0)
    s, d, first = _load(exact, eng, prompt)
    exact.release(s.id)
    out, sizes = _fast(eng, d, first, 15)
    assert out == ref[:16] and sizes == [K + 1, 1, K + 1, K] and d.ctl.refs == [ref]
    eng.release(d.id)
    assert (
        bs.reference_file(tmp_path / "r.json", [bs.Workload("w", [prompt, prompt], [])], [{0: ref, 1: other}], 1, 0)
        == 2
    )


# ---------------------------------------------------------------------------------------- fields, options
def _sample(sizes, drafted=0, accepted=0):
    toks = list(range(sum(sizes)))
    return bs.Sample(0.0, [0.1 * (i + 1) for i in range(len(sizes))], toks, "OK", 1.0, None, sizes, drafted, accepted)


def test_speculation_fields_from_the_rounds():
    ok = [_sample([1, 5, 3, 5, 2]), _sample([1, 2, 5], drafted=99, accepted=98)]
    fast = bs.speculation(ok, bs.Gen("mtp"), 4, None)
    # rounds: messages after the first; each stream's last round left out of drafted / accepted
    assert fast == {
        "draft_k": 4,
        "rounds": 6,
        "tokens_per_round": round(22 / 6, 3),
        "drafted": 4 * 4,
        "accepted": 4 + 2 + 4 + 1,
        "acceptance_rate": round(11 / 16, 4),
    }
    exact = bs.speculation(ok[1:], bs.Gen("fp8", "exact"), 4, 0.9)
    assert (exact["drafted"], exact["accepted"], exact["draft_p"]) == (99, 98, 0.9)
    assert "round_ms_p50" not in exact  # no rounds in the router's Stats: no split
    timed = _sample([1, 2, 5], drafted=8, accepted=5)
    timed.times, timed.rounds, timed.draft_ms, timed.verify_ms = [0.0, 0.1, 0.3], 2, 60.0, 100.0
    split = bs.speculation([timed], bs.Gen("mtp", "exact"), 4, None)
    assert {k: split[k] for k in split if k.startswith("round_")} == {
        "round_ms_p50": 150.0,  # 0.3 s from the first token to the last message, 2 rounds
        "round_draft_ms_p50": 30.0,
        "round_verify_ms_p50": 50.0,
        "round_other_ms_p50": 70.0,
    }
    law = bs.expected_law(0.9, 4)
    assert law == {
        "expected_acceptance_rate": round((0.9 + 0.81 + 0.729 + 0.6561) / 4, 4),
        "expected_tokens_per_round": 4.095,
    }
    assert (
        bs.expected_law(1.0, 4)["expected_tokens_per_round"] == 5
        and bs.expected_law(0.0, 3)["expected_acceptance_rate"] == 0
    )


def test_adaptive_fast_mtp_counts_rounds_not_drafts():
    """--mtp-draft-length adaptive: K moves round to round (K = 0 rounds are one token), so the point keeps
    rounds and tokens a round and gives no drafted / accepted or law at the prior K."""
    ok = [_sample([1, 5, 1, 1, 2]), _sample([1, 2, 5])]
    fast = bs.speculation(ok, bs.Gen("mtp"), 4, 0.9, adaptive=True)
    assert fast == {
        "draft_k": 4,
        "rounds": 6,
        "tokens_per_round": round(16 / 6, 3),
        "draft_length": "adaptive",
        "drafted": None,
        "accepted": None,
        "acceptance_rate": None,
        "draft_p": 0.9,
    }
    assert bs.run_label({"engine": "mtp", "draft_p": 0.9, "draft_k": 4, "draft_length": "adaptive"}) == (
        "fast mtp p=0.9 K=4 adaptive"
    )
    # exact mode's K is the router's: the flag is refused there, and without --draft-p (plain serve: adaptive)
    for bad in (
        ["--engine", "mtp", "--mtp-draft-length", "adaptive"],
        ["--mode", "exact", "--engine", "mtp", "--draft-p", "0.9", "--mtp-draft-length", "adaptive"],
    ):
        with pytest.raises(SystemExit):
            _resolved(*bad)
    a = _resolved("--engine", "mtp", "--draft-p", "0.9", "--prompts", "1", "--mtp-draft-length", "adaptive")
    assert a.mtp_draft_length == "adaptive"


def test_the_controlled_topology_passes_the_draft_length():
    from benchmarks.topology import ControlledServe

    for length in ("fixed", "adaptive"):
        c = ControlledServe(["--device", "cpu"], reference="r.json", draft_p=0.9, mtp_k=3, mtp_draft_length=length)
        (dec,) = [x for x in c.cmds if x.module == "benchmarks.controlled_decode_worker"]
        assert dec.args[-4:] == ["--mtp-k", "3", "--mtp-draft-length", length]


def _resolved(*argv):
    a = bs.build_parser().parse_args(list(argv))
    bs.resolve(a)
    return a


def test_options_of_the_speculating_runs():
    a = _resolved("--engine", "mtp")
    assert (a.check, a.k, a.gen) == ("complete", 4, bs.Gen("mtp", "fast", 4)) and a.draft_p is None
    e = _resolved("--mode", "exact", "--engine", "fp8", "--device", "cuda", "--draft-p", "0.95", "--draft-k", "8")
    assert (e.check, e.check_prompts, e.k, e.draft_seed) == ("complete", -1, 8, 0)  # every prompt referenced
    assert _resolved("--engine", "fp8").check == "alone" and _resolved("--engine", "fp8").gen.draft_block == 0
    ok = _resolved(
        "--engine", "mtp", "--draft-p", "0.9", "--concurrency", "8", "--prompts", "2", "--check-prompts", "2"
    )
    assert ok.check_prompts == -1
    for bad in (
        ["--draft-p", "0.9"],  # fast bf16 drafts nothing
        ["--engine", "mtp", "--draft-k", "6"],  # plain baton serve: the worker's --mtp-k 4
        ["--engine", "mtp", "--draft-p", "1.5"],
        ["--mode", "exact", "--engine", "mtp", "--draft-p", "0.9", "--check", "alone"],
        ["--mode", "exact", "--engine", "mtp", "--draft-p", "0.9", "--concurrency", "8", "--check-prompts", "2"],
        ["--mode", "exact", "--draft-k", "15"],
    ):
        with pytest.raises(SystemExit):
            _resolved(*bad)


def test_report_shows_the_run_and_speculation_columns(tmp_path):
    base = {"workload": "fixed", "mode": "concurrency", "concurrency": 8, "tok_s": 900.0, "stream_tok_s_p50": 1.0}
    base |= {"ttft_s_p50": 0.1, "ttft_s_p99": 0.2, "itl_s_p50": 0.01, "itl_s_p99": 0.02, "errors": {}}
    base |= {"checked": 8, "mismatched": 0}
    spec = {"draft_k": 4, "rounds": 10, "tokens_per_round": 4.1, "drafted": 40, "accepted": 31}
    spec |= {"acceptance_rate": 0.775, "draft_p": 0.9} | bs.expected_law(0.9, 4)
    pts = [base | {"serve_mode": "fast", "engine": "bf16"}, base | {"serve_mode": "fast", "engine": "mtp"} | spec]
    md = "\n".join(bs._tables(pts))
    assert "| fast bf16 | fixed | 8 | 900.0 |" in md and "| fast mtp p=0.9 K=4 | fixed | 8 |" in md
    assert "| 31 / 40 (0.775, law 0.774) | 4.10 (law 4.09) |" in md
    assert "run" not in "\n".join(bs._tables([base]))  # an old file's table is as it was


# ---------------------------------------------------------------------------------------- end to end
def _documented(points: list[dict]) -> list[str]:
    """Point fields the module docstring does not name (a family like ttft_s_* counts for its members)."""
    doc = bs.__doc__
    fams = re.findall(r"(\w+)_\*", doc)
    return sorted(
        {
            k
            for p in points
            for k in p
            if not re.search(rf"\b{k}\b", doc) and not any(k.startswith(f + "_") for f in fams)
        }
    )


def _run(tmp_path, *argv) -> dict:
    out = tmp_path / "r.json"
    base = ["--requests", "2", "--input-len", "8", "--no-hf", "--warmup", "", "--no-plot", "--out", str(out)]
    assert bs.main([*base, *argv]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow  # ~20 s: `baton serve --processes` with 2 workers on 2 cores
@pytest.mark.timeout(300)
def test_fast_mtp_through_baton_serve(tmp_path):
    r = _run(tmp_path, "--engine", "mtp", "--concurrency", "1,2", "--output-len", "12")
    assert [p["concurrency"] for p in r["points"]] == [1, 2] and r["serve"]["argv"].startswith("baton serve")
    for p in r["points"]:
        assert (p["serve_mode"], p["engine"], p["errors"], p["mismatched"]) == ("fast", "mtp", {}, 0)
        assert (
            p["checked"] == p["completed"] == p["streams"] == 2 * p["concurrency"] and p["tokens"] == 12 * p["streams"]
        )
        # 11 tokens after the first, in rounds of 1..K+1: the real MTP head of the trained model
        assert p["streams"] * 11 / (K + 1) <= p["rounds"] <= p["streams"] * 11
        assert p["tokens_per_round"] == pytest.approx(p["streams"] * 11 / p["rounds"], abs=1e-3)
        assert 0 <= p["accepted"] <= p["drafted"] == K * (p["rounds"] - p["streams"]) and p["draft_k"] == K
        assert "draft_p" not in p and p["decode_gathered_batches"] > 0
        # the decode worker's rounds by the K its (adaptive) controller ran (WorkerStats.mtp_rounds_by_k), each
        # one batch of one or more sessions' rounds, timed; each round gives each of its sessions a token at
        # least (a message may carry several rounds' tokens: pipelined plain rounds)
        by_k = p["mtp_rounds_by_k"]
        assert by_k and all(0 <= int(k) <= 8 and n > 0 for k, n in by_k.items()), by_k
        assert sum(by_k.values()) <= p["streams"] * 11, by_k
        assert set(p["mtp_round_ms_by_k"]) == set(by_k) and all(ms > 0 for ms in p["mtp_round_ms_by_k"].values())
        # the controller's log of the point's speculative rounds (WorkerStats.mtp_spec_rounds): as many a K as
        # by_k counts (fewer than 256 here), each of at most the point's sessions, in round order
        spec = p.get("mtp_spec_rounds", [])
        assert all(by_k.get(str(k)) == sum(e[1] == k for e in spec) for k in range(1, 9) if str(k) in by_k), spec
        assert all(1 <= e[2] <= p["concurrency"] and e[3] > 0 and e[4] in (0, 1) for e in spec), spec
        assert [e[0] for e in spec] == sorted({e[0] for e in spec}), spec
    assert _documented(r["points"]) == []


@pytest.mark.slow  # ~25 s: prefill, controlled decode and router processes on 2 cores
@pytest.mark.timeout(300)
def test_exact_fp8_with_controlled_drafts(tmp_path):
    argv = ["--mode", "exact", "--engine", "fp8", "--draft-p", "0.9", "--concurrency", "2", "--output-len", "24"]
    r = _run(tmp_path, *argv)
    assert r["controlled"] == {
        "draft_p": 0.9,
        "draft_k": K,
        "draft_seed": 0,
        "draft_length": "fixed",
        "references": 2,
        "shared_first_token": 0,
    }
    assert "benchmarks.controlled_decode_worker --reference" in r["serve"]["argv"] and r["serve"]["exit_code"] == 0
    (p,) = r["points"]
    assert (p["serve_mode"], p["engine"], p["controlled"], p["errors"], p["mismatched"]) == (
        "exact",
        "fp8",
        True,
        {},
        0,
    )
    assert p["checked"] == p["completed"] == 4 and p["tokens"] == 4 * 24 and p["draft_p"] == 0.9
    # the router's Stats: k = min(K, remaining - 1) a round; 23 tokens after the first in each stream
    assert 4 * 23 / (K + 1) <= p["rounds"] <= 4 * 23 and 0 < p["accepted"] <= p["drafted"] <= K * p["rounds"]
    law = bs.expected_law(0.9, K)
    assert abs(p["acceptance_rate"] - law["expected_acceptance_rate"]) < 0.25, p  # ~80 drafts: sd ~0.06
    assert abs(p["tokens_per_round"] - law["expected_tokens_per_round"]) < 1.5, p
    assert p["prefill_gathered_batches"] >= p["rounds"] / 2  # every round's Verify went through the gather
    # the router sent the rounds' calls as batched RPCs (router/batcher.py): all of them, at least one a round
    for role in ("prefill", "decode"):
        assert p["rounds"] / 4 <= p[f"{role}_batched_rpcs"] <= p["rounds"] and p[f"{role}_batched_mean"] >= 1, p
    # where a round goes: the router's Draft / Verify calls, each within the stream's round, and the workers'
    # gathered batches (a Verify batch ran for some time; its parts are not negative)
    assert 0 < p["round_draft_ms_p50"] < p["round_ms_p50"] and 0 < p["round_verify_ms_p50"] < p["round_ms_p50"], p
    assert p["round_other_ms_p50"] > -2.0  # per stream: its round less its calls (each p50 over the streams)
    assert p["prefill_gathered_run_ms"] > 0 and p["decode_gathered_run_ms"] > 0, p
    assert 0 < p["router_cpu"] < 4, p  # the router's process ran the exact loops: some CPU, within the cores
    assert min(p[f"{r}_gathered_{k}_ms"] for r in ("prefill", "decode") for k in ("wait", "lock", "run")) >= 0, p
    assert _documented(r["points"]) == []


def test_the_controlled_topology_tells_workers_on_one_gpu_they_share_it(monkeypatch):
    """As `baton serve` does (deploy/processes.py place_workers): on one visible GPU the prefill and decode
    workers both get BATON_GPU_WORKERS=2 and their own plan files, so exact mode's gathers merge
    (rounds_share_a_device) and their KV budgets agree; the router gets neither."""
    from benchmarks.topology import ControlledServe
    from deploy import processes

    started = []

    class FakeWorker:
        def __init__(self, spec, env=None, echo=None):
            self.spec, self.env, self.pid = spec, env, 1
            started.append(self)

        def start(self):
            return self

        def wait_ready(self, **kw):
            return "127.0.0.1:1"

    monkeypatch.setattr(processes, "WorkerProcess", FakeWorker)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_GPU_")} | {"CUDA_VISIBLE_DEVICES": "3"}
    c = ControlledServe(["--device", "cuda"], reference="r.json", draft_p=0.9, env=env)
    assert c.wait(timeout=5) == "127.0.0.1:1"
    workers, router = started[:-1], started[-1]
    assert [w.spec.name for w in workers] == ["prefill-0", "decode-0"]
    assert [w.env["BATON_GPU_WORKERS"] for w in workers] == ["2", "2"]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["3", "3"]
    plans = [w.env["BATON_GPU_PLAN"] for w in workers]
    assert len(set(plans)) == 2 and os.path.dirname(plans[0]) == os.path.dirname(plans[1])
    assert "BATON_GPU_WORKERS" not in router.env
