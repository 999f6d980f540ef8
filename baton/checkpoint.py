"""Checkpoint loading: a Hugging Face safetensors directory -> a module whose state_dict names are HF's.

Files read (see `checkpoint_files`):
    model.safetensors.index.json + the shards it names | else every *.safetensors   (main weights)
    mtp.safetensors                                                                 (optional MTP sidecar)
Checkpoint name -> module name:
    model.language_model.X -> model.X          (multimodal wrapper)
    model.visual.*         -> skipped
    X.weight [F8_E4M3] + X.weight_scale_inv    -> X.weight, dequantised over 128x128 blocks
    anything else          -> unchanged (model.*, lm_head.weight, mtp.*)
`load_into` is two-phase: (1) plan from the safetensors headers alone, checking every name and shape,
so a bad checkpoint raises before any parameter is touched; (2) copy tensor by tensor into the
module's existing storage, so at most one checkpoint tensor is held in host memory at a time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from baton.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
MTP_SIDECAR = "mtp.safetensors"
FP8_BLOCK = 128
_SCALE_SUFFIX = "_scale_inv"  # X.weight_scale_inv belongs to X.weight
_DTYPES = {  # safetensors dtype code -> torch dtype name
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class CheckpointError(ValueError):
    """The checkpoint directory does not match what the module / format expects."""


class MissingFileError(CheckpointError):
    pass


class MissingTensorError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


@dataclass(frozen=True)
class _Src:
    file: Path
    key: str  # name inside the file
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "BF16"
    scale: "_Src | None" = None  # block scales of an FP8 weight


@dataclass
class LoadReport:
    tensors: int = 0  # module tensors filled
    bytes: int = 0  # bytes written into the module
    seconds: float = 0.0
    mtp_loaded: bool = False
    skipped: int = 0  # checkpoint tensors deliberately not loaded (visual, mtp without a head, ...)
    missing: tuple[str, ...] = ()  # only non-empty with strict=False
    unexpected: tuple[str, ...] = ()  # only non-empty with strict=False
    files: tuple[Path, ...] = field(default_factory=tuple)


def dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """w [out, in] float8_e4m3fn, scale_inv [ceil(out/block), ceil(in/block)] -> fp32 [out, in],
    w_ij * scale_inv[i // block, j // block]."""
    out_f, in_f = w.shape
    want = _block_grid((out_f, in_f), block)
    if tuple(scale_inv.shape) != want:
        raise ShapeMismatchError(
            f"block scale has shape {tuple(scale_inv.shape)}, expected {want} for "
            f"a [{out_f}, {in_f}] weight with {block}x{block} blocks"
        )
    s = scale_inv.float().repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return w.float() * s


def _block_grid(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, ...]:
    return tuple(-(-n // block) for n in shape)


def map_name(name: str) -> str | None:
    """Checkpoint tensor name -> module name; None for tensors Baton never loads."""
    if name.startswith("model.visual."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


# ---- phase 0: which files, which tensors ----------------------------------------------------------
def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files a load reads, sorted: the index's shards (or every *.safetensors) + sidecar."""
    d = Path(model_dir)
    if not d.is_dir():
        raise MissingFileError(f"missing directory: {d}")
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read {index}: {e!r}") from e
        files = {d / f for f in weight_map.values()}
        for f in sorted(files):
            if not f.is_file():
                raise MissingFileError(f"missing file: shard {f.name} named in {index} does not exist")
    else:
        files = {p for p in d.glob("*.safetensors") if p.name != MTP_SIDECAR}
        if not files:
            raise MissingFileError(f"missing file: no *.safetensors files (model.safetensors or {INDEX_FILE}) in {d}")
    if (d / MTP_SIDECAR).is_file():
        files.add(d / MTP_SIDECAR)
    return sorted(files)


def _header(f: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, safetensors dtype code)} from a file's header; no tensor data is read."""
    try:
        with safe_open(str(f), framework="pt") as sf:
            return {k: (tuple(sf.get_slice(k).get_shape()), sf.get_slice(k).get_dtype()) for k in sf.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError, or OSError
        raise CheckpointError(f"cannot read safetensors file {f}: {e}") from e


def _scan(model_dir: Path) -> tuple[dict[str, _Src], list[str], list[Path]]:
    """Read headers only -> ({module name: source}, skipped checkpoint names, files)."""
    files = checkpoint_files(model_dir)
    srcs: dict[str, _Src] = {}
    scales: dict[str, _Src] = {}
    skipped: list[str] = []
    for f in files:
        for key, (shape, dt) in _header(f).items():
            src = _Src(f, key, shape, dt)
            name = map_name(key)
            if name is None:
                skipped.append(key)
                continue
            table = scales if name.endswith(".weight" + _SCALE_SUFFIX) else srcs
            if name in table:
                raise CheckpointError(
                    f"tensor {name} appears twice: in {table[name].file.name} "
                    f"(as {table[name].key}) and in {f.name} (as {key})"
                )
            table[name] = src
    index = model_dir / INDEX_FILE
    if index.is_file():
        for key, fname in json.loads(index.read_text())["weight_map"].items():
            name = map_name(key)
            if name is not None and name not in srcs and name not in scales:
                raise CheckpointError(f"{index.name} maps tensor {key} to {fname}, which does not contain it")
    for name, sc in scales.items():
        wname = name[: -len(_SCALE_SUFFIX)]
        if wname in srcs:
            srcs[wname] = _Src(srcs[wname].file, srcs[wname].key, srcs[wname].shape, srcs[wname].dtype, sc)
        else:
            srcs[name] = sc  # an orphan scale: reported as unexpected by load_into
    return srcs, skipped, files


def checkpoint_tensor_table(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{module name: (shape, stored dtype as a torch name)} after name mapping; block scales are folded
    into their weight (which keeps its stored dtype, e.g. 'float8_e4m3fn'); skipped tensors absent."""
    srcs, _, _ = _scan(Path(model_dir))
    return {n: (s.shape, _DTYPES.get(s.dtype, s.dtype)) for n, s in sorted(srcs.items())}


# ---- phase 1 + 2: plan, then copy -----------------------------------------------------------------
def _listing(names: list[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _plan(module: torch.nn.Module, srcs: dict[str, _Src], cfg: ModelConfig, dtype, device):
    """-> ([(module name, target tensor, source)], missing, unexpected, skipped). Raises on bad shapes."""
    targets = module.state_dict(keep_vars=True)  # live Parameters/buffers; tied ones appear twice
    has_mtp = any(n.startswith("mtp.") for n in targets)
    embed = targets.get("model.embed_tokens.weight")
    lm_head = targets.get("lm_head.weight")
    module_tied = embed is not None and lm_head is not None and lm_head is embed
    if module_tied and not cfg.tie_word_embeddings and "lm_head.weight" in srcs:
        raise CheckpointError(
            "the module ties lm_head.weight to model.embed_tokens.weight, but the checkpoint "
            "has its own lm_head.weight and tie_word_embeddings is false"
        )
    plan, missing, bad_shape, filled = [], [], [], set()
    for name, t in targets.items():
        if id(t) in filled:  # tied alias: filled through its first name
            continue
        src = srcs.get(name)
        if src is None and name == "lm_head.weight" and cfg.tie_word_embeddings:
            src = srcs.get("model.embed_tokens.weight")  # tied: lm_head comes from the embeddings
        if src is None:
            missing.append(name)
            continue
        if tuple(t.shape) != src.shape:
            bad_shape.append(f"{name}: module expects {tuple(t.shape)}, {src.file.name} has {src.shape}")
        elif src.scale is not None and (len(src.shape) != 2 or src.scale.shape != _block_grid(src.shape)):
            bad_shape.append(
                f"{src.scale.key}: expected {_block_grid(src.shape)} block scales for a "
                f"{src.shape} weight, {src.scale.file.name} has {src.scale.shape}"
            )
        if t.device.type == "meta":
            raise CheckpointError(f"{name} is on the meta device; allocate the module before load_into")
        if device is not None and (
            t.device.type != device.type or (device.index is not None and t.device.index != device.index)
        ):
            raise CheckpointError(f"{name} is on {t.device}, expected {device}; load_into fills tensors in place")
        if dtype is not None and t.is_floating_point() and t.dtype not in (dtype, torch.float32):
            raise CheckpointError(f"{name} has dtype {t.dtype}, expected {dtype} (or float32)")
        plan.append((name, t, src))
        filled.add(id(t))
    if bad_shape:
        raise ShapeMismatchError("shape mismatch: " + "; ".join(bad_shape))
    skipped, unexpected = [], []
    for name in srcs:
        if name in targets:
            continue
        if (name.startswith("mtp.") and not has_mtp) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            skipped.append(name)
        else:
            unexpected.append(name)
    return plan, missing, unexpected, skipped


def _read(sf, src: _Src) -> torch.Tensor:
    """One checkpoint tensor (CPU), FP8 block-dequantised to fp32 when it has scales."""
    t = sf.get_tensor(src.key)
    if src.scale is None:
        return t
    if src.scale.file == src.file:
        return dequant_fp8_blocks(t, sf.get_tensor(src.scale.key))
    with safe_open(str(src.scale.file), framework="pt") as sc_file:  # scale stored in another shard
        return dequant_fp8_blocks(t, sc_file.get_tensor(src.scale.key))


@torch.no_grad()
def load_into(
    module: torch.nn.Module,
    model_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    strict: bool = True,
) -> LoadReport:
    """Fill `module`'s parameters and persistent buffers, by state_dict name, from `model_dir`.

    The module must already be allocated; `device`/`dtype`, when given, are checked (a floating tensor
    may be `dtype` or float32). strict: every module tensor must be found and every checkpoint tensor
    used, except those skipped (model.visual.*, mtp.* when the module has no `mtp`, a redundant
    lm_head.weight when embeddings are tied). Shape mismatches always raise.
    """
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(model_dir)  # ConfigError (unsupported model_type, ...) propagates
    srcs, skipped_ckpt, files = _scan(model_dir)
    device = torch.device(device) if device is not None else None
    plan, missing, unexpected, skipped = _plan(module, srcs, cfg, dtype, device)
    if strict and missing:
        hint = ""
        if any(n.startswith("mtp.") for n in missing) and not any(n.startswith("mtp.") for n in srcs):
            hint = " (the checkpoint has no mtp.* tensors: build the model without its MTP head)"
        raise MissingTensorError(f"missing tensor(s) in {model_dir}: {_listing(missing)}{hint}")
    if strict and unexpected:
        raise UnexpectedTensorError(
            f"unexpected tensor(s) in {model_dir} (not in the module): {_listing(sorted(unexpected))}"
        )
    report = LoadReport(
        skipped=len(skipped_ckpt) + len(skipped),
        missing=tuple(missing),
        unexpected=tuple(sorted(unexpected)),
        files=tuple(files),
    )
    by_file: dict[Path, list] = {}
    for item in plan:
        by_file.setdefault(item[2].file, []).append(item)
    for f in sorted(by_file):
        with safe_open(str(f), framework="pt") as sf:
            for name, t, src in by_file[f]:
                t.copy_(_read(sf, src))  # casts dtype and moves to t.device in one step
                report.tensors += 1
                report.bytes += t.numel() * t.element_size()
                report.mtp_loaded |= name.startswith("mtp.")
    report.seconds = time.perf_counter() - t0
    return report
