"""Model fingerprint: which model a state belongs to, carried in every StateHeader.

    model_fingerprint(arch, tensor_table, model_dir) -> "sha256:<64 hex>"

SHA-256 over a canonical JSON document of
  - the architecture dict (sorted keys, no whitespace),
  - the checkpoint's tensor table: name -> (shape, stored dtype string), sorted by name,
  - a content digest of the weights: per `*.safetensors` file in model_dir (sorted by name), its size
    and SHA-256 (streamed in 8 MiB blocks).
Two checkpoints that differ only in weight values get different fingerprints.

NOTE: the fingerprint names the checkpoint, not the runtime: pass the table as stored on disk
(`read_tensor_table(model_dir)`), not as cast by an engine, so BF16 and FP8 engines of the same
checkpoint share one fingerprint and accept each other's state.

Hashing a 18 GB checkpoint takes seconds, so per-file digests are cached in
`<model_dir>/.baton-digest.json`, keyed by file name, size and mtime_ns. Where model_dir is
read-only the cache lives in ~/.cache/baton/ keyed by model_dir's absolute path. An unwritable or
corrupt cache is ignored, never fatal. A digest taken within RACY_NS of the file's mtime is not
trusted later (the file may have changed again within the same timestamp tick); it is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Mapping, Sequence

CACHE_NAME = ".baton-digest.json"
BLOCK_BYTES = 8 << 20
RACY_NS = 2_000_000_000  # NOTE: mtime granularity margin (coarse clocks, FAT: 2 s)
_CACHE_VERSION = 1


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _file_sha256(path: Path) -> str:
    """SHA-256 hex of one file, streamed in BLOCK_BYTES blocks into one reused buffer."""
    h, buf = hashlib.sha256(), bytearray(BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _home_cache(model_dir: Path) -> Path:
    key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:24]
    return Path(os.path.expanduser("~")) / ".cache" / "baton" / f"digest-{key}.json"


def _load_cache(path: Path, model_dir: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") == _CACHE_VERSION and doc.get("dir") == str(model_dir):
            return {k: v for k, v in doc["files"].items() if isinstance(v, dict)}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        pass
    return {}


def _store_cache(files: dict, model_dir: Path) -> None:
    doc = _canonical({"version": _CACHE_VERSION, "dir": str(model_dir), "files": files})
    for path in (model_dir / CACHE_NAME, _home_cache(model_dir)):
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(doc)
            os.replace(tmp, path)  # atomic: readers see the old or the new file, never half of one
            return
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def checkpoint_digest(model_dir: str | os.PathLike) -> str:
    """SHA-256 hex over (name, size, sha256) of every *.safetensors file in model_dir, by name."""
    model_dir = Path(model_dir).resolve()
    names = sorted(p.name for p in model_dir.glob("*.safetensors") if p.is_file())
    if not names:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    cached = _load_cache(model_dir / CACHE_NAME, model_dir) or _load_cache(_home_cache(model_dir), model_dir)
    files, rows, changed = {}, [], False
    for name in names:
        st = os.stat(model_dir / name)
        entry = cached.get(name)
        fresh = (
            entry is not None
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("sha256"), str)
            and entry.get("hashed_at_ns", 0) - st.st_mtime_ns > RACY_NS
        )
        if not fresh:
            started = time.time_ns()
            entry = {
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "hashed_at_ns": started,
                "sha256": _file_sha256(model_dir / name),
            }
            changed = True
        files[name] = entry
        rows.append([name, entry["size"], entry["sha256"]])
    if changed or set(cached) != set(files):
        _store_cache(files, model_dir)
    return hashlib.sha256(_canonical(rows)).hexdigest()


def read_tensor_table(model_dir: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, stored dtype string such as "BF16") from the safetensors headers only."""
    table = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                table[name] = (tuple(info["shape"]), info["dtype"])
    return table


def model_fingerprint(
    arch: Mapping, tensor_table: Mapping[str, tuple[Sequence[int], str]], model_dir: str | os.PathLike
) -> str:
    """ "sha256:<hex>" of the architecture, the stored tensor table and the weight contents.
    arch must be JSON-serializable (e.g. dataclasses.asdict(ModelConfig)); runtime choices (engine,
    dtype casts) must stay out of it and out of tensor_table."""
    table = sorted([name, [int(d) for d in shape], str(dtype)] for name, (shape, dtype) in tensor_table.items())
    doc = {"fingerprint_version": 1, "arch": arch, "tensors": table, "weights": checkpoint_digest(model_dir)}
    return "sha256:" + hashlib.sha256(_canonical(doc)).hexdigest()
