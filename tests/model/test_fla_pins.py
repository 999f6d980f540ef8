"""baton/models/fla_pins.py: pinned launch configs for fla's prefill kernels (so that worker processes do not
each pick configs by timing). pin() points fla at this GPU's folder through fla's own variables
(FLA_CACHE_MODE=default, FLA_CONFIG_DIR) only where Baton has pins for that GPU, leaves a caller's own
settings alone, can be turned off, and says so when fla was imported too early to be pinned; write() files
a kernel's config in the format fla 0.6's loader reads (fla/ops/utils/cache.py: default_config with
kwargs, num_warps, num_stages, num_ctas). The GPU side: tests/model/test_gpu_fla_pins.py."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from baton.models import fla_pins

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def clean_env(monkeypatch):
    for v in (*fla_pins.FLA_ENVS, fla_pins.PIN_ENV):
        monkeypatch.delenv(v, raising=False)  # restored (absent) after the test, whatever pin() set
    monkeypatch.delitem(sys.modules, "fla.ops.utils.cache", raising=False)


def _pins(tmp_path):
    entry = fla_pins.config_entry({"BK": 64, "BV": 32}, num_warps=4, num_stages=2)
    return fla_pins.write(tmp_path, H100, {"chunk_fwd_kernel_o": entry, "recompute_w_u_fwd_kernel": entry}, "3.5.1")


def test_gpu_folder_names_are_flas():
    assert fla_pins.gpu_folder_name(H100) == "NVIDIA_H100_80GB_HBM3"
    assert fla_pins.gpu_folder_name("NVIDIA H200") == "NVIDIA_H200"
    assert fla_pins.gpu_folder_name("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100_SXM4_80GB"
    assert fla_pins.gpu_folder_name("--") == "unknown_gpu"


def test_written_pins_are_in_flas_file_format(tmp_path):
    files = _pins(tmp_path)
    assert [f.name for f in files] == ["chunk_fwd_kernel_o.json", "recompute_w_u_fwd_kernel.json"]
    assert {f.parent for f in files} == {tmp_path / "NVIDIA_H100_80GB_HBM3"}
    body = json.loads(files[0].read_text())
    assert body["kernel_name"] == "chunk_fwd_kernel_o" and body["triton_version"] == "3.5.1"
    cfg = body["default_config"]  # what FLA_CACHE_MODE=default reads, then triton.Config(kwargs, ...)
    assert cfg == {"kwargs": {"BK": 64, "BV": 32}, "num_warps": 4, "num_stages": 2, "num_ctas": 1, "maxnreg": None}


def test_pin_points_fla_at_this_gpus_folder(tmp_path, clean_env, caplog):
    _pins(tmp_path)
    with caplog.at_level(logging.INFO, "baton.models"):
        got = fla_pins.pin(H100, pins_dir=tmp_path)
    assert got == tmp_path / "NVIDIA_H100_80GB_HBM3"
    assert os.environ["FLA_CACHE_MODE"] == "default" and os.environ["FLA_CONFIG_DIR"] == str(got)
    assert "pinned from" in caplog.text and "(2 kernels)" in caplog.text


def test_a_gpu_without_pins_keeps_flas_autotuning_and_says_so(tmp_path, clean_env, caplog):
    _pins(tmp_path)
    with caplog.at_level(logging.WARNING, "baton.models"):
        assert fla_pins.pin("NVIDIA H200", pins_dir=tmp_path) is None
    assert not any(v in os.environ for v in fla_pins.FLA_ENVS)
    assert "none pinned for NVIDIA H200" in caplog.text and "between worker processes" in caplog.text


def test_the_callers_own_fla_settings_and_the_off_switch_win(tmp_path, clean_env, monkeypatch):
    _pins(tmp_path)
    monkeypatch.setenv("FLA_CACHE_MODE", "full")
    assert fla_pins.pin(H100, pins_dir=tmp_path) is None
    assert os.environ["FLA_CACHE_MODE"] == "full" and "FLA_CONFIG_DIR" not in os.environ
    monkeypatch.delenv("FLA_CACHE_MODE")
    monkeypatch.setenv(fla_pins.PIN_ENV, "0")
    assert fla_pins.pin(H100, pins_dir=tmp_path) is None
    assert not any(v in os.environ for v in fla_pins.FLA_ENVS)


def test_fla_imported_first_is_too_late_to_pin(tmp_path, clean_env, monkeypatch, caplog):
    _pins(tmp_path)
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", object())  # fla read its variables already
    with caplog.at_level(logging.WARNING, "baton.models"):
        assert fla_pins.pin(H100, pins_dir=tmp_path) is None
    assert not any(v in os.environ for v in fla_pins.FLA_ENVS)
    assert "imported before Baton could pin" in caplog.text
