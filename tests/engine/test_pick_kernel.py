"""baton/kernels/pick.py, the sort-free CUDA token pick, under Triton's interpreter: its tokens equal the torch
sampler's (the same cuts: temperature, top-k, top-p, min-p, ties, the candidate loop) and a row's token does
not depend on the batch. (On the H200: tests/engine/test_gpu_batch.py's sampled steps run it at the 9B shape.)"""

from __future__ import annotations

import pytest
from helpers import interp_job, run_interp_script

pytest.importorskip("triton")
PRESTART = {
    "test_pick_kernel_equals_the_torch_sampler_and_is_row_invariant": lambda: interp_job("pick_kernel_interp.py")
}


def test_pick_kernel_equals_the_torch_sampler_and_is_row_invariant():
    verdict = run_interp_script("pick_kernel_interp.py", timeout=240)
    assert verdict == {k: True for k in verdict} and len(verdict) == 17, verdict  # 17th: compiles_sm90
