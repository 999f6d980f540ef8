"""baton/kernels/pick.py compiles for the H200 (sm_90), on the CPU: Triton's interpreter runs Python code and
accepts what the compiler refuses (a reassigned constexpr did it once, and cost a GPU call). Each kernel the
pick launches, as it launches them, goes through Triton's compiler to a cubin with the ptxas of the Triton
wheel; no GPU is needed."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def _compile(fn, sig: dict, consts: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {k: ("constexpr" if k in consts else sig[k]) for k in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 8})  # fmt: skip


@pytest.mark.parametrize("src", ["*bf16", "*fp32"])  # the logits, or the penalized x
def test_every_pick_kernel_compiles_for_sm90(src, tmp_path, monkeypatch):
    from baton.kernels import pick as pk

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold compile, not a cached one
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    row = {"src_ptr": src, "stride": "i32", "slot_ptr": "*i64", "pos_ptr": "*i64", "t_ptr": "*fp32"}
    seeds = {"shi_ptr": "*i64", "slo_ptr": "*i64"}
    parts = {"stat_ptr": "*fp32", "stati_ptr": "*i32", "chk_ptr": "*fp32", "chki_ptr": "*i32"}
    sizes = {"V": "i32", "M": "i32", "P": "i32"}
    P = triton.cdiv(248320, pk.CHUNK)
    cx = {"CHUNK": pk.CHUNK, "BLOCK": pk.BLOCK, "PB": triton.next_power_of_2(P)}
    radix = {**row, "topk_ptr": "*i64", **seeds, "hist_ptr": "*i32", **sizes}
    stats = {**radix, **parts}
    check = {**row, "topp_ptr": "*fp32", "lminp_ptr": "*fp32", **seeds, **parts, "out_ptr": "*i64", **sizes}
    built = []
    for d in (0, 7):
        built.append(_compile(pk._radix_kernel, radix, {**cx, "D": d, "RBLOCK": pk.RBLOCK}))
    built.append(_compile(pk._stats_kernel, stats, cx))
    for lvl in range(pk.CHECKS):
        built.append(_compile(pk._check_kernel, check, {**cx, "L": lvl}))
    built.append(_compile(pk._final_kernel, check, {**cx, "L": pk.CHECKS}))
    assert all(b.asm.get("cubin") for b in built)
