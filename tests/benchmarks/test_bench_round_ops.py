"""benchmarks/bench_round_ops.py, in a child process (it runs Triton's interpreter, which must not leak into
this one): a batched MTP round's host ops per session stay well under one a slot's O(1) tensor, where the
per-slot snapshot and rewind it replaced took four (select and copy, each way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_rounds_host_ops_per_session_do_not_grow_with_the_slot_state(tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_round_ops.py"),
        "--sessions",
        "2,3",
        "--k",
        "2",
        "--layers",
        "4",
    ]
    p = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert json.loads(p.stdout) == r
    assert [x["sessions"] for x in r["points"]] == [2, 3] and all(x["ops"] > 0 for x in r["points"])
    assert r["o1_tensors"] == 2 * r["gdn_layers"] + 3 == 9 and r["o1_tensors_9b"] == 51
    assert 0 < r["ops_per_session"] < 2 * r["o1_tensors"], r["ops_per_session"]


@pytest.mark.slow  # ~20 s: two tiny exact rounds in Triton's interpreter
def test_an_exact_rounds_host_ops_per_session_stay_flat(tmp_path):
    """--round exact: the decode worker's Draft batch (verdict rows, pending pairs, mtp chains) and the prefill
    worker's Verify batch of B sessions: the Verify's ops do not grow with B at all, the Draft's by a few
    a session (its per-session slices of the chains' rows), below the four a slot's O(1) tensor a per-slot
    snapshot and rewind took."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_round_ops.py"), "--round", "exact"]
    cmd += ["--sessions", "2,3", "--k", "2", "--layers", "4", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["round"] == "exact" and [x["sessions"] for x in r["points"]] == [2, 3]
    assert all(x["draft_ops"] > 0 and x["verify_ops"] > 0 for x in r["points"])
    assert 0 <= r["verify_ops_per_session"] <= 2, r["verify_ops_per_session"]
    assert 0 <= r["draft_ops_per_session"] < 2 * r["o1_tensors"], r["draft_ops_per_session"]


@pytest.mark.slow  # ~20 s, as above
def test_exact_round_with_bf16_drafts(tmp_path):
    """--round exact --drafts bf16: the Draft batch drafts by AR steps (decode_worker/drafting.py _ar_drafts,
    pipelined on the batched runner): its ops grow by a few a session, the Verify's not at all."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_round_ops.py"), "--round", "exact", "--drafts", "bf16"]
    cmd += ["--sessions", "2,3", "--k", "2", "--layers", "4", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["drafts"] == "bf16" and [x["sessions"] for x in r["points"]] == [2, 3]
    assert 0 <= r["verify_ops_per_session"] <= 2, r["verify_ops_per_session"]
    assert 0 <= r["draft_ops_per_session"] < 2 * r["o1_tensors"], r["draft_ops_per_session"]
