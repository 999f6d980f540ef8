"""baton.random_checkpoint (make-tiny) and baton.tokenizer."""

import json
import random

import pytest
import torch
from helpers import make_tiny_dir
from safetensors import safe_open
from safetensors.torch import load_file

from baton.config import ModelConfig
from baton.random_checkpoint import _layer_types, main
from baton.tokenizer import Tokenizer, TokenizerError


def _keys(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_transformers_loads_make_tiny_with_no_missing_keys(tmp_path):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    d = make_tiny_dir(tmp_path)
    model, info = Qwen3_5ForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([Tokenizer.from_dir(d).encode("def main(argv=None):\n    return 0\n")])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert logits.std() > 1.0  # not a near-uniform distribution
    norms = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight") or n.endswith("norm.weight")]
    assert all(p.abs().sum() > 0 for p in norms)  # HF init zeroes them; make-tiny perturbs them


def test_config_layout_and_mtp_sidecar(tmp_path):
    d = make_tiny_dir(tmp_path)
    cfg = ModelConfig.from_hf(d)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.mtp_num_hidden_layers == 1 and cfg.hidden_size == 64 and not cfg.tie_word_embeddings
    tok = Tokenizer.from_dir(d)
    assert cfg.eos_token_ids == (tok.token_to_id("<|endoftext|>"),)
    assert cfg.vocab_size >= tok.vocab_size == 512
    main_keys, mtp = _keys(d / "model.safetensors"), _keys(d / "mtp.safetensors")
    assert not any(k.startswith("mtp.") for k in main_keys) and "lm_head.weight" in main_keys
    assert mtp["mtp.fc.weight"] == (64, 128)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert mtp[f"mtp.{n}.weight"] == (64,)
    full = {k[len("model.layers.3.") :]: s for k, s in main_keys.items() if k.startswith("model.layers.3.")}
    assert {k[len("mtp.layers.0.") :]: s for k, s in mtp.items() if k.startswith("mtp.layers.0.")} == full
    assert "self_attn.q_norm.weight" in full
    assert all(load_file(str(d / "mtp.safetensors"))[k].abs().sum() > 0 for k in mtp)


def test_layer_types_small_models():
    assert _layer_types(1) == ["full_attention"]
    assert _layer_types(2) == ["linear_attention", "full_attention"]
    assert _layer_types(8).count("full_attention") == 2 and _layer_types(8)[3] == "full_attention"


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    from baton.random_checkpoint import make_random_checkpoint

    a = make_tiny_dir(tmp_path, seed=3, layers=2, hidden=32, vocab=300)
    b = make_random_checkpoint(tmp_path / "again", seed=3, layers=2, hidden=32, vocab=300)
    c = make_random_checkpoint(tmp_path / "other", seed=4, layers=2, hidden=32, vocab=300)
    for f in ("model.safetensors", "mtp.safetensors", "tokenizer.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    ta, tc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])
    assert ModelConfig.from_hf(a).vocab_size == 300 and Tokenizer.from_dir(a).vocab_size <= 300


def test_cli_no_mtp_tie_bf16(tmp_path, capsys):
    out = tmp_path / "cli"
    assert (
        main([str(out), "--seed", "1", "--layers", "2", "--hidden", "32", "--no-mtp", "--tie", "--dtype", "bfloat16"])
        == 0
    )
    assert str(out) in capsys.readouterr().out
    assert not (out / "mtp.safetensors").exists()
    keys = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in keys and keys["model.embed_tokens.weight"].dtype == torch.bfloat16
    cfg = ModelConfig.from_hf(out)
    assert cfg.tie_word_embeddings and cfg.mtp_num_hidden_layers == 0 and cfg.num_hidden_layers == 2


def test_shards_and_multimodal_layout(tmp_path):
    d = make_tiny_dir(tmp_path, shards=2, multimodal=True, mtp_inline=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "model.language_model.embed_tokens.weight" in index and "mtp.fc.weight" in index
    assert "model.visual.blocks.0.x.weight" in index and not (d / "mtp.safetensors").exists()
    raw = json.loads((d / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    assert ModelConfig.from_hf(d).hidden_size == 64


# ---- tokenizer -----------------------------------------------------------------------------------
TEXTS = ["def f(x):\n    return x + 1\n", "café é", "日本語のテキスト", "mixed 日本 and é 😀!", ""]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_dir(tmp_path_factory.mktemp("tok")))


def _stream(tok, ids, skip=False):
    sd = tok.stream(skip_special_tokens=skip)
    deltas = [sd.push(i) for i in ids]
    return deltas, sd.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip_and_stream(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    assert tail == ""  # valid text leaves nothing pending
    assert not any("\ufffd" in d for d in deltas)


def test_stream_holds_partial_utf8_until_the_character_is_complete(tok):
    ids = tok.encode("日本")
    assert len(ids) == 6  # the corpus is ASCII: one token per byte
    deltas, _ = _stream(tok, ids)
    assert deltas == ["", "", "日", "", "", "本"]


@pytest.mark.parametrize("skip", [False, True])
def test_stream_equals_decode_on_random_ids(tok, skip):
    rng = random.Random(0)
    for _ in range(200):  # random ids include invalid / truncated UTF-8 and the special token
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids += [rng.randrange(128, 256) for _ in range(rng.randrange(0, 4))]  # a dangling byte run
        deltas, tail = _stream(tok, ids, skip)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_special_tokens_and_eos(tok):
    eos = tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == (eos,)
    assert tok.encode("a<|endoftext|>") == tok.encode("a") + [eos]  # parsed, never added
    assert tok.decode([eos]) == "<|endoftext|>" and tok.decode([eos], skip_special_tokens=True) == ""


def test_tokenizer_missing_file_is_named(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
