"""baton.checkpoint: loading tiny HF checkpoints into modules with HF state_dict names."""

import json

import pytest
import torch
from helpers import make_tiny_dir
from safetensors.torch import load_file, save_file
from torch import nn

from baton.checkpoint import (
    CheckpointError,
    MissingFileError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    checkpoint_files,
    checkpoint_tensor_table,
    dequant_fp8_blocks,
    load_into,
)
from baton.config import ConfigError, ModelConfig

tf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def hf_model(d, **overrides):
    """A freshly initialised transformers Qwen3_5ForCausalLM (fp32) for the checkpoint in `d`."""
    text = dict(ModelConfig.from_hf(d).hf_text_config, **overrides)
    cfg = tf.Qwen3_5TextConfig.from_dict(text)
    return tf.Qwen3_5ForCausalLM(cfg).eval()


class Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))


class MTPStub(nn.Module):
    """Just the mtp.* parameter names of Baton's MTP head."""

    def __init__(self, hf_cfg):
        super().__init__()
        h = hf_cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = Norm(h), Norm(h), Norm(h)
        self.layers = nn.ModuleList([tf.Qwen3_5DecoderLayer(hf_cfg, hf_cfg.layer_types.index("full_attention"))])


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """Reference tensors of the default tiny checkpoint (what every layout must reproduce)."""
    d = make_tiny_dir(tmp_path_factory.mktemp("ref"))
    return load_file(str(d / "model.safetensors")), load_file(str(d / "mtp.safetensors"))


def rewrite(path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", [{}, {"shards": 2}, {"multimodal": True}, {"multimodal": True, "shards": 2}])
def test_load_into_reproduces_checkpoint(tmp_path, ref, layout):
    d = make_tiny_dir(tmp_path, **layout)
    model = hf_model(d)
    sd = model.state_dict()
    assert not torch.equal(sd["model.layers.0.linear_attn.A_log"], ref[0]["model.layers.0.linear_attn.A_log"])
    rep = load_into(model, d, dtype=torch.float32, device="cpu")
    assert set(sd) == set(ref[0])
    for name, t in sd.items():
        assert torch.equal(t, ref[0][name]), name
    assert rep.tensors == len(sd) and rep.bytes == sum(t.numel() * 4 for t in sd.values())
    assert not rep.mtp_loaded and rep.skipped == len(ref[1]) + (1 if layout.get("multimodal") else 0)
    assert [p.name for p in rep.files] == [p.name for p in checkpoint_files(d)]


def test_load_casts_into_bf16_module(tmp_path, ref):
    d = make_tiny_dir(tmp_path)
    model = hf_model(d).to(torch.bfloat16)
    load_into(model, d, dtype=torch.bfloat16, device="cpu")
    assert torch.equal(model.lm_head.weight, ref[0]["lm_head.weight"].to(torch.bfloat16))
    with pytest.raises(CheckpointError, match="dtype"):
        load_into(model, d, dtype=torch.float16)


def test_tied_embeddings(tmp_path):
    d = make_tiny_dir(tmp_path, tie=True)
    embed = load_file(str(d / "model.safetensors"))["model.embed_tokens.weight"]
    tied = hf_model(d)  # lm_head.weight is model.embed_tokens.weight
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    rep = load_into(tied, d)
    assert torch.equal(tied.lm_head.weight, embed) and rep.tensors == len(dict(tied.named_parameters()))
    untied = hf_model(d, tie_word_embeddings=False)  # a module with its own lm_head: copied from embed
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    load_into(untied, d)
    assert torch.equal(untied.lm_head.weight, embed)


@pytest.mark.parametrize("layout", [{}, {"mtp_inline": True, "shards": 2}, {"mtp_inline": True, "multimodal": True}])
def test_mtp_tensors_load_from_sidecar_main_file_or_index(tmp_path, ref, layout):
    d = make_tiny_dir(tmp_path, **layout)
    model = hf_model(d)
    model.mtp = MTPStub(model.config)
    rep = load_into(model, d)
    assert rep.mtp_loaded
    sd = model.state_dict()
    assert sorted(k for k in sd if k.startswith("mtp.")) == sorted(ref[1])
    for name, t in ref[1].items():
        assert torch.equal(sd[name], t), name


def test_mtp_module_without_mtp_weights_names_them(tmp_path):
    d = make_tiny_dir(tmp_path, mtp=False)
    model = hf_model(d)
    model.mtp = MTPStub(model.config)
    with pytest.raises(MissingTensorError, match=r"mtp\.fc\.weight.*no mtp"):
        load_into(model, d)
    rep = load_into(model, d, strict=False)
    assert "mtp.fc.weight" in rep.missing and not rep.mtp_loaded


def test_mis_shaped_tensor_is_named_and_nothing_is_loaded(tmp_path):
    d = make_tiny_dir(tmp_path)
    name = "model.layers.0.linear_attn.conv1d.weight"  # HF keeps [conv_dim, 1, kernel]
    rewrite(d / "model.safetensors", lambda t: t.update({name: t[name][:, 0, :].contiguous()}))
    model = hf_model(d)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ShapeMismatchError) as e:
        load_into(model, d)
    assert name in str(e.value) and "(128, 1, 4)" in str(e.value) and "(128, 4)" in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    d = make_tiny_dir(tmp_path)
    rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.3.self_attn.k_norm.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.3\.self_attn\.k_norm\.weight"):
        load_into(hf_model(d), d)
    d2 = make_tiny_dir(tmp_path)
    rewrite(d2 / "model.safetensors", lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.0\.extra\.weight"):
        load_into(hf_model(d2), d2)
    rep = load_into(hf_model(d2), d2, strict=False)
    assert rep.unexpected == ("model.layers.0.extra.weight",)


def test_missing_files_are_named(tmp_path):
    d = make_tiny_dir(tmp_path, shards=2)
    model = hf_model(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MissingFileError, match="model-00002-of-00002.safetensors"):
        load_into(model, d)
    d2 = make_tiny_dir(tmp_path)
    (d2 / "model.safetensors").unlink()
    with pytest.raises(MissingFileError, match=r"no \*\.safetensors"):
        load_into(model, d2)
    (d2 / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_into(model, d2)


def test_wrong_model_type_raises_config_error(tmp_path):
    d = make_tiny_dir(tmp_path)
    model = hf_model(d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(raw, model_type="llama")))
    with pytest.raises(ConfigError, match=r"'llama'.*qwen3_5_text"):
        load_into(model, d)


def test_tensor_table_maps_names(tmp_path):
    plain = checkpoint_tensor_table(make_tiny_dir(tmp_path))
    mm = checkpoint_tensor_table(make_tiny_dir(tmp_path, multimodal=True, shards=2))
    assert mm == plain
    assert plain["model.layers.0.linear_attn.conv1d.weight"] == ((128, 1, 4), "float32")
    assert plain["mtp.fc.weight"] == ((64, 128), "float32")


def test_dequant_fp8_blocks_by_hand():
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])
    want = torch.tensor([[1.0, 2.0, 30.0], [4.0, 5.0, 60.0], [700.0, 800.0, 9000.0]])
    assert torch.equal(dequant_fp8_blocks(w, s, block=2), want)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 260, generator=g).to(torch.float8_e4m3fn)  # ragged last blocks
    s = torch.rand(2, 3, generator=g)
    rows, cols = torch.arange(130) // 128, torch.arange(260) // 128
    assert torch.equal(dequant_fp8_blocks(w, s), w.float() * s[rows][:, cols])
    with pytest.raises(ShapeMismatchError, match=r"\(2, 3\)"):
        dequant_fp8_blocks(w, s[:1])


def test_fp8_weight_is_dequantised_at_load(tmp_path):
    d = make_tiny_dir(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 192] -> scales [1, 2]
    g = torch.Generator().manual_seed(1)
    fp8 = torch.randn(64, 192, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(1, 2, generator=g) + 0.5
    rewrite(d / "model.safetensors", lambda t: t.update({name: fp8, name + "_scale_inv": scale}))
    assert checkpoint_tensor_table(d)[name] == ((64, 192), "float8_e4m3fn")
    assert name + "_scale_inv" not in checkpoint_tensor_table(d)
    model = hf_model(d)
    load_into(model, d)
    want = torch.cat([fp8[:, :128].float() * scale[0, 0], fp8[:, 128:].float() * scale[0, 1]], 1)
    assert torch.equal(model.state_dict()[name], want)


def test_the_9b_random_shape_has_the_released_models_window():
    """`--random-init qwen3.5-9b` serves the released model's 262,144-token window on any transformers version
    (5.x's default config says 32,768, which refused ctx-max's long prompt and prefix-cache's 32K turn)."""
    from baton.random_init import shape

    cfg = shape("qwen3.5-9b")
    assert cfg.max_position_embeddings == 262_144
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (32, 4096)
