"""decode_worker.fp8 (FP8Linear, quantize_model, the W8A8 reference arithmetic).

CPU tests run `w8a8_reference`; the Triton kernel (baton/kernels/gemv.py) is tested in tests/engine/test_gemv.py.
"""

import copy
import json

import pytest
import torch
from helpers import rows_with_logits
from torch import nn

from baton.config import ModelConfig
from baton.engine.runner import ModelRunner
from baton.models.qwen3_5 import Qwen3_5ForCausalLM
from decode_worker.fp8 import FP8_DTYPE, FP8Linear, quantize_model, quantize_rows, w8a8_reference


def small_model(tie: bool = False, dtype=torch.float32) -> Qwen3_5ForCausalLM:
    import transformers

    hf = transformers.Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(ModelConfig.from_dict(hf.to_dict())).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms / gates so every path carries signal
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- quantisation and the CPU forward -------------------------------------------------------------
def test_quantize_rows_round_trip_and_zero_row():
    torch.manual_seed(1)
    w = torch.randn(96, 200) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different scales
    w[5] = 0
    q, s = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (96,)
    assert s[5] == 1.0 and (q[5].float() == 0).all()
    deq = q.float() * s[:, None]
    assert rel_err(deq, w) < 3e-2
    # every non-zero row uses the full e4m3 range: its amax maps to 448
    nz = torch.arange(96) != 5
    assert torch.allclose(q.float().abs().amax(1)[nz], torch.full((95,), 448.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8linear_close_to_linear(dtype):
    torch.manual_seed(2)
    lin = nn.Linear(256, 160, bias=False).to(dtype)
    fp8 = FP8Linear.from_linear(lin)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.scale.shape == (160,)
    x = torch.randn(16, 256, dtype=dtype)
    y = fp8(x)
    assert y.dtype == dtype and y.shape == (16, 160)
    # W8A8: weights and activations both e4m3 (3 mantissa bits), ~2.5% rms error each on gaussian data
    assert rel_err(y, lin(x)) < 5e-2
    assert rel_err(fp8(x[3:5]), lin(x[3:5])) < 5e-2  # any M, including M < 16
    exact = x.float() @ fp8.dequantized().T  # the weight error alone is smaller
    assert rel_err(y, exact) < rel_err(y, lin(x))


def test_w8a8_reference_arithmetic():
    """Activation groups of 128 columns get their own scale: a group of huge values does not flatten
    the others (per-row scaling would), and K not a multiple of 128 is padded, not dropped."""
    torch.manual_seed(1)
    w = torch.randn(64, 300) * 0.02
    q, s = quantize_rows(w)
    x = torch.randn(4, 300)
    x[:, :128] *= 1000.0  # group 0: amax ~ 3e3
    y = w8a8_reference(x, q, s)
    deq = q.float() * s[:, None]
    for g0, g1 in ((128, 256), (256, 300)):  # the small groups alone stay accurate
        part = w8a8_reference(torch.cat([torch.zeros(4, g0), x[:, g0:g1], torch.zeros(4, 300 - g1)], 1), q, s)
        assert rel_err(part, x[:, g0:g1] @ deq[:, g0:g1].T) < 5e-2
    assert rel_err(y, x @ deq.T) < 5e-2 and y.shape == (4, 64) and y.dtype == torch.float32
    assert torch.equal(w8a8_reference(torch.zeros(2, 300), q, s), torch.zeros(2, 64))


def test_dtype_casts_leave_fp8_weights_alone():
    model = small_model()
    quantize_model(model, "full")
    model.to(torch.bfloat16)
    fp8 = model.model.layers[0].mlp.gate_proj
    assert fp8.weight.dtype == FP8_DTYPE and fp8.scale.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16 and model.fp8_head.weight.dtype == FP8_DTYPE
    assert fp8(torch.randn(2, fp8.in_features, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_fp8linear_rejects_bias():
    with pytest.raises(ValueError, match="bias"):
        FP8Linear.from_linear(nn.Linear(8, 8, bias=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_forward_deterministic_and_row_invariant(dtype):
    torch.manual_seed(3)
    fp8 = FP8Linear.from_linear(nn.Linear(512, 384, bias=False))
    x = torch.randn(16, 512, dtype=dtype)
    assert torch.equal(fp8(x), fp8(x))
    lone = torch.zeros_like(x)
    lone[0] = x[0]
    assert torch.equal(fp8(lone)[0], fp8(x)[0])  # row 0 ignores the other rows' values


# ---- quantize_model --------------------------------------------------------------------------------
def _linear_names(model):
    return {n for n, m in model.named_modules() if type(m) is nn.Linear}


def test_quantize_model_full():
    model = small_model()
    before = _linear_names(model)
    stats = quantize_model(model, "full")
    cfg = model.cfg
    n_gdn, n_attn = len(cfg.gdn_layers), len(cfg.attn_layers)
    assert stats["replaced"] == n_gdn * 5 + n_attn * 4 + cfg.num_hidden_layers * 3
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert isinstance(getattr(layer.mlp, name), FP8Linear)
        if i in cfg.gdn_layers:
            gdn = layer.linear_attn
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                assert isinstance(getattr(gdn, name), FP8Linear)
        else:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                assert isinstance(getattr(layer.self_attn, name), FP8Linear)
    assert isinstance(model.fp8_head, FP8Linear) and type(model.lm_head) is nn.Linear  # BF16 head kept
    left = _linear_names(model)
    assert left == {"lm_head"} and "lm_head" in before
    # fp32 model: 4 bytes -> 1 byte + 4 bytes per row
    assert stats["bytes_after"] < stats["bytes_before"] / 3
    assert stats["head_bytes_after"] < stats["head_bytes_before"] / 3
    json.dumps(stats)


def test_quantize_model_tail_touches_only_last_mlp_and_head():
    model = small_model()
    stats = quantize_model(model, "tail")
    layers = model.model.layers
    last = len(layers) - 1
    assert stats["modules"] == [f"model.layers.{last}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
    for i, layer in enumerate(layers):
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        assert all(type(m) is not FP8Linear for m in mixer.modules())
        if i != last:
            assert all(type(m) is not FP8Linear for m in layer.mlp.modules())
    assert all(isinstance(getattr(layers[last].mlp, n), FP8Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    assert isinstance(model.fp8_head, FP8Linear)


def test_quantize_model_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        quantize_model(small_model(), "half")


def test_tied_head_quantized_from_embedding():
    model = small_model(tie=True)
    assert not hasattr(model, "lm_head")
    quantize_model(model, "tail")
    h = torch.randn(16, model.cfg.hidden_size)
    ref = h @ model.model.embed_tokens.weight.T
    assert model.model.embed_tokens.weight.dtype == torch.float32  # embedding untouched
    assert rel_err(model.fp8_head(h), ref) < 5e-2  # W8A8


def test_tail_mode_keeps_the_recurrent_trajectory_bitwise():
    """State-safe tail: prefill + rows leave GDN conv/recurrent state and KV bitwise equal to BF16."""
    ref = small_model()
    tail = copy.deepcopy(ref)
    quantize_model(tail, "tail")
    runs = []
    for model in (ref, tail):
        r = ModelRunner(model, max_len=64, width=16)
        r.prefill(0, [3, 17, 42, 5, 99, 7, 1])
        r.rows(0, [11, 12, 13])
        runs.append(r)
    a, b = (dict(r.state.items_all()) for r in runs)
    for name in a:
        if name.startswith("hidden"):
            assert not torch.equal(a[name], b[name])  # the last MLP is FP8: the hidden row moves
        else:
            assert torch.equal(a[name], b[name]), name


def _rows_logits(model, first: list[int], prompt=(3, 17, 42, 5, 99, 7, 1)):
    r = ModelRunner(model, max_len=64, width=16)
    r.prefill(0, list(prompt))
    return rows_with_logits(r, 0, r.pad_ids(first), len(first))[1]  # [W, vocab]


def test_full_mode_rows_stay_row_invariant():
    """FP8 everywhere still honours the fixed-width contract: row 0 of an n=1 step and of an n=3
    block are bitwise equal, and the model still tracks its BF16 source closely."""
    model = small_model()
    ref_logits = _rows_logits(model, [11])
    quantize_model(model, "full")
    a, b = _rows_logits(model, [11]), _rows_logits(model, [11, 12, 13])
    assert torch.equal(a[0], b[0])
    assert rel_err(a[0], ref_logits[0]) < 0.1  # BF16 head here (logits() is not wired to fp8_head)


# ---- GPU (run on the device with `python -m pytest -m gpu`; the kernel itself: tests/engine/test_gemv.py) ----
@pytest.mark.gpu
def test_gpu_quantized_model_matches_fallback():
    model = small_model(dtype=torch.bfloat16).cuda()
    quantize_model(model, "full")
    kernel = _rows_logits(model, [11, 12, 13])
    FP8Linear.use_kernel = False
    try:
        fallback = _rows_logits(model, [11, 12, 13])
    finally:
        FP8Linear.use_kernel = True
    assert (
        rel_err(kernel[:3], fallback[:3]) < 5e-2
    )  # W8A8 both; per GEMM ~2e-3 apart (tests/engine/test_gemv.py), compounded
    assert torch.equal(kernel[0], _rows_logits(model, [11])[0])


@pytest.mark.gpu
def test_gpu_w8a8_handoff_is_bitwise_the_plain_fused_step():
    """FastRows.w8a8 (split-K partials summed by the norm, x quantised by the norm) changes no bit of the
    FP8 rows step: logits of an AR row and of a 3-row block equal the plain fused sequence's."""
    from baton.engine.fast_rows import FastRows

    model = small_model(dtype=torch.bfloat16).cuda()
    quantize_model(model, "full")
    fr = FastRows.for_model(model, 64)
    assert fr.w8a8 is FP8Linear
    fused = [_rows_logits(model, [11]), _rows_logits(model, [11, 12, 13])]
    fr.w8a8 = None
    try:
        plain = [_rows_logits(model, [11]), _rows_logits(model, [11, 12, 13])]
    finally:
        fr.w8a8 = FP8Linear
    assert torch.equal(fused[0][0], plain[0][0])
    assert torch.equal(fused[1][:3], plain[1][:3])
    assert torch.equal(fused[0][0], fused[1][0])  # row invariance holds through it
