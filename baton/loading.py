"""Build a ready model from a checkpoint directory (or random weights for benchmarks).

load_model(dir)      config -> module allocated in place on the target device (no random init,
                     no second copy) -> weights copied tensor by tensor -> fingerprint
random_model(cfg)    the same module filled with seeded random values (e.g. the 9B shape in memory)
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from baton.config import ModelConfig
from baton.models.qwen3_5 import Qwen3_5ForCausalLM

log = logging.getLogger("baton.loading")

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
}
DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "default-model"


@dataclass
class LoadedModel:
    model: Qwen3_5ForCausalLM
    cfg: ModelConfig
    fingerprint: str
    model_dir: Path | None
    seconds: float
    has_mtp: bool


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown {name!r}; choose one of bf16, fp32") from None


_INIT_FNS = frozenset(getattr(torch.nn.init, n) for n in dir(torch.nn.init) if n.endswith("_") and n[0] != "_")


class _SkipInit(TorchFunctionMode):
    """torch.nn.init's in-place fills (the modules' reset_parameters) return their tensor untouched: on the
    meta device they compute nothing but still cost Python time. A torch function mode is per thread, so
    another thread building a module meanwhile is not affected."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT_FNS:
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def build_model(cfg: ModelConfig, *, with_mtp: bool, dtype: torch.dtype, device) -> Qwen3_5ForCausalLM:
    """Allocates the module on `device` without initialising values (weights come next)."""
    with torch.device("meta"), _SkipInit():
        m = Qwen3_5ForCausalLM(cfg, with_mtp=with_mtp)
    m = m.to(dtype).to_empty(device=device)  # cast on meta: no float32 allocation converted value by value
    return m.eval().requires_grad_(False)


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    d = Path(model_dir) if model_dir else DEFAULT_MODEL_DIR
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {d} (pass --model DIR: an HF checkpoint directory)")
    return d


def check_device(device) -> None:
    """ValueError naming the device when it is CUDA and torch has none (a CPU wheel, no driver, no GPU):
    one line at start-up instead of torch's AssertionError from deep in the first .to(device)."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "torch sees no CUDA device"
        raise ValueError(f"--device {device}: CUDA is not available ({why}, torch {torch.__version__})")


def load_model(model_dir: str | Path | None, *, dtype="bf16", device="cpu", mtp: bool | None = None) -> LoadedModel:
    from baton.checkpoint import checkpoint_tensor_table, load_into
    from baton.fingerprint import model_fingerprint

    t0 = time.perf_counter()
    check_device(device)
    d = resolve_model_dir(model_dir)
    cfg = ModelConfig.from_hf(d)
    table = checkpoint_tensor_table(d)
    has_mtp = any(n.startswith("mtp.") for n in table)
    want_mtp = has_mtp if mtp is None else mtp
    if want_mtp and not has_mtp:
        raise ValueError(f"model: {d} has no mtp.* tensors; the mtp engine needs an MTP head")
    log.info(
        "loading %s (%d layers, hidden %d, mtp=%s) to %s", d, cfg.num_hidden_layers, cfg.hidden_size, want_mtp, device
    )
    model = build_model(cfg, with_mtp=want_mtp, dtype=parse_dtype(dtype), device=device)
    rep = load_into(model, d, dtype=parse_dtype(dtype), device=device)
    fp = model_fingerprint(cfg.arch_dict(), table, d)
    log.info("loaded %d tensors, %.1f MB in %.2fs", rep.tensors, rep.bytes / 1e6, rep.seconds)
    return LoadedModel(model, cfg, fp, d, time.perf_counter() - t0, want_mtp)


@torch.no_grad()
def random_model(
    cfg: ModelConfig, *, dtype="bf16", device="cpu", seed: int = 0, mtp: bool = True, std: float = 0.02
) -> LoadedModel:
    """Seeded random weights in place (norm weights near their identity), for benchmarks and tests."""
    t0 = time.perf_counter()
    model = build_model(cfg, with_mtp=mtp, dtype=parse_dtype(dtype), device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") and "linear_attn.norm" not in name:
            p.normal_(0.0, 0.1, generator=g)  # zero-centred norms: (1 + w)
        elif "linear_attn.norm" in name:
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.uniform_(0.0, 2.0, generator=g)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 0.5, generator=g)
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 0.3, generator=g)
        else:
            p.normal_(0.0, std, generator=g)
    arch = json.dumps(cfg.arch_dict(), sort_keys=True)
    fp = "random:" + hashlib.sha256(f"{arch}|seed={seed}|std={std}".encode()).hexdigest()[:32]
    return LoadedModel(model, cfg, fp, None, time.perf_counter() - t0, mtp)
