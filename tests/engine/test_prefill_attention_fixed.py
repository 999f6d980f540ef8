"""baton/kernels/causal_fixed.py (BATON_PREFILL_ATTN=fixed), checked on the CPU through Triton's interpreter: a
prompt's attention cut into pieces at 64-multiples gives the whole call's rows bitwise, and the whole call is
causal attention; every launch also compiles for sm_90. On the GPU: gpu_pending.sh cut-probe with the knob."""

from __future__ import annotations

import pytest
from helpers import interp_job, run_interp_script

pytest.importorskip("triton")
PRESTART = {"test_a_cut_prompt_keeps_the_whole_calls_rows": lambda: interp_job("prefill_attn_interp.py")}


def test_a_cut_prompt_keeps_the_whole_calls_rows():
    res = run_interp_script("prefill_attn_interp.py", timeout=240)
    assert res.pop("compiles_sm90") is True
    assert res["cuts"] == {"64": True, "128": True, "192": True}, res
    assert res["max_err"] < 1e-5 and res["d256_finite"] is True, res


def test_the_knob_is_cuda_only_and_turns_prefill_sdpa_batching_off(monkeypatch):
    from baton.models import prefill_attention as pa

    monkeypatch.setenv(pa.ATTN_ENV, "fixed")
    monkeypatch.setenv(pa.SDPA_BATCH_ENV, "1")
    assert pa.fixed_on(True) and not pa.fixed_on(False)  # the CPU's SDPA is cut-invariant already
    assert not pa.batching_on(cuda=True) and pa.batching_on(cuda=False)
    monkeypatch.setenv(pa.ATTN_ENV, "sdpa")
    assert not pa.fixed_on(True) and pa.batching_on(cuda=True)
