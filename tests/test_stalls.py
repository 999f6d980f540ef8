"""baton/stalls.py: the probe sees a thread that holds the GIL, the window resets, and nothing is read
before it starts. Run in a child process: the probe thread lives as long as its process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, time
from baton import stalls

before = stalls.read()
stalls.start()
stalls.start()  # idempotent: one probe thread
time.sleep(0.3)
quiet = stalls.read(reset=True)
t0 = time.perf_counter()
sum(range(40_000_000))  # one C call: holds the GIL throughout
held = time.perf_counter() - t0
time.sleep(0.1)
busy = stalls.read(reset=True)
print(json.dumps({"before": before, "quiet": quiet, "held": held, "busy": busy, "after": stalls.read()}))
"""


def test_the_probe_sees_the_gil_held_and_its_window_resets():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["before"] == [0.0, 0.0, 0.0]  # never started: nothing read
    q_p99, q_max, q_share = got["quiet"]
    assert 0 <= q_p99 <= q_max < got["held"] / 2 and q_share < 0.5
    b_p99, b_max, b_share = got["busy"]
    assert b_max >= 0.8 * got["held"] - 0.01  # the probe could not run while the GIL was held
    assert b_share > q_share and b_share > 0.3  # ... most of that window
    assert got["after"] == [0.0, 0.0, 0.0] or got["after"][1] < b_max  # reset: a new window
