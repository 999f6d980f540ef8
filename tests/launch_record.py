"""Test-only: every kernel launch an interpreted run makes is recorded, then compiled for the H200 (sm_90)
in a plain process (tests/launch_compile.py). Triton's interpreter runs the kernels as Python and accepts
code its compiler refuses (a reassigned constexpr cost a GPU call on 2026-12-02): each interpreted script
(tests/*_interp.py) ends with `compile_verdict()`, one more key of its JSON verdict.

    import tests.launch_record as rec   # after tests.interp_shim; patches InterpretedFunction.run
    out["compiles_sm90"] = rec.compile_verdict()

A launch is recorded as its kernel (module, name), each argument's kind (a tensor's dtype, a number, a
Triton dtype, None, a tensor descriptor) and the launch options (num_warps, num_stages); two launches that would compile to the
same binary are one record. The interpreted run models fp32 (bf16 runs on the H200), so the dtypes compiled
are the test's; what is checked is that the kernel's code compiles at all, for every path the test takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton.language as tl
import triton.runtime.interpreter as _interp
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ("num_warps", "num_stages", "num_ctas")
_records: dict[str, dict] = {}


def _kind(v):
    if isinstance(v, TensorDescriptor):  # its signature type, e.g. "tensordesc<fp32[128, 64]>"
        return ["desc", mangle_type(v)]
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype).removeprefix("torch.")]
    if isinstance(v, bool):
        return ["bool", v]
    if isinstance(v, int):
        return ["int", v]
    if isinstance(v, float):
        return ["float", v]
    if isinstance(v, tl.dtype):
        return ["dtype", str(v)]
    if v is None:
        return ["none", None]
    if isinstance(v, str):
        return ["str", v]
    return None


def _record(fn, arg_names, args, kwargs) -> None:
    values = dict(zip(arg_names, args)) | {k: v for k, v in kwargs.items() if k in arg_names}
    kinds = {k: _kind(v) for k, v in values.items()}
    if any(k is None for k in kinds.values()):
        return  # an argument this recorder cannot describe: that launch is not compiled
    rec = {
        "module": fn.__module__,
        "name": fn.__name__,
        "args": kinds,
        "options": {k: kwargs[k] for k in OPTIONS if k in kwargs},
    }
    _records.setdefault(json.dumps(rec, sort_keys=True), rec)


_orig_run = _interp.InterpretedFunction.run


def _run(self, *args, grid, warmup, **kwargs):
    _record(self.fn, self.arg_names, args, kwargs)
    return _orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)


_interp.InterpretedFunction.run = _run


def compile_verdict(timeout: float = 600.0) -> bool:
    """Compiles every recorded launch for sm_90 in a process without the interpreter -> all compiled (True
    also where this Triton has no NVIDIA backend: nothing to check there; said on stderr)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(list(_records.values()), f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    try:
        p = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "launch_compile.py"), f.name],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    finally:
        os.unlink(f.name)
    sys.stderr.write(p.stdout + p.stderr)
    return p.returncode == 0
