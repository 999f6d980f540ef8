"""The fused step's per-slot kernels (baton/kernels/gdn.py conv_rows / gdn_rows, baton/kernels/attention.py
qk_rope_kv / attention_rows, baton/kernels/rows.py ar_commit) batched over several sessions' slots, under
Triton's interpreter on CPU: each live group bitwise equal to the one-slot call alone (its outputs and
its slot's state), padding groups write nothing and give zero rows, other slots untouched; the attention
kernels read KV through shuffled page tables, bitwise equal to the contiguous-window kernels they replaced. AR batches of
1, 4 and 8 rows (with padding) and a batch of 3-row blocks; positions differ per group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_batched_kernels_equal_each_slot_alone():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "batch_kernels_interp.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(res) == 9, res
    bad = {k: v for k, v in res.items() if not all(v.values())}  # attn: also paged == contiguous
    assert all("paged_equals_contiguous" in res[k] for k in res if k.startswith("attn_")), res
    assert not bad, bad
