"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and newer).

A kernel launched with PDL may start while the kernel before it in the stream is still finishing:
its launch latency and prologue (for the GEMMs: the first weight loads, which depend on no earlier
kernel) overlap that kernel's tail. Inside a CUDA graph the launches become programmatic edges.

    @triton.jit
    def _k(..., PDL: tl.constexpr):
        <loads of constant data only (weights)>
        pdl_enter(PDL)        # waits for every earlier kernel's writes; lets the next kernel launch
        <everything else: loads of activations/state, every store>

NOTE (invariant): a PDL kernel must not read data written by an earlier kernel, nor write anything,
before `pdl_enter`. `launch_kw(device)` gives PDL=False off CUDA, under the interpreter, below sm_90,
and unless BATON_PDL=1; the kernel is then exactly the plain one.
Off by default: it did not pay on the H200 (benchmarks/results/2026-11-30-h200-s4.md: the PDL and L2
prefetch profiles). Opt in with BATON_PDL=1 to measure.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: no PDL
    gdc_launch_dependents = gdc_wait = None

_ON: dict[int, bool] = {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("BATON_PDL", "0") != "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ON:
        _ON[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _ON[idx]


def launch_kw(device: torch.device) -> dict:
    """Extra launch arguments for a kernel with a `PDL` constexpr: {"PDL": bool[, "launch_pdl": True]}."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}
