"""HTTP requests refused before they reach the router's Generate are logged: one warning line each (method,
path, client, status, reason), never the body, rate-limited under a flood; Generate's own refusals are left
to the router's request line. A real router in this process (its workers never come up), httpx over loopback.
"""

from __future__ import annotations

import json
import math
import re
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import pick_free_port  # noqa: E402
from helpers import router_without_workers  # noqa: E402

TOKEN = "refusal-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SECRET = "SECRET-PROMPT-TEXT"


@pytest.fixture
def router():
    from router.__main__ import stop_router

    # every Generate: RESOURCE_EXHAUSTED (429) at admission
    handle, servicer = router_without_workers(TOKEN, pick_free_port(), max_inflight=0)
    yield servicer.http.url
    stop_router(handle, servicer, 0.2)


def http_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "baton.router.http"]


CASES = [
    ("POST", "/v1/completions", b'{"prompt": "' + SECRET.encode() + b'", ', 400, "body: not valid JSON"),
    ("POST", "/v1/completions", json.dumps({"prompt": SECRET, "max_tokens": 0}).encode(), 400, "max_tokens:"),
    ("POST", "/v1/completions", json.dumps({"prompt": SECRET, "model": "gpt-x"}).encode(), 404, "model:"),
    ("GET", "/nowhere", b"", 404, "/nowhere: Not Found"),
    ("GET", "/v1/completions", b"", 405, "Method Not Allowed"),
    ("POST", "/tokenize", b"x" * (5 << 20), 413, "over the limit"),
]


@pytest.mark.parametrize("method, path, body, status, reason", CASES)
def test_a_refusal_before_generate_is_one_line_without_the_body(router, caplog, method, path, body, status, reason):
    caplog.set_level("INFO")
    r = httpx.request(method, router + path, content=body, headers=AUTH, timeout=10)
    assert r.status_code == status, (path, r.text)
    lines = http_lines(caplog)
    assert len(lines) == 1, (path, lines)
    assert lines[0].startswith(f"{method} {path} from 127.0.0.1:") and f": {status} " in lines[0], lines
    assert reason in lines[0], lines
    assert SECRET not in caplog.text and "xxxx" not in caplog.text


def test_served_requests_and_generates_refusals_get_no_http_line(router, caplog):
    caplog.set_level("INFO")
    r = httpx.post(router + "/tokenize", json={"prompt": SECRET}, headers=AUTH, timeout=10)  # served
    assert r.status_code == 200 and http_lines(caplog) == []
    r = httpx.post(router + "/v1/completions", json={"prompt": SECRET, "max_tokens": 2}, headers=AUTH, timeout=10)
    assert r.status_code == 429 and http_lines(caplog) == []  # Generate's refusal: the request line has it
    request_lines = [r.getMessage() for r in caplog.records if r.name == "baton.router"]
    assert any('"status": "RESOURCE_EXHAUSTED"' in line for line in request_lines), request_lines


def test_a_path_cannot_forge_a_log_line(router, caplog):
    caplog.set_level("WARNING", logger="baton.router.http")
    r = httpx.get(router + "/a%0A%0D%1B%7F2026 ERROR forged", headers=AUTH, timeout=10)
    assert r.status_code == 404
    (line,) = http_lines(caplog)
    assert not any(c in line for c in "\n\r\x1b\x7f"), line  # uvicorn drops CR / LF; the rest escaped
    assert line.startswith("GET /a\\x1b\\x7f2026 ERROR forged from 127.0.0.1:"), line


def test_a_flood_of_bad_requests_is_rate_limited(router, caplog):
    caplog.set_level("WARNING", logger="baton.router.http")
    t0 = time.monotonic()
    for _ in range(40):
        assert httpx.post(router + "/v1/completions", content=b"{", headers=AUTH, timeout=10).status_code == 400
    elapsed = time.monotonic() - t0
    lines = http_lines(caplog)
    # 5 at once, then one a second: a slow machine's 40 requests take longer, so the bound follows the clock
    assert 1 <= len(lines) <= 5 + math.ceil(elapsed) + 1, (elapsed, lines)
    assert len(lines) < 40, lines
    suppressed = sum(int(m.group(1)) for line in lines if (m := re.search(r"\((\d+) more suppressed\)$", line)))
    assert len(lines) + suppressed <= 40, lines  # every suppressed line is counted into a later one
    metrics = httpx.get(router + "/metrics", headers=AUTH, timeout=10).text
    assert 'baton_router_http_requests_total{endpoint="/v1/completions",status="400"} 40.0' in metrics
