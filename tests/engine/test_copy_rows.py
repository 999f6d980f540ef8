"""baton/kernels/copy_rows.py under Triton's interpreter on the CPU: copy_rows is dst[idx] = src[idx] bit for
bit (fp32, bf16, int64; rows of one element and rows longer than a program's block; duplicate indices),
touches no other row; and the slot copies with it (baton/engine/slot_copies.py, as on CUDA: padded
buckets, chunks) leave a runner's state and snapshot set bitwise as the per-slot snapshot / restore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import interp_shim
from baton.kernels import copy_rows as CR
from baton.engine.runner import ModelRunner
from baton.loading import random_model
from baton.random_init import shape

out = {}
g = torch.Generator().manual_seed(0)
for name, make in {
    "fp32 rows of 2 blocks + 3": lambda: torch.randn(5, 2 * CR.BLOCK_MAX + 3, generator=g),
    "bf16 [S, 3, 7]": lambda: torch.randn(5, 3, 7, generator=g).to(torch.bfloat16),
    "int64 [S]": lambda: torch.randint(0, 1 << 40, (5,), generator=g),
}.items():
    src, dst = make(), make()
    want = dst.clone()
    idx = torch.tensor([3, 0, 3, 4])  # a duplicate, as a padded bucket
    want[[0, 3, 4]] = src[[0, 3, 4]]
    CR.copy_rows(src, dst, idx)
    out[name] = torch.equal(dst.view(torch.uint8) if dst.dtype == torch.bfloat16 else dst,
                            want.view(torch.uint8) if want.dtype == torch.bfloat16 else want)

lm = random_model(shape("tiny"), dtype="fp32", device="cpu", seed=0)
r = ModelRunner(lm.model, slots=6, max_len=64)
for s in range(6):
    r.prefill(s, [1 + s, 2, 3 + s])
st = r.state
copies = st.enable_slot_copies(4)
copies.copy = CR.copy_rows  # what CUDA runs
ok = []
for slots in ([5, 1, 3], [4, 0, 5, 2, 1]):
    for k in st._snap:
        st._snap[k].fill_(3)
    want = {k: v.clone() for k, v in st._snap.items()}
    for s in slots:
        for k, t in st._o1_items():
            want[k][s] = t[s]
    st.snapshot_slots(slots)
    ok.append(all(torch.equal(st._snap[k], want[k]) for k in want))
    before = {k: t.clone() for k, t in st._o1_items()}
    for s in range(6):
        r.rows(s, [7, 8])
    after = {k: t.clone() for k, t in st._o1_items()}
    st.restore_slots(slots)
    ok.append(all(torch.equal(t[s], (before if s in slots else after)[k][s]) for k, t in st._o1_items() for s in range(6)))
out["slot copies"] = ok
print(json.dumps(out))
"""


def test_copy_rows_and_the_slot_copies_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == {
        "fp32 rows of 2 blocks + 3": True,
        "bf16 [S, 3, 7]": True,
        "int64 [S]": True,
        "slot copies": [True, True, True, True],
    }, res


@pytest.mark.parametrize("dtype", ["*fp32", "*bf16", "*i64"])  # the recurrent state, conv / hidden, position
def test_copy_rows_compiles_for_sm90(dtype, tmp_path, monkeypatch):
    """The interpreter accepts what the compiler may refuse: the kernel, at a long row (the 9B recurrent
    state: 524,288 fp32 a slot, BLOCK_MAX a program) and a one-element one (position), goes through Triton's
    compiler to a cubin for sm_90 with the wheel's ptxas, no GPU needed."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    import triton

    from baton.kernels import copy_rows as cr

    sig = {"src_ptr": dtype, "dst_ptr": dtype, "idx_ptr": "*i64", "D": "i32", "BLOCK": "constexpr"}
    for block in (cr.BLOCK_MAX, 1):
        src = ASTSource(fn=cr._copy_rows_kernel, signature=sig, constexprs={"BLOCK": block})
        built = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert built.asm.get("cubin"), block
