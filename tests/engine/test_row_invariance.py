"""Row invariance (issue 4), CPU: at width W=16, row i of a K+1-row verify block is bitwise equal
(torch.equal on the logits) to the AR step at the same position, for every K in 1..15, in fp32 and
bf16, over 20 random states. The same check runs on the H200 in tests/engine/test_gpu_decode.py."""

from __future__ import annotations

import pytest
import torch
from helpers import rows_with_logits
from transformers import Qwen3_5TextConfig

from baton.config import ModelConfig
from baton.engine.runner import ModelRunner
from baton.loading import random_model

CFG = ModelConfig.from_dict(
    Qwen3_5TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ).to_dict()
)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_verify_rows_equal_ar_steps_bitwise(dtype):
    lm = random_model(CFG, dtype=dtype, device="cpu", seed=3, mtp=False, std=0.1)
    r = ModelRunner(lm.model, max_len=256, width=16)
    g = torch.Generator().manual_seed(0)
    ks = set()
    for trial in range(20):
        n = int(torch.randint(1, 120, (1,), generator=g))
        r.prefill(0, torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist())
        K = 1 + trial % 15 if trial < 15 else int(torch.randint(1, 16, (1,), generator=g))
        ks.add(K)
        toks = torch.randint(0, CFG.vocab_size, (K + 1,), generator=g).tolist()
        r.state.snapshot(0)
        _, verify = rows_with_logits(r, 0, r.pad_ids(toks), K + 1)
        r.state.restore(0)
        for i, t in enumerate(toks):
            _, ar = rows_with_logits(r, 0, r.pad_ids([t]), 1)
            assert torch.equal(ar[0], verify[i]), f"{dtype} trial {trial} K={K} row {i}"
    assert ks == set(range(1, 16))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_accept_prefix_rewinds_to_the_state_of_a_shorter_block(dtype):
    """A K+1-row block cut to its first m+1 rows by the per-row GDN checkpoints leaves the same state
    (conv, recurrent, position, hidden) as running those m+1 rows alone, and as the snapshot path."""
    lm = random_model(CFG, dtype=dtype, device="cpu", seed=4, mtp=False, std=0.1)
    ck = ModelRunner(lm.model, max_len=256, width=16, checkpoints=True)
    ref = ModelRunner(lm.model, max_len=256, width=16)
    g = torch.Generator().manual_seed(1)
    for trial in range(8):
        ids = torch.randint(0, CFG.vocab_size, (int(torch.randint(1, 100, (1,), generator=g)),), generator=g).tolist()
        K = 2 + trial
        blk = torch.randint(0, CFG.vocab_size, (K + 1,), generator=g).tolist()
        m = trial % (K + 1)
        for r in (ck, ref):
            r.prefill(0, ids)
            r.begin_block(0)
            r.rows(0, blk)
            r.accept_prefix(0, len(ids), blk, m)
        short = ModelRunner(lm.model, max_len=256, width=16)
        short.prefill(0, ids)
        short.rows(0, blk[: m + 1])
        for r in (ck, ref):
            for i in CFG.gdn_layers:
                assert torch.equal(r.state.conv[i][0], short.state.conv[i][0]), (trial, m, i)
                assert torch.equal(r.state.recurrent[i][0], short.state.recurrent[i][0]), (trial, m, i)
            assert int(r.state.position[0]) == len(ids) + m + 1
            assert torch.equal(r.state.hidden[0], short.state.hidden[0])
        # and the next step agrees too
        nxt = [int(torch.randint(0, CFG.vocab_size, (1,), generator=g))]
        assert ck.rows(0, nxt) == short.rows(0, nxt)


def test_fused_kernels_compile_one_binary_for_every_row_count():
    """The CUDA rows kernels take the live-row count at run time and never specialise on it: Triton
    compiles an int argument equal to 1 as a constant (and multiples of 16 with an alignment hint), so
    without do_not_specialize an AR step (n = 1) runs another binary than a verify block, with other
    layouts and reduction orders, and row invariance holds only by luck (the interpreter cannot see it)."""
    triton = pytest.importorskip("triton")
    from baton.kernels import attention, gdn, gemv, rows

    kernels = [
        getattr(mod, name)
        for mod in (rows, attention, gdn, gemv)
        for name in dir(mod)  # launched ones, not helpers
        if isinstance(getattr(mod, name), triton.runtime.jit.JITFunction)
        and (name.endswith("_kernel") or name == "_skinny")
    ]
    counted = 0
    for k in kernels:
        for p in k.params:
            if p.name in ("n", "rows", "M"):
                counted += 1
                assert p.do_not_specialize, (k.__name__, p.name)
    assert counted >= 8, counted  # skinny M, rows; norm rows; conv, gdn, gated norm, rope, merge n
