"""Load, CI size: 16 concurrent streaming clients for 10 s against `baton serve --processes` (the embedded
default model on CPU, window 512, a bearer token), fast bf16 / mtp / fp8 and exact fp8 / mtp mixed.

Asserted: the only errors are RESOURCE_EXHAUSTED refusals (router max_inflight, or the workers' 8 session
slots: the clients back off and retry); every completed fast bf16 / mtp and exact stream is `baton
complete`'s output for its prompt (0 lost, 0 duplicated, 0 wrong tokens) and every stream's usage matches
what was streamed; no client hangs; afterwards 0 sessions on every worker (GetStats); `baton serve` and its
workers exit 0 on SIGTERM. p50 / p99 TTFT, inter-token latency and tokens/s go to the test output.
The long run (64 clients, 60 s) is benchmarks/load.py; its figures are in benchmarks/results/.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.load import run  # noqa: E402


@pytest.mark.timeout(240)
def test_16_clients_10_s_against_serve_processes(capsys):
    r = run(clients=16, duration=10, max_new_tokens=16, max_len=512, settle=5, request_timeout=60)
    figures = {
        k: r[k]
        for k in (
            "requests",
            "completed",
            "completed_by_kind",
            "errors_by_status",
            "ttft_ms",
            "itl_ms",
            "tpot_ms",
            "tokens_per_s",
            "requests_per_s",
            "sessions_left",
            "boot_s",
        )
    }
    with capsys.disabled():  # the figures go to the test output, captured or not
        print("\nload (16 clients, 10 s):", json.dumps(figures))
    assert set(r["errors_by_status"]) <= {"RESOURCE_EXHAUSTED"}, r["error_examples"]
    assert r["completed"] >= 8 and r["checked_streams"] >= 4, figures
    assert (r["lost_tokens"], r["duplicated_tokens"], r["wrong_tokens"]) == (0, 0, 0), r["mismatch_examples"]
    assert r["count_mismatches"] == 0 and r["hung_clients"] == 0
    assert r["sessions_left"] and not any(r["sessions_left"].values()), r["sessions_left"]
    assert r["serve_exit_code"] == 0 and r["worker_exits"] == [], r["worker_exits"]
