"""baton.fingerprint: content-sensitive, runtime-independent, cached by (name, size, mtime_ns)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from safetensors.torch import save_file

from baton import fingerprint as fpm

ARCH = {"hidden_size": 8, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
OLD_NS = 1_600_000_000 * 10**9  # an mtime far in the past: the cached digest is not "racy"


def write_ckpt(d, *, value=0.5, extra=None):
    d.mkdir(parents=True, exist_ok=True)
    a = torch.full((4, 8), value, dtype=torch.bfloat16)
    b = torch.arange(16, dtype=torch.float32)
    save_file({"model.embed_tokens.weight": a, "model.norm.weight": b}, str(d / "model.safetensors"))
    if extra is not None:
        save_file({"mtp.fc.weight": extra}, str(d / "mtp.safetensors"))
    for p in d.glob("*.safetensors"):
        os.utime(p, ns=(OLD_NS, OLD_NS))
    return d


def fingerprint(d):
    return fpm.model_fingerprint(ARCH, fpm.read_tensor_table(d), d)


@pytest.fixture
def count_hashes(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    calls = []
    real = fpm._file_sha256
    monkeypatch.setattr(fpm, "_file_sha256", lambda p: calls.append(p.name) or real(p))
    return calls


def test_same_dir_same_fingerprint_and_format(tmp_path, count_hashes):
    d = write_ckpt(tmp_path / "m")
    f1 = fingerprint(d)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", f1)
    assert fingerprint(d) == f1
    assert fingerprint(write_ckpt(tmp_path / "copy")) == f1  # location does not matter, content does


def test_one_changed_weight_value_changes_the_fingerprint(tmp_path, count_hashes):
    d = write_ckpt(tmp_path / "m")
    f1 = fingerprint(d)
    path = d / "model.safetensors"
    size = path.stat().st_size
    write_ckpt(d, value=0.50390625)  # the next bf16 value after 0.5: one bit differs, same size
    os.utime(path, ns=(OLD_NS + 1, OLD_NS + 1))
    assert path.stat().st_size == size
    assert fingerprint(d) != f1


def test_arch_table_and_sidecar_files_count(tmp_path, count_hashes):
    d = write_ckpt(tmp_path / "m")
    table = fpm.read_tensor_table(d)
    assert table["model.embed_tokens.weight"] == ((4, 8), "BF16")
    base = fpm.model_fingerprint(ARCH, table, d)
    assert fpm.model_fingerprint(ARCH | {"hidden_size": 9}, table, d) != base
    assert fpm.model_fingerprint(ARCH, table | {"model.norm.weight": ((16,), "F16")}, d) != base
    assert fpm.model_fingerprint(dict(reversed(list(ARCH.items()))), dict(reversed(list(table.items()))), d) == base
    write_ckpt(d, extra=torch.zeros(2, 2))
    assert fpm.model_fingerprint(ARCH, table, d) != base  # mtp.safetensors is part of the content


def test_cache_hit_skips_rehash_and_size_or_mtime_invalidates(tmp_path, count_hashes):
    d = write_ckpt(tmp_path / "m", extra=torch.ones(3))
    f1 = fingerprint(d)
    assert sorted(count_hashes) == ["model.safetensors", "mtp.safetensors"]
    assert (d / fpm.CACHE_NAME).is_file()
    count_hashes.clear()
    assert fingerprint(d) == f1 and count_hashes == []  # served from the cache, files not read
    os.utime(d / "mtp.safetensors", ns=(OLD_NS + 5, OLD_NS + 5))  # mtime changed, content not
    assert fingerprint(d) == f1 and count_hashes == ["mtp.safetensors"]
    count_hashes.clear()
    write_ckpt(d, extra=torch.ones(4))  # mtp: size changed; model: rewritten identically, same stat
    assert fingerprint(d) != f1 and count_hashes == ["mtp.safetensors"]


def test_racy_digest_is_not_trusted(tmp_path, count_hashes):
    d = write_ckpt(tmp_path / "m")
    now = time.time_ns()
    os.utime(d / "model.safetensors", ns=(now, now))  # just written
    fingerprint(d)
    fingerprint(d)  # hashed within RACY_NS of its mtime: a same-tick rewrite could hide, hash again
    assert count_hashes == ["model.safetensors"] * 2


def test_unwritable_dir_falls_back_to_home_cache(tmp_path, count_hashes):
    d = write_ckpt(tmp_path / "m")
    (d / fpm.CACHE_NAME).mkdir()  # the beside-cache path cannot be written (works as root, too)
    f1 = fingerprint(d)
    assert list((tmp_path / "home" / ".cache" / "baton").glob("digest-*.json"))
    count_hashes.clear()
    assert fingerprint(d) == f1 and count_hashes == []


def test_no_cache_anywhere_still_works(tmp_path, monkeypatch, count_hashes):
    d = write_ckpt(tmp_path / "m")
    (d / fpm.CACHE_NAME).mkdir()
    (tmp_path / "home").write_text("not a directory")  # ~/.cache cannot be created either
    f1 = fingerprint(d)
    assert fingerprint(d) == f1 and count_hashes == ["model.safetensors"] * 2


def test_corrupt_cache_is_ignored(tmp_path, count_hashes):
    d = write_ckpt(tmp_path / "m")
    f1 = fingerprint(d)
    (d / fpm.CACHE_NAME).write_text("{not json")
    count_hashes.clear()
    assert fingerprint(d) == f1 and count_hashes == ["model.safetensors"]


def test_empty_dir_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        fpm.checkpoint_digest(tmp_path)
