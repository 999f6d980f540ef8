"""benchmarks/fla_config_bits.py's sweep (the fla kernels themselves need CUDA): under Triton's interpreter, in a
child process, an autotuned kernel whose configs tile a float32 reduction differently gives other bits per
config ("varies"), one whose configs only tile independent elements does not, a kernel never called is left out,
every autotuner gets its configs and cached choice back, and a timed run's ms is kept beside each config's
result without counting as a result; each kernel's pick (for Baton's pins) is its fastest config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    import interp_shim  # noqa: F401  (numpy >= 2.4 under the interpreter)
    import torch, triton, triton.language as tl
    from benchmarks.fla_config_bits import _digest, sweep

    CONFIGS = [triton.Config({"BLOCK": b}) for b in (16, 64, 256)]

    @triton.autotune(configs=list(CONFIGS), key=["N"])
    @triton.jit
    def total(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):  # a sum: its order is the tiling's
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(0, N, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < N, other=0.0)
        tl.store(out_ptr, tl.sum(acc, axis=0))

    @triton.autotune(configs=list(CONFIGS), key=["N"])
    @triton.jit
    def scale(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):  # each element alone
        for i in tl.static_range(0, N, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) * 3.0, mask=offs < N)

    @triton.autotune(configs=list(CONFIGS), key=["N"])
    @triton.jit
    def unused(x_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
        pass

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1000
    def run():
        a, b = torch.zeros(1), torch.zeros(4096)
        total[(1,)](x, a, 4096)
        scale[(1,)](x, b, 4096)
        return {"total": _digest(a), "scale": _digest(b)}

    KEY = (4096, "torch.float32", "torch.float32")  # triton's key: N, then each tensor argument's dtype
    for k in (total, scale):  # "tuned": a cached choice, as a first call leaves it (the middle config)
        k.cache[KEY] = CONFIGS[1]
    tuners = [("total", total), ("scale", scale), ("unused", unused)]
    timings = iter([3.0, 1.0, 2.0, 2.0, 2.0, 1.0])
    out = sweep(tuners, run, timed=lambda: next(timings))  # each config's ms follows its run
    restored = all(k.configs == CONFIGS and k.cache == {KEY: CONFIGS[1]} for k in (total, scale))
    print(json.dumps({"kernels": out, "restored": restored}))
    """
)


def test_a_config_that_tiles_a_reduction_otherwise_shows_as_varying():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    got = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT
    )
    assert got.returncode == 0, got.stderr[-3000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    by = {k["kernel"]: k for k in res["kernels"]}
    assert set(by) == {"total", "scale"}  # "unused" had no cached choice
    assert res["restored"]
    for k in by.values():
        assert k["configs"] == 3 and k["valid"] == 3 and k["tuned"] == ["{'BLOCK': 64} w4 s3"], k
    # holding `total` to each config changes the sum's bits; `scale`'s elements are each computed alone
    assert by["total"]["varies"] and by["total"]["distinct"] >= 2
    assert not by["scale"]["varies"] and by["scale"]["distinct"] == 1
    assert [r["ms"] for k in ("total", "scale") for r in by[k]["runs"]] == [3.0, 1.0, 2.0, 2.0, 2.0, 1.0]
    # the pin each kernel would get: its fastest config on the timed pass, in fla's file format
    assert by["total"]["kernel_name"] == "total" and by["scale"]["kernel_name"] == "scale"
    entry = {"num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    assert by["total"]["pick"] == {"kwargs": {"BLOCK": 64}, **entry}
    assert by["scale"]["pick"] == {"kwargs": {"BLOCK": 256}, **entry}
    scales = {r["scale"] for r in by["total"]["runs"]} | {r["scale"] for r in by["scale"]["runs"]}
    assert len(scales) == 1


def test_autotuners_are_found_under_the_heuristics_fla_stacks_on_them():
    """fla decorates its kernels `@triton.heuristics` over `@fla_cache_autotune`: the module attribute is the
    Heuristics and the autotuner is its `.fn`. The H100 run of 2026-12-07 listed no kernel before this."""
    import types

    import triton
    import triton.language as tl

    from benchmarks.fla_config_bits import _autotuners

    def kernel(x_ptr, BLOCK: tl.constexpr):
        pass

    tuned = triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=[])(triton.jit(kernel))
    mod = types.ModuleType("fla.fake_kernels")
    mod.wrapped = triton.heuristics({"BLOCK": lambda args: 16})(tuned)
    mod.plain = triton.jit(kernel)  # no autotuner: not listed
    sys.modules[mod.__name__] = mod
    try:
        found = {name: at for name, at in _autotuners() if name.startswith("fla.fake_kernels.")}
    finally:
        del sys.modules[mod.__name__]
    assert list(found) == ["fla.fake_kernels.wrapped"] and found["fla.fake_kernels.wrapped"] is tuned
