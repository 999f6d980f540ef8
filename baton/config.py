"""Model configuration: the one place that knows Hugging Face `config.json` quirks.

`ModelConfig.from_hf(dir)` reads a checkpoint's config and returns a frozen, typed description of
the architecture. Nothing else in Baton reads `config.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """The checkpoint's config.json is missing, unreadable, or describes an unsupported model."""


# model_type -> how to find the text config inside config.json.
# NOTE: add `qwen3_next` / `qwen3_5_moe` here once their MoE MLP exists in baton/models.
_TEXT_CONFIG_KEY = {
    "qwen3_5_text": None,  # the text config is the file itself
    "qwen3_5": "text_config",  # multimodal wrapper: the text part is nested
}
SUPPORTED_MODEL_TYPES = tuple(_TEXT_CONFIG_KEY)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 0
    model_type: str = "qwen3_5_text"
    hf_text_config: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def arch_dict(self) -> dict:
        """The architecture fields only (used by the model fingerprint)."""
        d = asdict(self)
        d.pop("hf_text_config")
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"missing file: {path} (a model directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in _TEXT_CONFIG_KEY:
            raise ConfigError(
                f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        key = _TEXT_CONFIG_KEY[model_type]
        text = raw if key is None else raw.get(key)
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type {model_type!r} needs a {key!r} object")
        try:
            n = int(text["num_hidden_layers"])
            layer_types = text.get("layer_types")
            if layer_types is None:
                interval = int(text.get("full_attention_interval", 4))
                layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
            rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
            rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
            partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
            heads = int(text["num_attention_heads"])
            hidden = int(text["hidden_size"])
            eos = text.get("eos_token_id", raw.get("eos_token_id"))
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
            tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            cfg = cls(
                vocab_size=int(text["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(text["intermediate_size"]),
                num_hidden_layers=n,
                layer_types=tuple(layer_types),
                num_attention_heads=heads,
                num_key_value_heads=int(text["num_key_value_heads"]),
                head_dim=int(text.get("head_dim") or hidden // heads),
                rope_theta=rope_theta,
                partial_rotary_factor=partial,
                linear_num_key_heads=int(text["linear_num_key_heads"]),
                linear_num_value_heads=int(text["linear_num_value_heads"]),
                linear_key_head_dim=int(text["linear_key_head_dim"]),
                linear_value_head_dim=int(text["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(text["linear_conv_kernel_dim"]),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(tie),
                max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
                eos_token_ids=eos_ids,
                mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
                model_type=model_type,
                hf_text_config=dict(text),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing field {e.args[0]!r}") from e
        if len(cfg.layer_types) != n:
            raise ConfigError(f"{source}: layer_types has {len(cfg.layer_types)} entries, num_hidden_layers is {n}")
        bad = set(cfg.layer_types) - {"linear_attention", "full_attention"}
        if bad:
            raise ConfigError(f"{source}: unknown layer_types {sorted(bad)}")
        return cfg
