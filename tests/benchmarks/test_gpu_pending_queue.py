"""benchmarks/gpu_pending.sh queue: several stages in one device call, each under its own timeout, each
packing its own STAGE.tgz; a stage that no longer fits the call's budget is skipped, and queue.txt says what
ran with which exit code. Run here with stages that need no GPU: unknown ones (exit 2, each packed by its
trap all the same) and one asking for more than the budget."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_pending.sh"


def _queue(tmp_path, queue: str, budget: int) -> str:
    env = dict(os.environ, OUT=str(tmp_path), QUEUE=queue, QUEUE_BUDGET_S=str(budget))
    subprocess.run(["bash", str(SCRIPT), "queue", "abc1234"], env=env, check=True, timeout=60, capture_output=True)
    return (tmp_path / "queue.txt").read_text()


def test_queue_runs_each_stage_with_its_exit_code_and_skips_what_does_not_fit(tmp_path):
    text = _queue(tmp_path, "no-such-stage:20 too-long:900 also-none:20", budget=300)
    lines = text.splitlines()
    assert "unknown stage no-such-stage" in lines[0]
    assert lines[1].startswith("queue: no-such-stage rc=2 at ")
    assert lines[2].startswith("queue: too-long skipped: 900 s asked, ") and lines[2].endswith(" s left")
    assert lines[3] == "unknown stage also-none" and lines[4].startswith("queue: also-none rc=2 at ")
    assert "no-such-stage.tgz" in os.listdir(tmp_path)  # each stage packs its own archive
