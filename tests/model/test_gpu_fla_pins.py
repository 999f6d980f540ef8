"""GPU: with Baton's pins for this GPU (baton/models/fla_pins.py), fla's prefill kernels run the pinned configs
and time nothing, so two worker processes, each with an empty Triton cache, compute the same bits for a cut
prompt's delta rule (9B shape, 300 tokens in 128-token pieces, as stop 52's differing processes did).
Without pins for this GPU it is skipped, saying how to make them (gpu_pending.sh fla-bits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from baton.models import gdn_ops
    from baton.random_init import config_of
    from benchmarks.fla_config_bits import _autotuners, _cfg_text, _inputs, _kernel_name, _run

    fla = gdn_ops._fla_chunk()  # pins (or not) before fla's import
    x = _inputs(config_of("qwen3.5-9b"), 300, 0)
    digest = _run(fla, x, [128, 256, 300])
    used = {_kernel_name(at): sorted({_cfg_text(c) for c in at.cache.values()}) for _, at in _autotuners() if at.cache}
    print(json.dumps({"digest": digest, "used": used, "dir": os.environ.get("FLA_CONFIG_DIR")}))
    """
)


def _child(tmp_path: Path, n: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLA_")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton-{n}")  # each process tunes (or not) on its own
    got = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def test_pinned_fla_configs_give_two_processes_the_same_bits(tmp_path):
    from baton.models import fla_pins

    pytest.importorskip("fla")
    folder = fla_pins.PINS_DIR / fla_pins.gpu_folder_name(torch.cuda.get_device_name())
    if not any(folder.glob("*.json")):
        pytest.skip(f"no fla pins for {torch.cuda.get_device_name()}: gpu_pending.sh fla-bits writes them")
    pins = {f.stem: json.loads(f.read_text())["default_config"] for f in folder.glob("*.json")}
    a, b = _child(tmp_path, 0), _child(tmp_path, 1)
    assert a["dir"] == str(folder)
    assert a["used"] and set(a["used"]) <= set(pins), "a kernel with no pin was timed"
    for name, cfgs in a["used"].items():  # every shape of a kernel ran its pin
        p = pins[name]
        assert cfgs == [f"{p['kwargs']} w{p['num_warps']} s{p['num_stages']}"], (name, cfgs, p)
    assert a["used"] == b["used"] and a["digest"] == b["digest"]
