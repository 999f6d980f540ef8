"""Named model shapes for `--random-init` (no checkpoint file needed)."""

from __future__ import annotations

from baton.config import ModelConfig

QWEN35_WINDOW = 262_144  # Qwen3.5's native context (its config.json's max_position_embeddings)


def qwen35_9b() -> ModelConfig:
    """transformers' default Qwen3_5TextConfig: the Qwen3.5-9B text shape, with the released model's window.

    transformers' default max_position_embeddings (32,768 in 5.x) is not the released checkpoint's 262,144;
    the window is pinned here so long-context benchmarks (ctx-max, prefix-cache) run on any transformers."""
    from transformers import Qwen3_5TextConfig

    d = Qwen3_5TextConfig().to_dict()
    d["mtp_num_hidden_layers"] = 1
    d["max_position_embeddings"] = QWEN35_WINDOW
    return ModelConfig.from_dict(d)


def tiny_gpu() -> ModelConfig:
    from transformers import Qwen3_5TextConfig

    return ModelConfig.from_dict(
        Qwen3_5TextConfig(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
        ).to_dict()
    )


SHAPES = {"qwen3.5-9b": qwen35_9b, "tiny": tiny_gpu}


def shape(name: str) -> ModelConfig:
    try:
        return SHAPES[name]()
    except KeyError:
        raise SystemExit(f"--random-init: unknown shape {name!r}; known: {', '.join(SHAPES)}") from None


def random_init(spec: str, *, seed: int = 0, dtype: str = "bf16", device: str = "cpu", mtp: bool = True):
    """`--random-init SPEC` of the workers and benchmarks: a shape name above, or a checkpoint directory
    whose config.json gives the shape (its weights are not read). Returns baton.loading.LoadedModel with
    seeded random weights: two processes given the same SPEC and seed build bitwise the same model and
    the same fingerprint ("random:..."), so a prefill and a decode worker accept each other's state."""
    from baton.loading import random_model

    return random_model(config_of(spec), dtype=dtype, device=device, seed=seed, mtp=mtp)


def config_of(spec: str) -> ModelConfig:
    """The ModelConfig of a `--random-init` SPEC (a shape name, or a directory with a config.json)."""
    from pathlib import Path

    return ModelConfig.from_hf(spec) if (Path(spec) / "config.json").is_file() else shape(spec)
