"""baton/kernels/wide.py's prefill causal conv compiles for the H200 (sm_90) at the production dtypes, on
the CPU: the interpreted test (tests/wide_kernels_interp.py) runs fp32 tensors, the prefill runs bf16 inputs
and state. Triton's compiler to a cubin with the Triton wheel's ptxas; no GPU is needed."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def _compile(fn, sig: dict, consts: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {k: ("constexpr" if k in consts else sig[k]) for k in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})  # fmt: skip


@pytest.mark.parametrize("dt", ["*bf16", "*fp16"])
def test_the_prefill_conv_compiles_for_sm90(dt, tmp_path, monkeypatch):
    from baton.kernels import wide

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold compile, not a cached one
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    strides = {"sx": "i32", "s_slot": "i32", "s_c": "i32"}
    conv = {"x_ptr": dt, "st_ptr": dt, "w_ptr": dt, "sw": "i32", "slot_ptr": "*i64", "within_ptr": "*i64"}
    conv |= {"y_ptr": dt, "T": "i32", "C": "i32", **strides}
    state = {"x_ptr": dt, "st_ptr": dt, "seg_ptr": "*i64", "N": "i32", "C": "i32", **strides}
    built = [
        _compile(wide._conv_kernel, conv, {"KW": 4, "BLOCK_T": wide.CONV_T, "BLOCK_C": wide.CONV_C}),
        _compile(wide._conv_state_kernel, state, {"KW": 4, "KP": 4, "BLOCK_C": wide.CONV_C}),
    ]
    assert all(b.asm.get("cubin") for b in built)
