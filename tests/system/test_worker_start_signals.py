"""A worker stopped while it is still starting exits 0 at once: SIGTERM lands in the middle of a real worker's
model build (`python -m prefill_worker | decode_worker --random-init DIR`, a config of about 1 GB of fp32
weights, ~2 s to build on CPU) and the process exits 0 within seconds, with one line saying so and no port
opened (it was killed by the signal, exit -15). And baton.worker.process.StopSignals in this process: a real
SIGTERM while starting raises LoadInterrupted, its "still starting" lines come until serving(), after which
a signal only sets `done`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.worker.process import LoadInterrupted, StopSignals

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "baton" / "assets" / "default-model" / "config.json"


@pytest.fixture(scope="module")
def big_shape(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("big-shape")
    cfg = json.loads(DEFAULT_CONFIG.read_text())
    layers = (["linear_attention"] * 3 + ["full_attention"]) * 4
    cfg.update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=len(layers), layer_types=layers)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sigterm_while_the_model_loads_exits_0_promptly(big_shape, role):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", f"{role}_worker", "--random-init", str(big_shape), "--port", "0"]
    proc = subprocess.Popen(
        argv + ["--max-len", "512", "--slots", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "random weights of" in line:  # logged just before the weights are built
                proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                break
        else:
            pytest.fail("the worker never started loading: " + "".join(seen))
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(seen) + err
    assert proc.returncode == 0, (proc.returncode, err)
    assert f"{role}: signal 15 while starting" in err and "Traceback" not in err, err
    assert "serving on" not in out and "ready on" not in err, (out, err)
    assert took < 10, took


def test_stop_signals_interrupt_only_while_starting(caplog):
    caplog.set_level("INFO", logger="baton.worker")
    before = signal.getsignal(signal.SIGTERM)
    s = StopSignals("prefill", every=0.05)
    try:
        time.sleep(0.3)
        ticks = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
        assert len(ticks) >= 2 and ticks[0].startswith("prefill: still starting, 0 s so far"), ticks
        with pytest.raises(LoadInterrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, between two Python steps
        assert s.done.is_set() and not s.starting
        s2 = StopSignals("decode", every=0.05)
        s2.serving()
        caplog.clear()
        os.kill(os.getpid(), signal.SIGTERM)  # serving: no exception, `done` is set
        assert s2.done.wait(2.0)
        time.sleep(0.2)
        # the serving one never ticks (a tick of the first one's thread may land late on a loaded machine)
        assert not [r for r in caplog.records if r.getMessage().startswith("decode: still starting")]
        assert any("decode: signal 15, shutting down" in r.getMessage() for r in caplog.records)
        s2.restore()
    finally:
        s.restore()
    assert signal.getsignal(signal.SIGTERM) is before
