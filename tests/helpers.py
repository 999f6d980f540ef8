"""Shared test helpers (import as `from helpers import make_tiny_dir`)."""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from pathlib import Path

_CACHE: dict[tuple, Path] = {}
ROOT = Path(__file__).resolve().parents[1]  # the repository
_CACHE_ROOT: Path | None = None


def _cache_root() -> Path:
    global _CACHE_ROOT
    if _CACHE_ROOT is None:
        _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="baton-tiny-cache-"))
        atexit.register(shutil.rmtree, _CACHE_ROOT, True)
    return _CACHE_ROOT


def make_tiny_dir(tmp_path: Path, **kw) -> Path:
    """A fresh copy (safe to modify) of `baton.random_checkpoint.make_random_checkpoint(**kw)` under `tmp_path`.

    Each distinct set of arguments is generated once per test process and copied afterwards, so
    many tests can use the same tiny checkpoint cheaply.
    """
    from baton.random_checkpoint import make_random_checkpoint

    key = tuple(sorted(kw.items()))
    if key not in _CACHE:
        _CACHE[key] = make_random_checkpoint(_cache_root() / f"m{len(_CACHE)}", **kw)
    name = re.sub(r"[^A-Za-z0-9=._-]", "_", "-".join(["tiny"] + [f"{k}={v}" for k, v in key]))
    dest = Path(tmp_path) / name
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{name}-{n}")
        n += 1
    shutil.copytree(_CACHE[key], dest)
    return dest
