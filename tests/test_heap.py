"""baton/heap.py: a serving process's start-up heap leaves the collector's generations (so a full collection
no longer walks it), garbage made later is still collected, and the process mains do it before serving."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import pick_free_port
from helpers import make_tiny_dir
from realcluster import child_env

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import gc, json, logging, weakref
logging.basicConfig(level=logging.INFO)
import torch  # a heap the size of a worker's imports
from baton.heap import freeze_startup_heap

n = freeze_startup_heap("probe")
tracked = len(gc.get_objects())


class Node:
    pass


a, b = Node(), Node()
a.other, b.other = b, a  # a cycle: only the collector frees it
alive = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"frozen": n, "tracked": tracked, "cycle_freed": alive() is None}))
"""


def test_the_start_up_heap_is_frozen_and_later_garbage_still_collected():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 50_000  # torch's import alone tracks this many
    assert got["tracked"] < got["frozen"] // 20  # out of the generations a full collection walks
    assert got["cycle_freed"] is True
    assert re.search(r"probe: \d+ start-up objects frozen out of the garbage collector", out.stderr), out.stderr


def test_the_router_process_freezes_its_heap_before_it_serves(tmp_path):
    tiny = make_tiny_dir(tmp_path)
    dead = [f"127.0.0.1:{pick_free_port()}" for _ in range(2)]  # no workers needed to start
    argv = [sys.executable, "-u", "-m", "router", "--port", "0", "--prefill", dead[0], "--decode", dead[1]]
    p = subprocess.Popen(
        [*argv, "--model", str(tiny)],
        env=child_env(BATON_LOG_LEVEL="INFO"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "serving on" not in (line := p.stdout.readline()):
            assert line, f"router exited ({p.poll()}) without serving"
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert re.search(r"router: \d+ start-up objects frozen out of the garbage collector", err), err


READY = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from baton.settings import Settings
from baton.worker.process import ready

before = sys.getswitchinterval()
ready("probe", Settings.from_env())
print(before, sys.getswitchinterval())
"""


def test_ready_sets_the_gil_switch_interval_from_the_settings():
    """baton/worker/process.py: ready(role, settings): BATON_SWITCH_INTERVAL_US reaches the process."""
    env = child_env(BATON_SWITCH_INTERVAL_US="700")
    out = subprocess.run([sys.executable, "-c", READY], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    before, after = map(float, out.stdout.split())
    assert before == 0.005 and after == 0.0007
    assert "probe: GIL switch interval 700 us" in out.stderr
