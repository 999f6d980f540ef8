"""Logging of Baton's processes (baton/logs.py, BATON_LOG_LEVEL / BATON_LOG_JSON in baton/settings.py).

A real `python -m router` subprocess in front of fake workers on loopback (tests/fakes.py): with
BATON_LOG_JSON=1 every stderr line, the per-request line included, is one JSON object; a bad
BATON_LOG_LEVEL is one line naming the variable and exit 2 from every entry point, no traceback; a failed
request's line carries its error message."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from fakes import decode_worker, prefill_worker

from baton.client import Client
from baton.logs import JsonFormatter
from baton.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[1]


def env(**extra) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def test_log_level_is_checked_and_case_free():
    assert Settings.from_env({"BATON_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    with pytest.raises(SettingsError, match="BATON_LOG_LEVEL"):
        Settings.from_env({"BATON_LOG_LEVEL": "verbose"})


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "router", "--port", "0", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
        ["-m", "prefill_worker", "--port", "0"],
        ["-m", "baton", "serve", "--processes", "--port", "0", "--http-port", "0"],
    ],
    ids=["router", "prefill_worker", "serve"],
)
def test_a_bad_log_level_is_one_line_and_exit_2(argv):
    r = subprocess.run(
        [sys.executable, *argv], env=env(BATON_LOG_LEVEL="verbose"), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "BATON_LOG_LEVEL" in lines[0] and "'VERBOSE'" in lines[0], r.stderr


def test_the_json_formatter_escapes_what_it_carries():
    try:
        raise ValueError('a "quoted"\nline')
    except ValueError:
        rec = logging.LogRecord(
            "baton.x", logging.ERROR, __file__, 1, 'request {"id": "%s"}', ("a\tb",), sys.exc_info()
        )
    out = json.loads(JsonFormatter().format(rec))
    assert out["msg"] == 'request {"id": "a\tb"}' and out["level"] == "ERROR" and out["logger"] == "baton.x"
    assert 'ValueError: a "quoted"\nline' in out["exc"]


def test_router_process_json_logs_parse_line_by_line():
    settings = Settings()
    workers = [prefill_worker(settings), decode_worker(settings)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--port", "0", "--prefill", workers[0].address]
        + ["--decode", workers[1].address, "--grace", "1"],
        env=env(BATON_LOG_JSON="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("router: serving on "), line
        address = line.split()[-1]
        with Client(address) as c:
            deadline = time.monotonic() + 10
            while c.health() != "SERVING" and time.monotonic() < deadline:
                time.sleep(0.05)
            got = list(c.generate([5, 6, 7], max_new_tokens=4, request_id="req-\"json\"", timeout=10))
            with pytest.raises(grpc.RpcError):
                list(c.generate([5], max_new_tokens=0, request_id="bad", timeout=10))
        assert sum(len(d.token_ids) for d in got) == 4
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:
            w.stop()
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in err.splitlines() if line.strip()]  # every line is JSON
    chose = [r["msg"] for r in records if r["msg"].startswith("router: model ")]  # what it chose, at start
    assert len(chose) == 1 and "max_inflight=64 queue_timeout=30s call_timeout=30s" in chose[0], err
    assert "auth=off tls=off metrics_port=off http=off" in chose[0], chose
    requests = [r for r in records if r["msg"].startswith("request ")]
    assert len(requests) == 2, err
    ok, bad = (json.loads(r["msg"].removeprefix("request ")) for r in requests)
    assert ok["request_id"] == 'req-"json"' and ok["status"] == "OK" and ok["tokens"] == 4 and "error" not in ok
    # a failed request's line says why (the message its client got), at INFO: the client's mistake
    assert bad["status"] == "INVALID_ARGUMENT" and bad["error"].startswith("max_new_tokens: ")
    assert requests[1]["level"] == "INFO"
