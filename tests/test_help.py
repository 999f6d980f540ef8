"""`--help` of every entry point an operator runs: it exits 0, and every option has a line of help (an
option listed bare, e.g. `--port PORT` with nothing after it, told the operator neither what it does nor
its default)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = [
    ("-m", "baton", "serve"),
    ("-m", "baton", "generate"),
    ("-m", "baton", "health"),
    ("-m", "baton", "complete"),
    ("-m", "baton", "make-tiny"),
    ("-m", "router"),
    ("-m", "prefill_worker"),
    ("-m", "decode_worker"),
    ("deploy/launch.py",),
]


def bare_options(text: str) -> list[str]:
    """Options of an argparse help text with no help: a flag line with no text after it and no indented
    continuation below."""
    lines = text.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.startswith("options:")) + 1 :]
    bare = []
    for i, line in enumerate(body):
        if not line.startswith("  -"):
            continue
        inline = re.match(r"^  \S.*?\S {2,}\S", line)
        below = i + 1 < len(body) and re.match(r"^ {20,}\S", body[i + 1])
        if not inline and not below:
            bare.append(line.strip())
    return bare


def test_bare_options_finds_an_option_without_help():
    text = "usage: x\n\noptions:\n  -h, --help   show this\n  --port PORT\n  --host HOST  bind host\n"
    assert bare_options(text) == ["--port PORT"]


@pytest.mark.parametrize("argv", ENTRY_POINTS, ids=lambda a: " ".join(a[1:]) or a[0])
def test_every_option_has_help(argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: "), r.stderr
    assert bare_options(r.stdout) == []
