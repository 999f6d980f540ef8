"""The fused CUDA rows kernels, checked on CPU through Triton's interpreter (fp32): same logits and state
as the eager rows path (main model and MTP head), and row invariance (a K-row block equals K single-row steps, bitwise)."""

from __future__ import annotations

import pytest
from helpers import interp_job, run_interp_script

pytest.importorskip("triton")
# the interpreted run starts in the background at collection (tests/prestart.py)
PRESTART = {"test_fused_rows_kernels_match_eager_and_are_row_invariant": lambda: interp_job("fast_rows_interp.py")}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_fused_rows_kernels_match_eager_and_are_row_invariant():
    res = run_interp_script("fast_rows_interp.py", timeout=280)
    assert res.pop("compiles_sm90") is True  # every launch also compiles for the H200 (tests/launch_record.py)
    for name, r in res.items():
        if name == "ckpt":  # per-row checkpoints: rewinding == recomputing, bitwise
            assert r["state_equal"], r
            continue
        if name == "paged":  # scattered KV pages == pages in order, bitwise (logits, AR rows, KV)
            assert r["equal"] and r["pages"] == [1, 3], r
            continue
        assert r["tokens_equal"], (name, r)
        assert r["logits_max_diff"] < 1e-4, (name, r)
        assert max(r["state_max_diff"].values()) < 1e-4, (name, r)
        if name == "mtp":  # the MTP head's rows pass: out rows and MTP KV
            continue
        assert r["position"][0] == r["position"][1], (name, r)
        assert r["row_invariant"] and r["rec_state_equal_after_ar"], (name, r)
    assert set(res) == {"short", "long", "ckpt", "mtp", "paged"}
