"""benchmarks/bench_round_ops.py, in a child process (it runs Triton's interpreter, which must not leak into
this one): a batched MTP round's host ops per session stay well under one a slot's O(1) tensor, where the
per-slot snapshot and rewind it replaced took four (select and copy, each way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
