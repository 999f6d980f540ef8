"""benchmarks/report.py exit_on_sigterm: a SIGTERM becomes SystemExit(143) in the main thread, so a
benchmark's finally blocks run (they stop the worker processes it started); a child that installs it
and is sent SIGTERM runs its finally and exits 143."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_runs_the_finally_blocks_and_exits_143(tmp_path):
    mark = tmp_path / "stopped"
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from benchmarks.report import exit_on_sigterm
        exit_on_sigterm()
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            open({str(mark)!r}, "w").write("workers stopped")
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    os.kill(p.pid, 15)
    assert p.wait(30) == 143
    assert mark.read_text() == "workers stopped"
