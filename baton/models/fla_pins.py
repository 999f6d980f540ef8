"""Pinned launch configs for flash-linear-attention's prefill kernels, so that every worker process computes
the same bits.

    pin(device_name)            -> the pins folder used, or None; call before fla is first imported
    write(folder, gpu, picks)   -> the files written: a kernel's config per file, in fla's own format
    gpu_folder_name(name)       -> fla's sanitised GPU name (its get_gpu_info), e.g. "NVIDIA_H100_80GB_HBM3"

Why. The prefill's delta rule is fla's `chunk_gated_delta_rule` (baton/models/gdn_ops.py: _fla_chunk). Its
Triton kernels are autotuned: on first use in a process each kernel times its configs and keeps the fastest.
Where two configs of one kernel round differently, two processes whose timings fell differently compute
different bits, and Baton's promise (a session's tokens bitwise the same on any worker, a restarted exact
session's state bitwise the lost one) would rest on timing noise. On 2026-12-06 (an H100) a 300-token prompt
cut in 128-token pieces gave first token 83504 in one process and 482 in four others (stop 52). fla 0.6
reads no fixed configs unless told (FLA_CACHE_MODE defaults to "disabled"), and Triton's on-disk autotune
cache (FLA_CACHE_RESULTS) keeps one machine's choice, not a fleet's.

How. fla reads a fixed config per kernel from `$FLA_CONFIG_DIR/{kernel}.json` when FLA_CACHE_MODE is
"default" (its fla/ops/utils/cache.py: the file's `default_config`, for every shape), and then never times.
Baton ships such files per GPU model under baton/assets/fla-configs/{gpu}/ (measured by
benchmarks/fla_config_bits.py --write-pins: each kernel's fastest config on a prefill pass's shape), and
pin() points fla at them. Both variables are read when fla is imported, so pin() runs before the first
import (gdn_ops._fla_chunk). A user's own FLA_CACHE_MODE or FLA_CONFIG_DIR wins (nothing is changed), and
BATON_FLA_PIN=0 turns pinning off. A GPU with no folder here keeps fla's autotuning, with one warning: its
workers' bits then agree within a process, not across processes, for the kernels whose configs round
differently (fla_config_bits reports which).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

log = logging.getLogger("baton.models")

PINS_DIR = Path(__file__).resolve().parents[1] / "assets" / "fla-configs"
PIN_ENV = "BATON_FLA_PIN"  # "0": leave fla's autotuning alone
FLA_ENVS = ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")


def gpu_folder_name(name: str) -> str:
    """fla's sanitised GPU name (fla/ops/utils/cache.py sanitize_gpu_name): runs of other characters -> '_'."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def pin(device_name: str, pins_dir: Path = PINS_DIR) -> Path | None:
    """Points fla at this GPU's pinned configs (module doc) -> the folder, or None (left to fla's autotuning:
    turned off, the user's own settings, fla already imported, or no pins for this GPU; each said in the log)."""
    if os.environ.get(PIN_ENV, "1") == "0":
        return None
    own = [v for v in FLA_ENVS if v in os.environ]
    if own:
        log.info("fla configs: %s set by the caller; not pinned by Baton", ", ".join(own))
        return None
    if "fla.ops.utils.cache" in sys.modules:  # fla read its settings at import: too late to pin
        log.warning("fla configs: fla was imported before Baton could pin its configs; it autotunes by timing")
        return None
    folder = pins_dir / gpu_folder_name(device_name)
    if not any(folder.glob("*.json")):
        log.warning(
            "fla configs: none pinned for %s (%s): fla autotunes the prefill's kernels by timing in each process,"
            " so a prompt's bits may differ between worker processes (benchmarks/fla_config_bits.py --write-pins"
            " measures pins)",
            device_name,
            folder,
        )
        return None
    os.environ["FLA_CACHE_MODE"] = "default"
    os.environ["FLA_CONFIG_DIR"] = str(folder)
    log.info("fla configs: pinned from %s (%d kernels)", folder, len(list(folder.glob("*.json"))))
    return folder


def config_entry(kwargs: dict, num_warps: int, num_stages: int, num_ctas: int = 1) -> dict:
    """One config in fla's file format (its KernelConfigFile / maybe_load_cached_config reads these keys)."""
    return {
        "kwargs": dict(kwargs),
        "num_warps": int(num_warps),
        "num_stages": int(num_stages),
        "num_ctas": int(num_ctas),
        "maxnreg": None,
    }


def write(folder: Path, gpu: str, picks: dict[str, dict], triton_version: str = "") -> list[Path]:
    """picks {kernel name: config_entry(...)} -> {folder}/{gpu_folder_name(gpu)}/{kernel}.json, each with the
    config as its `default_config` (what FLA_CACHE_MODE=default reads) -> the files written."""
    out = folder / gpu_folder_name(gpu)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for kernel, entry in sorted(picks.items()):
        f = out / f"{kernel}.json"
        body = {"kernel_name": kernel, "triton_version": triton_version, "gpu": gpu, "default_config": entry}
        f.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        files.append(f)
    return files
