"""The CPU itself batches: through the real `baton serve --processes` stack, 8 concurrent fast streams
give several times the tokens per second of one stream, and every stream's tokens equal `baton
complete`. The figure is benchmarks/bench_serve.py's (recorded in benchmarks/results/serve-cpu-*.md);
the bound here is loose on purpose (CI machines are shared), the token identity is exact."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import pytest

from benchmarks.bench_serve import PROMPTS, _point
from benchmarks.load import Serve, make_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
NEW = 32


def test_eight_streams_batch_and_stay_exact():
    with tempfile.TemporaryDirectory(prefix="baton-scaling-") as tmp:
        token = f"scale-{os.getpid()}-{random.randrange(1 << 30)}"
        (Path(tmp) / "token").write_text(token)
        serve = Serve("--port", "0", "--http-port", "0", "--token-file", str(Path(tmp) / "token"), "--max-len", "512")
        try:
            ref = make_reference(None, 512, PROMPTS[:8], NEW)
            addr = serve.wait()
            _point(addr, token, 1, 1, NEW, "bf16", ref)  # warm-up
            one = _point(addr, token, 1, 2, NEW, "bf16", ref)
            eight = _point(addr, token, 8, 2, NEW, "bf16", ref)
        finally:
            serve.stop()
    for p in (one, eight):
        assert p["errors"] == {} and p["mismatched"] == 0 and p["tokens"] == p["streams"] * NEW, p
    print(f"1 stream {one['tok_s']} tok/s, 8 streams {eight['tok_s']} tok/s")
    # 3.0x measured on 2 idle cores; 1.71x once in a loaded CI run (two test processes): the bound only
    # has to tell batching (well over 1x) from one stream at a time (about 1x)
    assert eight["tok_s"] > 1.5 * one["tok_s"], (one, eight)
