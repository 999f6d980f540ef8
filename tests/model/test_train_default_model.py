"""deploy/train_default_model.py: the tiny default model's trainer (smoke mode on CPU) and its MTP head."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import prestart
import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy"))
import default_model_corpus  # noqa: E402
import train_default_model  # noqa: E402

FILES = ("config.json", "model.safetensors", "mtp.safetensors", "tokenizer.json", "README.md", "train_log.json")


def _table(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def _small_pair(seed=0):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    cfg = train_default_model.model_config(vocab=300, eos_id=0, hidden=64, layers=4, intermediate=96)
    return Qwen3_5ForCausalLM(cfg).eval(), train_default_model.MTPHead(cfg).eval()


def _assert_mtp_causal(model, mtp, T=20, j=11):
    """Changing token j changes step-1 MTP logits at index j-1 (it is x_{t+1} there) and later,
    never before: index t sees h_t and x_{t+1} only, and attends to indices <= t."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, model.config.vocab_size, (1, T + 1), generator=g)
    ids2 = ids.clone()
    ids2[0, j] = (ids[0, j] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = (
            train_default_model.mtp_chain(model, mtp, x, model.model(input_ids=x[:, :T]).last_hidden_state, 1)[0]
            for x in (ids, ids2)
        )
    assert torch.allclose(a[:, : j - 1], b[:, : j - 1], atol=1e-5)
    assert not torch.allclose(a[:, j - 1], b[:, j - 1], atol=1e-4)
    assert not torch.allclose(a[:, -1], b[:, -1], atol=1e-4)  # later rows see it through attention and h


# ---- fast unit tests -------------------------------------------------------------------------------
def test_split_is_a_stable_hash_of_the_path():
    assert [default_model_corpus.split_of(p) for p in ("os.py", "json/decoder.py", "asyncio/tasks.py")] == [
        default_model_corpus.split_of(p) for p in ("os.py", "json/decoder.py", "asyncio/tasks.py")
    ]
    names = [f"pkg/mod{i}.py" for i in range(2000)]
    share = sum(default_model_corpus.split_of(n) == "test" for n in names) / len(names)
    assert 0.03 < share < 0.07
    assert {default_model_corpus.split_of(n) for n in names} == {"train", "val", "test"}


def test_mtp_head_names_and_causality_on_a_random_model():
    model, mtp = _small_pair()
    train_default_model.check_mtp_causal(model, mtp, "cpu")
    _assert_mtp_causal(model, mtp)
    names = set(mtp.state_dict())
    assert {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"} <= names
    full = {k.removeprefix("model.layers.3.") for k in model.state_dict() if k.startswith("model.layers.3.")}
    assert {k.removeprefix("layers.0.") for k in names if k.startswith("layers.0.")} == full
    assert mtp.fc.weight.shape == (64, 128)


def test_mtp_chain_aligns_steps_with_targets():
    model, mtp = _small_pair(1)
    T = 12
    ids = torch.randint(0, 300, (2, T + 1))
    with torch.no_grad():
        h = model.model(input_ids=ids[:, :T]).last_hidden_state
        chain = train_default_model.mtp_chain(model, mtp, ids, h, 3)
        total, main, ce = train_default_model.losses(model, mtp, ids, 2, 0.3)
    assert [c.shape for c in chain] == [(2, T - k, 300) for k in (1, 2, 3)]
    assert len(ce) == 2 and torch.isclose(total, main + 0.3 * ce[0] + 0.15 * ce[1])


def test_mtp_gradient_reaches_only_the_mtp_head():
    model, mtp = _small_pair(2)
    ids = torch.randint(0, 300, (2, 17))
    _, _, ce = train_default_model.losses(model, mtp, ids, 2, 0.3)
    sum(ce).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in mtp.parameters())


def test_gdn_kernel_preflight_passes_on_the_torch_path():
    assert train_default_model.preflight_gdn_kernel(torch.device("cpu")) < 0.05


# ---- the smoke run (CPU) ---------------------------------------------------------------------------
def _smoke_job():
    out = prestart.workdir("train-smoke") / "out"
    argv = [sys.executable, str(ROOT / "deploy" / "train_default_model.py"), "--smoke", "--out", str(out)]
    return prestart.Job("train-smoke", argv, cwd=str(ROOT), env=dict(os.environ))


# the smoke training starts in the background at collection (tests/prestart.py)
PRESTART = {"smoke_dir": _smoke_job}


@pytest.fixture(scope="module")
def smoke_dir():
    job = _smoke_job()
    proc = prestart.run(job, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Path(job.argv[-1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_writes_a_loadable_checkpoint(smoke_dir):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    from baton.config import ModelConfig

    for name in FILES:
        assert (smoke_dir / name).is_file(), name
    model, info = Qwen3_5ForCausalLM.from_pretrained(str(smoke_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    raw = json.loads((smoke_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and raw["mtp_num_hidden_layers"] == 1 and raw["tie_word_embeddings"]
    cfg = ModelConfig.from_hf(smoke_dir)
    assert cfg.attn_layers == (3, 7) and len(cfg.gdn_layers) == 6

    main, mtp = _table(smoke_dir / "model.safetensors"), _table(smoke_dir / "mtp.safetensors")
    assert all(k.startswith("model.") for k in main) and "lm_head.weight" not in main
    assert {dt for _, dt in main.values()} == {dt for _, dt in mtp.values()} == {"BF16"}
    H = cfg.hidden_size
    layer = {k.removeprefix("model.layers.3."): v for k, v in main.items() if k.startswith("model.layers.3.")}
    expected = {"mtp.fc.weight": ((H, 2 * H), "BF16")}
    expected |= {f"mtp.{n}.weight": ((H,), "BF16") for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    expected |= {f"mtp.layers.0.{k}": v for k, v in layer.items()}
    assert mtp == expected
    assert "mtp.layers.0.self_attn.q_norm.weight" in mtp and "mtp.layers.0.mlp.down_proj.weight" in mtp
    size = sum((smoke_dir / n).stat().st_size for n in ("model.safetensors", "mtp.safetensors"))
    assert size <= 16_000_000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_tokenizer_card_and_log(smoke_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smoke_dir / "tokenizer.json"))
    assert 4096 <= tok.get_vocab_size() <= 8192
    eos = tok.token_to_id("<|endoftext|>")
    assert json.loads((smoke_dir / "config.json").read_text())["eos_token_id"] == eos
    src = "def f(x):\n    return {'a': x ** 2}  # é\n"
    assert tok.decode(tok.encode(src).ids) == src

    log = json.loads((smoke_dir / "train_log.json").read_text())
    for key in ("next_token_loss", "perplexity", "next_token_top1", "mtp_top1"):
        assert log["heldout"][key] > 0
    assert log["train"]["tokens_seen"] > 0 and log["acceptance_estimate"]["K"] == 3
    card = (smoke_dir / "README.md").read_text()
    assert "Python Software Foundation License" in card and "perplexity" in card
    assert log["python"] in card and "--smoke" in card


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_mtp_head_is_causal_after_loading(smoke_dir):
    model, mtp = train_default_model.load_trained(smoke_dir)
    train_default_model.check_mtp_causal(model, mtp, "cpu")
    _assert_mtp_causal(model, mtp)
