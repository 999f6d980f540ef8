"""The OpenAI-compatible HTTP API (router/http), with the official `openai` package and httpx.

Against a real `baton serve --processes --http-port P` on loopback (the embedded model, window 512, a
token; one per module): completions and chat, streamed and not, equal to gRPC Generate in fast and exact
mode; include_usage counts; finish_reason length / stop (stop token ids and stop strings); streaming is
live (the first chunk arrives while the decode worker still holds the session); a client that leaves
(streaming or not) leaves 0 sessions on both workers; bad input gets its status and an OpenAI-shaped
error and the next request is served; a hypothesis fuzz gets only 200 / 400 / 413 / 429; 16 concurrent
streaming clients (BATON_HTTP_LOAD_CLIENTS=64 for the full size) get only 200 / 429 and lose nothing.
In process, routers without workers (no model compute): 401 on every path but /health, 429 / 503 mapping,
a large body fuzz, TLS, chat templates (the embedded one, and Qwen3.5's published one in tests/router/data),
and the lazy import.
"""

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import pick_free_port
from helpers import self_signed_cert  # noqa: E402

from baton.client import Client  # noqa: E402
from baton.settings import Settings  # noqa: E402
from benchmarks.bench_http import Stack, grpc_text, load, prefill_stats  # noqa: E402
from benchmarks.load import worker_sessions  # noqa: E402

PROMPT = "def fibonacci(n):"
MODEL = "default-model"
DEFAULT_DIR = ROOT / "baton" / "assets" / "default-model"
QWEN35_TEMPLATE = Path(__file__).parent / "data" / "qwen3_5_chat_template.jinja"
TOKEN = "http-test-token"


@pytest.fixture(scope="module")
def stack():
    s = Stack().wait()
    yield s
    assert s.close() == 0


@pytest.fixture(scope="module")
def tok():
    from baton.tokenizer import Tokenizer

    return Tokenizer.from_dir(DEFAULT_DIR)


def post(base: str, path: str, body=None, *, token: str | None, content=None, headers=None, timeout=60.0, **kw):
    h = {"Authorization": f"Bearer {token}"} if token else {}
    h.update(headers or {})
    if content is None:
        content = json.dumps(body)
    return httpx.post(base + path, content=content, headers=h, timeout=timeout, **kw)


def assert_error(r, status: int, field: str | None = None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert {"message", "type", "code"} <= set(err) and isinstance(err["message"], str), err
    if field is not None:
        assert err["message"].startswith(field + ":"), err
    return err


def sessions_settle(stack, timeout: float = 10.0) -> dict:
    end = time.monotonic() + timeout
    while any((left := worker_sessions(stack.workers, stack.token)).values()) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def metric(text: str, line_start: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line_start))


# ---------------------------------------------------------------------------------- real stack
def test_health_models_metrics(stack):
    r = httpx.get(stack.url + "/health", timeout=10)  # no token: a probe
    assert (r.status_code, r.json()) == (200, {"status": "SERVING"})
    models = stack.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {stack.token}"}, timeout=10)
    assert r.status_code == 200 and "baton_router_requests" in r.text and "baton_router_http_requests" in r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_completion_equals_grpc_streamed_or_not(stack, tok, mode):
    want, _ = grpc_text(stack.grpc, stack.token, PROMPT, 12, mode)
    client = stack.openai()
    ext = {"baton": {"mode": mode, "ignore_eos": True}}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body=ext)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(PROMPT)), 12)
    stats = r.model_extra["baton"]["stats"]
    assert stats["request_id"] == r.id and (stats["drafted"] > 0) == (mode == "exact"), stats
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            extra_body=ext,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(tok.encode(PROMPT))


def test_x_request_id_names_the_routers_request_and_comes_back(stack):
    """A client's or gateway's X-Request-Id is the router's request_id (its log line, the Stats) and comes back
    as a response header, streamed or not; n choices get "-i" after it; without one the header is the
    response's id; a bad one is a 400 naming the header and the next request is served."""
    client = stack.openai(max_retries=0)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3)
    raw = client.completions.with_raw_response.create(**kw, extra_headers={"X-Request-Id": "trace-7f3/a"})
    r = raw.parse()
    assert (
        raw.headers["x-request-id"] == "trace-7f3/a" and r.model_extra["baton"]["stats"]["request_id"] == "trace-7f3/a"
    )
    raw = client.completions.with_raw_response.create(**kw, n=2, seed=3, extra_headers={"X-Request-Id": "t-2"})
    assert raw.headers["x-request-id"] == "t-2"
    assert [st["request_id"] for st in raw.parse().model_extra["baton"]["stats"]] == ["t-2-0", "t-2-1"]
    raw = client.completions.with_raw_response.create(**kw)
    assert raw.headers["x-request-id"] == raw.parse().id
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        extra_headers={"X-Request-Id": "stream-1"},
    ) as streamed:
        assert streamed.headers["x-request-id"] == "stream-1" and "[DONE]" in streamed.read().decode()
    for bad_id in ("has space", "x" * 121, "\u00e9t\u00e9".encode()):  # (bytes: sent as they are)
        r = post(
            stack.url,
            "/v1/completions",
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
            token=stack.token,
            headers={"X-Request-Id": bad_id},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id", r.text
    assert client.completions.create(**kw).choices[0].finish_reason == "length"


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(stack, tok):
    """vLLM's stream_options.continuous_usage_stats: every chunk's usage counts the prompt and the tokens sent
    so far (growing to max_tokens), the last chunk the whole; without include_usage it is a 400 naming it."""
    client, n = stack.openai(), len(tok.encode(PROMPT))
    for kind in ("completion", "chat"):
        kw = dict(model=MODEL, max_tokens=10, stream=True, extra_body={"baton": {"ignore_eos": True}})
        kw["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if kind == "chat":
            chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw))
        else:
            chunks = list(client.completions.create(prompt=PROMPT, **kw))
        got = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and got == sorted(got) and got[-1] == 10, got
        assert len(set(got)) > 2 and chunks[-1].choices == []  # it grew chunk by chunk; then the usage chunk
        assert kind == "chat" or {c.usage.prompt_tokens for c in chunks} == {n}
    body = {"prompt": PROMPT, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert_error(
        post(stack.url, "/v1/completions", body, token=stack.token), 400, "stream_options.continuous_usage_stats"
    )


def test_completion_token_prompt_and_batches(stack, tok):
    other = "for i in range("
    want = [grpc_text(stack.grpc, stack.token, p, 6)[0] for p in (PROMPT, other)]
    client = stack.openai()
    ext = {"baton": {"ignore_eos": True}}
    r = client.completions.create(model=MODEL, prompt=tok.encode(PROMPT), max_tokens=6, extra_body=ext)
    assert r.choices[0].text == want[0]
    for prompt in ([PROMPT, other], [tok.encode(PROMPT), tok.encode(other)]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body=ext)
        assert [(c.index, c.text) for c in r.choices] == [(0, want[0]), (1, want[1])]
        assert r.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[PROMPT, other],
            max_tokens=6,
            stream=True,
            extra_body=ext,
            stream_options={"include_usage": True},
        )
    )
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == want and chunks[-1].usage.completion_tokens == 12


def test_chat_streamed_or_not_equals_the_rendered_prompt(stack, tok):
    from router.http.chat import ChatTemplate

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fibonacci"}]
    rendered = ChatTemplate.from_dir(DEFAULT_DIR).render(messages)
    want, _ = grpc_text(stack.grpc, stack.token, rendered, 10)
    client = stack.openai()
    ext = {"baton": {"ignore_eos": True}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, extra_body=ext)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(rendered)), 10)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=ext,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(tok.encode(rendered)), 10)


def test_a_named_tool_choice_through_the_real_model(stack, tok):
    """tool_choice naming a function: the embedded model's template teaches no tool format, so the router
    writes the JSON opening after the rendered prompt; the model's (random) text continues it. 200, a
    finish_reason, tool_calls or content, and the opening never in the content: with greedy decoding the
    content is exactly what the model writes after the opening (gRPC on the same prompt text). /tokenize
    counts the opening as the chat does."""
    from router.http.chat import ChatTemplate

    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    opening = '<tool_call>\n{"name": "get_weather", "arguments":'
    prompt = ChatTemplate.from_dir(DEFAULT_DIR).render(messages) + opening
    want, _ = grpc_text(stack.grpc, stack.token, prompt, 8)
    body = {"model": MODEL, "messages": messages, "tools": [tool], "tool_choice": choice, "max_tokens": 8}
    body["baton"] = {"ignore_eos": True}
    r = post(stack.url, "/v1/chat/completions", body, token=stack.token)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] in ("tool_calls", "length") and (
        c["message"].get("tool_calls") or c["message"]["content"]
    )
    if not c["message"].get("tool_calls"):
        assert c["message"]["content"] == want and "<tool_call>" not in want and c["finish_reason"] == "length"
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    tokenized = post(
        stack.url, "/tokenize", {k: body[k] for k in ("messages", "tools", "tool_choice")}, token=stack.token
    )
    assert tokenized.json()["tokens"] == tok.encode(prompt)
    # without ignore_eos the call's arguments are held to the tool's schema (router/http/tool_grammar.py): the
    # random model writes a whole, valid call, however it is sampled
    unit = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    unit["additionalProperties"] = False
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": unit}}
    client = stack.openai()
    for n, stream in ((2, False), (1, True)):
        kw = dict(
            model=MODEL, messages=messages, tools=[tool], tool_choice=choice, max_tokens=80, temperature=1.0, seed=3
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
            outs = [(text, calls, finish[-1])]
        else:
            res = client.chat.completions.create(n=n, **kw)
            outs = [(ch.message.content, ch.message.tool_calls, ch.finish_reason) for ch in res.choices]
            assert len(outs) == n
        for text, calls, finish in outs:
            assert finish == "tool_calls" and not text, (finish, text)
            args = "".join(c.function.arguments or "" for c in calls)  # streamed: in pieces
            assert calls[0].function.name == "get_weather" and json.loads(args)["unit"] in ("c", "f"), args


def test_continue_final_message_continues_the_assistants_text(stack, tok):
    """vLLM's continue_final_message: the chat rendered without the generation prompt and cut after the last
    message's content, so the model goes on with it: the prompt /tokenize gives ends with that content, and the
    chat's answer is the completion of that text. With add_generation_prompt (its default true) it is a 400
    naming continue_final_message; content the template does not render as given is a 400 naming messages."""
    from router.http.chat import ChatTemplate

    messages = [{"role": "user", "content": "add two numbers"}, {"role": "assistant", "content": "def add(a, b):"}]
    full = ChatTemplate.from_dir(DEFAULT_DIR).render(messages, add_generation_prompt=False)
    want = full[: full.rindex("def add(a, b):") + len("def add(a, b):")]
    assert want != full  # the template closes a message after its content: cut here
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    r = post(stack.url, "/tokenize", body, token=stack.token)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(want)
    client, ext = stack.openai(), {"baton": {"ignore_eos": True}}
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_body={**ext, **body})
    plain = client.completions.create(model=MODEL, prompt=want, max_tokens=8, extra_body=ext)
    assert chat.choices[0].message.content == plain.choices[0].text and chat.usage.prompt_tokens == len(
        tok.encode(want)
    )
    bad = {"messages": messages, "continue_final_message": True}
    assert_error(post(stack.url, "/v1/chat/completions", bad, token=stack.token), 400, "continue_final_message")
    lines = [messages[0], {"role": "assistant", "content": "a\nb"}]  # rendered as "a\n# b" by this template
    body = {"messages": lines, "add_generation_prompt": False, "continue_final_message": True}
    assert_error(post(stack.url, "/v1/chat/completions", body, token=stack.token), 400, "messages")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(stack, tok):
    """vLLM's truncate_prompt_tokens: k keeps the prompt's last k tokens (the same answer as those tokens sent
    as the prompt; echo shows them); -1 keeps what the window leaves beside max_tokens, so a prompt far too long
    is served; other values are a 400 naming the field."""
    client, ext = stack.openai(), {"baton": {"ignore_eos": True}}
    ids = tok.encode(PROMPT)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, echo=True, extra_body={**ext, "truncate_prompt_tokens": 3}
    )
    want = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=6, extra_body=ext).choices[0].text
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == tok.decode(ids[-3:]) + want
    usable = client.models.list().data[0].model_extra["max_model_len"]
    long = (PROMPT + " ") * (usable // len(ids) + 20)
    assert_error(post(stack.url, "/v1/completions", {"prompt": long, "max_tokens": 4}, token=stack.token), 400)
    r = client.completions.create(
        model=MODEL, prompt=long, max_tokens=4, extra_body={**ext, "truncate_prompt_tokens": -1}
    )
    assert r.usage.prompt_tokens == usable - 4 and r.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x " * 50}], max_tokens=2,
        extra_body={**ext, "truncate_prompt_tokens": 5},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 5
    for k in (0, -2, "3", usable):
        body = {"prompt": PROMPT, "max_tokens": 2, "truncate_prompt_tokens": k}
        assert_error(post(stack.url, "/v1/completions", body, token=stack.token), 400, "truncate_prompt_tokens")


def test_a_model_card_by_id_and_the_version(stack):
    """OpenAI's retrieve (GET /v1/models/{id}: the card /v1/models lists, the openai client's models.retrieve)
    and a 404 naming model for another id; vLLM's GET /version: Baton's installed version."""
    from importlib.metadata import version

    client = stack.openai()
    listed = client.models.list().data[0]
    got = client.models.retrieve(MODEL)
    assert got.id == MODEL == listed.id and got.model_extra["max_model_len"] == listed.model_extra["max_model_len"]
    auth = {"Authorization": f"Bearer {stack.token}"}
    assert_error(httpx.get(stack.url + "/v1/models/other-model", headers=auth, timeout=10), 404, "model")
    r = httpx.get(stack.url + "/version", headers=auth, timeout=10)
    assert r.status_code == 200 and r.json() == {"version": version("baton")}


def test_tokenize_and_detokenize(stack, tok):
    """/tokenize gives the ids a completion (prompt) or a chat (messages, rendered by the template) sends, and
    the window; /detokenize turns ids back into text; bad bodies are 400 naming the field, a wrong model 404."""
    from router.http.chat import ChatTemplate

    def call(path, body):
        return post(stack.url, path, body, token=stack.token)

    r = call("/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert (
        r.status_code == 200
        and r.json()["tokens"] == tok.encode(PROMPT)
        and r.json()["count"] == len(tok.encode(PROMPT))
    )
    assert r.json()["max_model_len"] == stack.openai().models.list().data[0].model_extra["max_model_len"]
    messages = [{"role": "user", "content": "fibonacci"}]
    rendered = ChatTemplate.from_dir(DEFAULT_DIR).render(messages)
    assert call("/tokenize", {"messages": messages}).json()["tokens"] == tok.encode(rendered)
    chat = stack.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens == len(tok.encode(rendered))
    d = call("/detokenize", {"tokens": tok.encode(PROMPT)})
    assert d.status_code == 200 and d.json() == {"prompt": PROMPT}
    for path, body, status, field in (
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": messages}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": "x"}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**8]}, 400, "tokens"),
    ):
        assert_error(call(path, body), status, field)
    assert post(stack.url, "/tokenize", {"prompt": "x"}, token=None).status_code == 401


def test_finish_reason_stop_on_a_token_and_on_a_string(stack):
    with Client(stack.grpc, token=stack.token) as c:
        deltas = list(c.generate(PROMPT, max_new_tokens=24, ignore_eos=True))
    ids, text = [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)
    client = stack.openai()
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        extra_body={"baton": {"ignore_eos": True, "stop_token_ids": [ids[3]]}},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(ids[3]) + 1
    assert r.choices[0].model_extra["stop_reason"] == ids[3]  # vLLM's: the stop token id
    stop = text[10:13]
    cut = text.find(stop)
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        stop=[stop, "never-there"],
        extra_body={"baton": {"ignore_eos": True}},
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text[:cut], "stop")
    assert r.usage.completion_tokens < 24 and r.choices[0].model_extra["stop_reason"] == stop  # ... the string
    with Client(stack.grpc, token=stack.token) as c:  # gRPC: the last message names it
        last = list(c.generate(PROMPT, max_new_tokens=24, ignore_eos=True, stop=[stop, "never-there"]))[-1]
    assert (last.finish_reason, last.stop_string) == ("STOP", stop)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            stop=stop,
            stream=True,
            extra_body={"baton": {"ignore_eos": True}},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text[:cut] and chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"baton": {"ignore_eos": True}})
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("length", None)
    assert not any(sessions_settle(stack).values())


def test_sampling_seed_and_logprobs_equal_grpc(stack):
    """OpenAI's sampling fields reach the router's SamplingParams: the same seed gives gRPC's tokens,
    logprobs in the completion and chat shapes are the router's."""
    kw = dict(temperature=0.9, top_p=0.95, seed=17)
    with Client(stack.grpc, token=stack.token) as c:
        deltas = list(c.generate(PROMPT, max_new_tokens=10, ignore_eos=True, logprobs=3, **kw))
    text, lps = "".join(d.text for d in deltas), [e for d in deltas for e in d.logprobs]
    client = stack.openai()
    ext = {"baton": {"ignore_eos": True}}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logprobs=3, extra_body=ext, **kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and r.model_extra["baton"]["stats"]["seed"] == 17
    assert lp.token_logprobs == pytest.approx([v for _, v, _ in lps], abs=1e-6) and len(lp.tokens) == 10
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, stream=True, extra_body=ext, **kw)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6, extra_body=ext, **kw)
    a = client.chat.completions.create(logprobs=True, top_logprobs=2, **chat)
    content = a.choices[0].logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    b = client.chat.completions.create(**chat)
    assert a.choices[0].message.content == b.choices[0].message.content and b.choices[0].logprobs is None


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_responses_equal_chat_completions(stack, mode):
    """POST /v1/responses through the real model with the openai client: the same tokens as the chat
    completion of the equivalent messages (instructions = a system message), streamed or not, greedy or
    seeded; its logprobs the chat's; text.format json_schema follows its schema (router/http/responses.py)."""
    client = stack.openai()
    ext = {"baton": {"ignore_eos": True, "mode": mode}}
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fibonacci"}]
    for kw in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 5}):
        chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, extra_body=ext, **kw)
        seed = {"seed": kw["seed"]} if kw else {}
        r = client.responses.create(
            model=MODEL, instructions="You write Python.", input="fibonacci", max_output_tokens=12,
            extra_body={**ext, **seed}, **{k: v for k, v in kw.items() if k != "seed"},
        )  # fmt: skip
        assert r.output_text == chat.choices[0].message.content and r.status == "incomplete"
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
        events = list(
            client.responses.create(
                model=MODEL, instructions="You write Python.", input=[{"role": "user", "content": "fibonacci"}],
                max_output_tokens=12, stream=True, extra_body={**ext, **seed},
                **{k: v for k, v in kw.items() if k != "seed"},
            )
        )  # fmt: skip
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=2)
    r = client.responses.create(
        model=MODEL, instructions="You write Python.", input="fibonacci", max_output_tokens=6,
        include=["message.output_text.logprobs"], top_logprobs=2,
    )  # fmt: skip
    got = r.output[0].content[0].logprobs
    want = a.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in got] == [(x.token, x.logprob) for x in want] and len(got) == 6
    assert all(len(x.top_logprobs) == 2 for x in got)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "name": "n", "schema": schema, "strict": True}
    r = client.responses.create(model=MODEL, input="A number as JSON", max_output_tokens=40, text={"format": fmt})
    v = json.loads(r.output_text)
    assert set(v) == {"n"} and isinstance(v["n"], int) and r.status == "completed"


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_messages_equal_chat_completions(stack, mode):
    """POST /v1/messages through the real model with the anthropic client: the same tokens as the chat
    completion of the equivalent messages (system = a system message), streamed or not; count_tokens is its
    input; the same request seeded samples the chat's tokens (router/http/messages.py)."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=stack.url, api_key=stack.token, max_retries=0)
    ext = {"baton": {"ignore_eos": True, "mode": mode}}
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fibonacci"}]
    kw = dict(model=MODEL, system="You write Python.", messages=[{"role": "user", "content": "fibonacci"}])
    for sampling in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 5}):
        chat = stack.openai().chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=12, extra_body={**ext}, **sampling
        )
        extra = {**ext, **sampling}  # (this client's create() takes no temperature: the body does)
        m = client.messages.create(max_tokens=12, extra_body=extra, **kw)
        assert m.content[0].text == chat.choices[0].message.content and m.stop_reason == "max_tokens"
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
        with client.messages.stream(max_tokens=12, extra_body=extra, **kw) as stream:
            assert "".join(stream.text_stream) == m.content[0].text
    count = client.messages.count_tokens(**kw)
    assert count.input_tokens == chat.usage.prompt_tokens
    if mode == "fast":  # Anthropic clients ask for 32,000: capped to what the window leaves, cut as max_tokens
        usable = stack.openai().models.list().data[0].model_extra["max_model_len"]
        with client.messages.stream(max_tokens=32000, extra_body={"baton": {"ignore_eos": True}}, **kw) as stream:
            m = stream.get_final_message()
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == usable - count.input_tokens


def test_n_choices_share_one_prefill(stack):
    """The n choices of a prompt reach the prefill worker together and are computed once (their pass
    shares equal prompts: baton/engine/prefill.py shared_pieces): its prompt tokens computed grow by
    fewer than n prompts' worth, and each choice is still the seeded single request's text."""
    client, ext = stack.openai(), {"baton": {"ignore_eos": True}}
    kw = dict(model=MODEL, max_tokens=4, temperature=1.0, extra_body=ext)
    prompt = "def fibonacci(n):\n    return"
    alone = [client.completions.create(prompt=prompt, seed=70 + j, **kw).choices[0].text for j in range(4)]
    before = prefill_stats(stack)
    r = client.completions.create(prompt=prompt, n=4, seed=70, **kw)
    after = prefill_stats(stack)
    assert [c.text for c in r.choices] == alone
    computed, pieces = after.prefill_tokens - before.prefill_tokens, after.prefill_pieces - before.prefill_pieces
    assert pieces == 4 and computed < 4 * r.usage.prompt_tokens, (computed, r.usage.prompt_tokens)


def test_n_choices_each_a_seeded_generate(stack):
    """n choices per prompt: with a seed S, choice j equals one request with seed S + j (so the response
    replays and the choices differ); greedy choices are all the greedy text; indexes run prompt * n + j, and
    usage counts each prompt once; streamed, every choice arrives under its index."""
    client, ext = stack.openai(), {"baton": {"ignore_eos": True}}
    other = "for i in range("
    kw = dict(model=MODEL, max_tokens=8, temperature=1.0, extra_body=ext)
    alone = {
        (p, s): client.completions.create(prompt=p, seed=s, **kw).choices[0].text
        for p in (PROMPT, other)
        for s in (40, 41, 42)
    }
    r = client.completions.create(prompt=[PROMPT, other], n=3, seed=40, **kw)
    assert [(c.index, c.text) for c in r.choices] == [
        (i * 3 + j, alone[(p, 40 + j)]) for i, p in enumerate((PROMPT, other)) for j in range(3)
    ]
    assert len({c.text for c in r.choices[:3]}) > 1  # distinct seeds, distinct samples
    single = client.completions.create(prompt=[PROMPT, other], seed=40, **kw)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens and r.usage.completion_tokens == 6 * 8
    assert [s["seed"] for s in r.model_extra["baton"]["stats"]] == [40, 41, 42] * 2
    chunks = list(client.completions.create(prompt=PROMPT, n=3, seed=40, stream=True, **kw))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == j) for j in range(3)] == [
        alone[(PROMPT, 40 + j)] for j in range(3)
    ]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6, n=2, extra_body=ext
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[
        1
    ].message.content  # greedy


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(stack):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it (as much text and as
    many tokens as without it, plus the string), streamed or not; the default ends just before it."""
    client, ext = stack.openai(), {"baton": {"ignore_eos": True}}
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, extra_body=ext).choices[0].text
    stop = text[10:13]
    cut = text.find(stop)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop])
    plain = client.completions.create(**kw, extra_body=ext)
    both = client.completions.create(**kw, extra_body={**ext, "include_stop_str_in_output": True})
    assert plain.choices[0].text == text[:cut] and both.choices[0].text == text[: cut + len(stop)]
    assert both.choices[0].finish_reason == "stop" and both.usage.completion_tokens == plain.usage.completion_tokens
    chunks = client.completions.create(**kw, stream=True, extra_body={**ext, "include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[: cut + len(stop)]


def test_skip_special_tokens_false_keeps_an_eos_in_the_text(stack, tok):
    """vLLM's skip_special_tokens: false puts special tokens in the text (here an EOS, forced first by logit_bias:
    the request stops on it); by default the text leaves it out. token_ids are the same either way (gRPC)."""
    eos = tok.eos_token_ids[0]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={str(eos): 100})
    client = stack.openai()
    plain = client.completions.create(**kw)
    kept = client.completions.create(**kw, extra_body={"skip_special_tokens": False})
    assert plain.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert plain.choices[0].text == "" and kept.choices[0].text == tok.decode([eos]) != ""
    with Client(stack.grpc, token=stack.token) as c:
        a = list(c.generate(PROMPT, max_new_tokens=4, logit_bias={eos: 100.0}))
        b = list(c.generate(PROMPT, max_new_tokens=4, logit_bias={eos: 100.0}, skip_special_tokens=False))
    assert [t for d in a for t in d.token_ids] == [t for d in b for t in d.token_ids] == [eos]
    assert "".join(d.text for d in a) == "" and "".join(d.text for d in b) == tok.decode([eos])


def test_logit_bias_equals_grpc_and_changes_the_output(stack, tok):
    """OpenAI's logit_bias ({"token id": value}) reaches the router's SamplingParams: the same text as gRPC with
    the same bias, and banning the greedy answer's first token changes it."""
    client, ext = stack.openai(), {"baton": {"ignore_eos": True}}
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=ext).choices[0].text
    first = tok.encode(plain)[0]
    with Client(stack.grpc, token=stack.token) as c:
        want = "".join(
            d.text for d in c.generate(PROMPT, max_new_tokens=8, ignore_eos=True, logit_bias={first: -100.0})
        )
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, logit_bias={str(first): -100}, extra_body=ext
    )
    assert r.choices[0].text == want != plain


def test_min_tokens_equals_grpc_and_holds_the_stop_ids_back(stack, tok):
    """vLLM's min_tokens reaches the router's SamplingParams: with a stop token id the plain answer ends at, the
    answer goes on past it for min_tokens tokens, the same text as gRPC with the same min_tokens."""
    client = stack.openai()
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True})
    sid = tok.encode(plain.choices[0].text)[1]
    ext = {"ignore_eos": True, "stop_token_ids": [sid]}
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body=ext)
    assert short.usage.completion_tokens <= 2  # so this test can fail
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={**ext, "min_tokens": 8})
    with Client(stack.grpc, token=stack.token) as c:
        want = list(c.generate(PROMPT, max_new_tokens=12, ignore_eos=True, stop_token_ids=[sid], min_tokens=8))
    assert r.choices[0].text == "".join(d.text for d in want)
    assert r.usage.completion_tokens == sum(len(d.token_ids) for d in want) >= 8


def test_structured_outputs_follow_their_grammar_and_equal_grpc(stack, tok):
    """OpenAI's response_format (json_schema, json_object) and vLLM's guided_choice / guided_regex /
    structured_outputs reach SamplingParams.structured: chat and completions outputs follow the grammar, the
    same text as gRPC with the same StructuredOutput."""
    client = stack.openai()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    msgs = [{"role": "user", "content": "A number as JSON"}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=0.8, seed=4,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )  # fmt: skip
    v = json.loads(r.choices[0].message.content)
    assert set(v) == {"n"} and isinstance(v["n"], int) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=30, extra_body={"guided_choice": ["alpha", "beta", "gamma"]}
    )
    assert r.choices[0].text in ("alpha", "beta", "gamma") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", r.choices[0].text)
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, seed=2, extra_body={"response_format": fmt}
    )
    with Client(stack.grpc, token=stack.token) as c:
        want = "".join(
            d.text for d in c.generate(PROMPT, max_new_tokens=24, seed=2, structured={"json_schema": schema})
        )
    assert r.choices[0].text == want and want.lstrip().startswith("{")
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, response_format={"type": "json_object"}
    )
    assert r.choices[0].message.content.lstrip().startswith("{")


def test_echo_with_prompt_logprobs_scores_a_continuation(stack, tok):
    """echo: the prompt's text first; with logprobs N, its tokens too: token_logprobs[0] is null, then each
    prompt token's logprob given those before it (gRPC's prompt_logprobs), then the generated tokens'. What
    lm-evaluation-harness reads to score a continuation (sum of token_logprobs[ctxlen:-1], greedy check)."""
    client, ext = stack.openai(), {"baton": {"ignore_eos": True}}
    ctx, cont = "def fibonacci(n):", "\n    return n"
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=ext).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, extra_body=ext)
    assert echoed.choices[0].text == PROMPT + plain
    ids = tok.encode(ctx + cont)
    with Client(stack.grpc, token=stack.token) as c:
        first = next(iter(c.generate(ids, max_new_tokens=1, prompt_logprobs=1)))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1 and r.choices[0].text.startswith(ctx + cont)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([v for _, v, _ in first.prompt_logprobs], abs=1e-6)
    assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    ctxlen = len(tok.encode(ctx))
    score = sum(lp.token_logprobs[ctxlen:-1])
    assert score == pytest.approx(sum(v for _, v, _ in first.prompt_logprobs[ctxlen - 1 :]), abs=1e-4) and score < 0
    streamed = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, stream=True, extra_body=ext)
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == PROMPT + plain


def test_penalties_equal_grpc_and_change_the_output(stack):
    """OpenAI's presence_penalty / frequency_penalty and vLLM's repetition_penalty reach the router's
    SamplingParams: the same tokens as gRPC with them, and not the tokens without them."""
    pen = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)
    with Client(stack.grpc, token=stack.token) as c:
        text = "".join(d.text for d in c.generate(PROMPT, max_new_tokens=16, ignore_eos=True, **pen))
        plain = "".join(d.text for d in c.generate(PROMPT, max_new_tokens=16, ignore_eos=True))
    assert text != plain
    client, ext = stack.openai(), {"baton": {"ignore_eos": True}}
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        presence_penalty=0.5,
        frequency_penalty=1.0,
        extra_body={**ext, "repetition_penalty": 1.3},
    )
    assert r.choices[0].text == text


def test_streaming_is_live(stack):
    """Content chunks arrive while the decode worker still holds the request's session (it releases it after
    the last token): an order of events, not a time. (The very first may come before the state has landed
    there: docs/CONTRACTS.md, "Early first token"; so the first few chunks are looked at.)"""
    stream = stack.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=48,
        stream=True,
        extra_body={"baton": {"ignore_eos": True}},
    )
    seen, content_chunks = [], 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            content_chunks += 1
            if len(seen) < 4:
                seen.append(worker_sessions(stack.workers, stack.token)["decode-0"])
    assert 1 in seen, f"no chunk came while the decode worker held the session ({seen})"
    assert content_chunks > 2


def test_a_client_that_leaves_releases_both_workers_sessions(stack):
    base = metric(
        httpx.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {stack.token}"}).text,
        'baton_router_requests_total{mode="fast",status="CANCELLED"}',
    )
    stream = stack.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=400, stream=True, extra_body={"baton": {"ignore_eos": True}}
    )
    it = iter(stream)
    next(it), next(it)
    end = time.monotonic() + 5  # the first token may come before the state lands on the decode worker
    while worker_sessions(stack.workers, stack.token)["decode-0"] != 1 and time.monotonic() < end:
        time.sleep(0.02)
    assert worker_sessions(stack.workers, stack.token)["decode-0"] == 1
    stream.close()
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up
        post(
            stack.url,
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 400, "baton": {"ignore_eos": True}},
            token=stack.token,
            timeout=1.0,
        )
    responses = stack.openai().responses.create(  # the Responses API's stream, left mid-way
        model=MODEL, input=PROMPT, max_output_tokens=400, stream=True, extra_body={"baton": {"ignore_eos": True}}
    )
    it = iter(responses)
    while next(it).type != "response.output_text.delta":
        pass
    responses.close()
    left = sessions_settle(stack)
    assert not any(left.values()), left
    text = httpx.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {stack.token}"}).text
    assert metric(text, 'baton_router_requests_total{mode="fast",status="CANCELLED"}') == base + 3


BAD = [  # (path, body or raw bytes, status, the field the message starts with)
    ("/v1/completions", b"{not json", 400, "body"),
    ("/v1/completions", b"\xff\xfe\x00", 400, "body"),
    ("/v1/completions", [1, 2], 400, "body"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100000}, 400, "max_tokens"),  # the router's limit
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 490}, 400, "max_tokens"),  # past the window
    ("/v1/completions", {"prompt": [7] * 600}, 400, "prompt"),  # the router's window
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt"),  # out of the vocabulary
    ("/v1/completions", {"prompt": [1, -1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [PROMPT, 3]}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 101}, 400, "temperature"),  # the router's range
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "min_p": -1}, 400, "min_p"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 2.5}, 400, "presence_penalty"),  # the router's range
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": 9}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": -1}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": "x"}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": [1]}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 200}}, 400, "logit_bias[5]"),  # the router's range
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),  # the vocabulary
    ("/v1/completions", {"prompt": [PROMPT] * 5, "n": 13}, 400, "n"),  # 65 choices
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1.5}, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["x"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "baton": {"mode": "slow"}}, 400, "baton.mode"),
    ("/v1/completions", {"prompt": PROMPT, "baton": {"engine": "int4"}}, 400, "baton.engine"),
    ("/v1/completions", {"prompt": PROMPT, "baton": {"mode": "exact", "draft_block": 99}}, 400, "baton.draft_block"),
    ("/v1/completions", {"prompt": PROMPT, "baton": {"colour": 1}}, 400, "baton.colour"),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0]",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools[0]",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 20000}]}, 400, "messages"),
    # what OpenAI / vLLM users may send that Baton does not do: refused, not silently ignored
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "xml"}}, 400, "response_format"),
    (
        "/v1/completions",
        {"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format.json_schema.schema",
    ),
    ("/v1/completions", {"prompt": PROMPT, "guided_regex": "(open"}, 400, "guided_regex"),  # the workers' compiler
    ("/v1/completions", {"prompt": PROMPT, "guided_json": "[1]"}, 400, "guided_json"),  # the router's check
    ("/v1/completions", {"prompt": PROMPT, "guided_choice": ["a"], "guided_regex": "b"}, 400, "guided_choice"),
    ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, None),
    (
        "/v1/completions",
        {"prompt": PROMPT, "guided_choice": ["a"], "baton": {"ignore_eos": True}},
        400,
        "guided_choice",
    ),
    ("/v1/completions", {"prompt": PROMPT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/completions", {"prompt": PROMPT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 17}, 400, "min_tokens"),  # over max_tokens (16)
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": PROMPT, "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "include_stop_str_in_output": 1}, 400, "include_stop_str_in_output"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 9}, 400, "n"),  # the stack's workers hold 8 sessions each
    ("/v1/completions", {"prompt": [PROMPT] * 3, "n": 3}, 400, "n"),
]


def test_bad_input_gets_its_status_and_the_next_request_is_served(stack):
    for path, body, status, field in BAD:
        raw = body if isinstance(body, bytes) else None
        r = post(stack.url, path, body, token=stack.token, content=raw)
        assert_error(r, status, field)
    big = json.dumps({"prompt": "a" * (4 << 20)})
    assert_error(post(stack.url, "/v1/completions", token=stack.token, content=big), 413)
    chunked = (b"x" * 65536 for _ in range(70))  # no Content-Length: counted as it arrives
    assert_error(post(stack.url, "/v1/completions", token=stack.token, content=chunked), 413)
    auth = {"Authorization": f"Bearer {stack.token}"}
    assert assert_error(httpx.get(stack.url + "/v1/completions", headers=auth), 405)["code"] == "method_not_allowed"
    assert assert_error(httpx.get(stack.url + "/v2/nothing", headers=auth), 404)["code"] == "not_found"
    r = stack.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    assert r.usage.completion_tokens >= 1 and httpx.get(stack.url + "/health").status_code == 200


def _body_strategy(valid_model: bool = True):
    small = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=False), st.text(max_size=8))
    value = st.recursive(
        small, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=6
    )
    prompt = st.one_of(
        st.text(max_size=30),
        st.lists(st.integers(-2, 9000), max_size=6),
        st.lists(st.text(max_size=10), max_size=3),
        value,
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "x"]),
            "content": st.one_of(st.text(max_size=20), value),
        }
    )
    fields = {
        "prompt": prompt,
        "messages": st.one_of(st.lists(message, max_size=3), value),
        "max_tokens": st.one_of(st.integers(-1, 3), value),
        "stream": st.one_of(st.booleans(), value),
        "temperature": st.one_of(st.just(0), value),
        "top_p": st.one_of(st.just(1), value),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), value),
        "n": value,
        "seed": value,
        "logprobs": value,
        "stream_options": value,
        "user": value,
        "chat_template_kwargs": value,
        "model": st.sampled_from([MODEL]) if valid_model else value,
        "baton": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "mode": st.sampled_from(["fast", "exact", "x"]),
                    "engine": st.sampled_from(["bf16", "fp8", "mtp"]),
                    "draft_block": st.integers(-1, 20),
                    "ignore_eos": st.booleans(),
                    "stop_token_ids": st.lists(st.integers(-1, 9000), max_size=3),
                },
            ),
            value,
        ),
    }
    return st.one_of(st.fixed_dictionaries({}, optional=fields), value)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=_body_strategy())
def test_fuzz_against_the_real_stack_never_500(stack, path, body):
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 3)
    elif isinstance(body, dict):
        body["max_tokens"] = 2
    r = post(stack.url, path, body, token=stack.token)
    assert r.status_code in (200, 400, 413, 429), (body, r.status_code, r.text)
    if r.status_code != 200:
        assert_error(r, r.status_code)


def test_concurrent_streaming_clients_get_200_or_429_and_lose_nothing(stack):
    clients = int(os.environ.get("BATON_HTTP_LOAD_CLIENTS", "16"))
    r = load(stack, clients=clients, seconds=6.0, n=8)
    print("\nhttp load:", json.dumps({k: v for k, v in r.items() if k != "differing_examples"}))
    assert set(r["status"]) <= {"200", "429"}, r["status"]
    assert r["completed"] >= 4 and r["hung_clients"] == 0, r
    assert (r["streams_differing"], r["usage_mismatches"]) == (0, 0), r["differing_examples"]
    left = sessions_settle(stack)
    assert not any(left.values()), left


# ---------------------------------------------------------------------------------- in process (no workers)
class Bare:
    """A router in this process whose workers never come up (nothing listens on port 9): no model compute."""

    def __init__(self, *, max_inflight: int = 4, token: str | None = TOKEN, model_dir=DEFAULT_DIR, settings=None):
        from router.__main__ import serve_router
        from router.service import RouterConfig

        self.handle, self.servicer = serve_router(
            prefill=["127.0.0.1:9"],
            decode=["127.0.0.1:9"],
            model_dir=str(model_dir),
            port=0,
            settings=settings or Settings(token=token),
            config=RouterConfig(max_inflight=max_inflight),
            http_port=pick_free_port(),
        )
        self.url = self.servicer.http.url

    def close(self):
        from router.__main__ import stop_router

        stop_router(self.handle, self.servicer, 0.5)


@pytest.fixture(scope="module")
def refusing():
    """max_inflight=0: every Generate is RESOURCE_EXHAUSTED at admission, so valid bodies get 429."""
    b = Bare(max_inflight=0)
    yield b
    b.close()


def test_401_on_every_endpoint_but_health(refusing):
    paths = [
        ("GET", "/v1/models"),
        ("GET", "/v1/models/x"),
        ("GET", "/version"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("GET", "/nowhere"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ]
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"bearer {TOKEN}x"},
    ):
        for method, path in paths:
            r = httpx.request(method, refusing.url + path, headers=headers, content=b"{}", timeout=10)
            assert assert_error(r, 401, "authorization")["type"] == "authentication_error"
    r = httpx.get(refusing.url + "/health", timeout=10)  # no token needed; no workers: NOT_SERVING
    assert (r.status_code, r.json()) == (503, {"status": "NOT_SERVING"})
    assert refusing.url.startswith("http://127.0.0.1:")


def test_a_refused_request_is_one_warning_line_rate_limited(caplog):
    caplog.set_level("WARNING", logger="baton.router.http")
    b = Bare()
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(b.url + "/v1/completions", headers=headers, content=b"{}", timeout=10)
            assert r.status_code == 401
        lines = [r.getMessage() for r in caplog.records if r.name == "baton.router.http"]
        assert len(lines) == 2 and lines[0].startswith("refused POST /v1/completions from 127.0.0.1:"), lines
        assert "no Authorization" in lines[0] and lines[1].endswith(": a wrong bearer token (401)")
        caplog.clear()
        for _ in range(30):  # a flood: a few lines, then one a second
            httpx.get(b.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert 1 <= len([r for r in caplog.records if r.name == "baton.router.http"]) <= 6
    finally:
        b.close()


def test_router_statuses_map_to_http(refusing):
    import grpc

    from router.http.errors import ApiError

    body = {"prompt": PROMPT, "max_tokens": 2}
    err = assert_error(post(refusing.url, "/v1/completions", body, token=TOKEN), 429)
    assert "max_inflight" in err["message"] and err["type"] == "rate_limit_error"
    bare = Bare(max_inflight=4)
    try:
        err = assert_error(post(bare.url, "/v1/completions", body, token=TOKEN), 503)
        assert "no prefill worker" in err["message"]
        assert_error(
            post(bare.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, token=TOKEN), 503
        )
    finally:
        bare.close()
    C = grpc.StatusCode
    got = {
        c: ApiError.from_status(c, "x").status
        for c in (
            C.INVALID_ARGUMENT,
            C.UNAUTHENTICATED,
            C.RESOURCE_EXHAUSTED,
            C.UNAVAILABLE,
            C.DEADLINE_EXCEEDED,
            C.OUT_OF_RANGE,
            C.INTERNAL,
        )
    }
    assert list(got.values()) == [400, 401, 429, 503, 504, 500, 500]
    assert (
        ApiError.from_status(C.INVALID_ARGUMENT, "max_new_tokens: 9 > 8", {"max_new_tokens": "max_tokens"}).message
        == "max_tokens: 9 > 8"
    )


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    body=st.one_of(_body_strategy(), st.binary(max_size=40)),
)
def test_fuzz_bodies_only_200_400_413_429(refusing, path, body):
    raw = body if isinstance(body, bytes) else None
    r = post(refusing.url, path, body, token=TOKEN, content=raw)
    assert r.status_code in (200, 400, 413, 429), (body, r.status_code, r.text)
    if r.status_code != 200:  # a valid /tokenize or /detokenize body; the generating paths refuse (429)
        assert_error(r, r.status_code)


def test_tls_from_the_routers_settings(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    bare = Bare(settings=Settings(token=TOKEN, tls_cert=cert, tls_key=key))
    try:
        assert bare.url.startswith("https://127.0.0.1:")
        r = httpx.get(
            bare.url + "/v1/models",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
            verify=ssl.create_default_context(cafile=cert),
        )
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        with pytest.raises(httpx.ConnectError):  # plaintext or an untrusted certificate
            httpx.get(bare.url + "/health", timeout=10)
    finally:
        bare.close()


# ---------------------------------------------------------------------------------- chat templates
def _limits(tok, template):
    from router.http.schemas import Limits

    return Limits(MODEL, 4096, 16, tok, template)


# The published Qwen3.5 template, byte for byte (provenance: tests/router/data/README.md). The expected
# strings below are written from the template's logic, not copied from a render.
QWEN35_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
QWEN35_TOOLS_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and do "
    "not tell the user about function calls\n"
    "</IMPORTANT>"
)


@pytest.fixture(scope="module", params=["chat_template.jinja", "tokenizer_config.json"])
def qwen35(request, tmp_path_factory):
    """The Qwen3.5 template as a model directory ships it: chat_template.jinja, or tokenizer_config.json's."""
    from router.http.chat import ChatTemplate

    d = tmp_path_factory.mktemp("qwen35")
    source = QWEN35_TEMPLATE.read_bytes().decode("utf-8")
    cfg = {"eos_token": "<|im_end|>", "bos_token": None}
    if request.param == "chat_template.jinja":
        (d / "chat_template.jinja").write_text(source, encoding="utf-8")
    else:
        cfg["chat_template"] = source
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTemplate.from_dir(d)
    assert t.source == source
    return t


def test_qwen35_fixture_is_the_published_text():
    import hashlib

    data = QWEN35_TEMPLATE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == QWEN35_SHA256, "the fixture must stay the published bytes"
    assert data.startswith(b"{%- set image_count = namespace(value=0) %}\n") and data.endswith(b"{%- endif %}")


def test_qwen35_generation_prompt_and_enable_thinking(qwen35):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen35.render(msgs) == head + "<think>\n"  # enable_thinking undefined: thinking on
    assert qwen35.render(msgs, kwargs={"enable_thinking": True}) == head + "<think>\n"
    assert qwen35.render(msgs, kwargs={"enable_thinking": False}) == head + "<think>\n\n</think>\n\n"
    assert qwen35.render(msgs, add_generation_prompt=False) == head.removesuffix("<|im_start|>assistant\n")
    # no system message: none is invented; content is trimmed; text parts are joined by the template
    parts = [{"role": "user", "content": [{"type": "text", "text": " Hi "}, {"type": "text", "text": "there"}]}]
    assert qwen35.render(parts) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_qwen35_multi_turn_keeps_reasoning_only_after_the_last_user_query(qwen35):
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"},  # reasoning inline, in content
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\n  add them  \n"},  # reasoning as a field
        {"role": "user", "content": "Bye"},
    ]
    assert qwen35.render(turns, kwargs={"enable_thinking": False}) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"  # before the last user query: the thinking is dropped
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # after the last user query (an agent's tool loop) the reasoning is kept, trimmed, in a <think> block
    loop = turns[:3] + [
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "\n  add them  \n"},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    assert qwen35.render(loop, add_generation_prompt=False).endswith(
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\nLet me check.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
    )


def test_qwen35_tools_tool_calls_and_tool_responses(qwen35):
    """The template's tool syntax (tojson, |items, |safe, loop.previtem / nextitem): the renderer's own test;
    `tools` and `tool_calls` through the HTTP API: tests/router/test_http_tools.py."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city, e.g. Zürich",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    call2 = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}}}
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Two calls.",
            "tool_calls": [call, call2],
        },
        {"role": "tool", "content": "Paris: 18C"},
        {"role": "tool", "content": "Rome: 24C"},
    ]
    tool_json = (
        '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city, '
        'e.g. Zürich", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}}}'
    )
    system = (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + tool_json
        + "\n</tools>"
        + QWEN35_TOOLS_INSTRUCTIONS
        + "\n\nBe brief.<|im_end|>\n"
    )
    calls = (
        "\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
        "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
    )
    assert qwen35.render(msgs, tools=[tool]) == (
        system
        + "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        + "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\nLet me check."
        + calls
        + "<|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\nParis: 18C\n</tool_response>"
        + "\n<tool_response>\nRome: 24C\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n<think>\n"
    )
    # without a system message the tools block stands alone; an assistant call with no text has no blank line
    bare = [msgs[1], {"role": "assistant", "content": None, "tool_calls": [call]}, msgs[3]]
    assert qwen35.render(bare, tools=[tool], add_generation_prompt=False) == (
        system.removesuffix("\n\nBe brief.<|im_end|>\n")
        + "<|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        + "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        + "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\nParis: 18C\n</tool_response><|im_end|>\n"
    )


def test_qwen35_template_refusals(qwen35):
    from router.http.chat import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="No user query found in messages"):
        qwen35.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="No user query found in messages"):  # only tool responses
        qwen35.render([{"role": "user", "content": "<tool_response>\n1\n</tool_response>"}])
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
        qwen35.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    # the template knows no developer role (it refuses one): a developer message is rendered as a system one
    dev = qwen35.render([{"role": "developer", "content": "a"}, {"role": "user", "content": "b"}])
    assert dev == qwen35.render([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}])
    from router.http.chat import ChatTemplate

    knows = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{# developer #}")
    assert knows.render([{"role": "developer", "content": "a"}]) == "developer:a;"  # one that names it: as it is
    with pytest.raises(ChatTemplateError, match="No messages provided"):
        qwen35.render([])


def test_qwen35_template_feeds_the_prompt(tok, qwen35):
    from router.http.schemas import parse_chat

    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Calling.", "reasoning_content": "need the tool"},
            {"role": "tool", "content": "18C", "tool_call_id": "c1"},
        ],
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 5,
    }
    text = (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nneed the tool\n</think>\n\nCalling.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    job = parse_chat(body, _limits(tok, qwen35))
    assert list(job.requests[0].token_ids.ids) == tok.encode(text)
    assert job.requests[0].max_new_tokens == 5
    with pytest.raises(Exception, match="messages: No user query"):
        parse_chat({"messages": [{"role": "system", "content": "x"}]}, _limits(tok, qwen35))
    dev = [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]  # Qwen3.5 has no developer role
    sys_ = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    got = parse_chat({"messages": dev}, _limits(tok, qwen35)).requests[0].token_ids.ids
    assert got == parse_chat({"messages": sys_}, _limits(tok, qwen35)).requests[0].token_ids.ids  # a system message
    with pytest.raises(Exception, match="messages: System message must be at the beginning"):  # ... as a system one
        parse_chat({"messages": sys_[::-1]}, _limits(tok, qwen35))


def test_qwen35_renders_as_transformers_does(qwen35):
    """Where HF transformers is installed (it is not a test dependency): its renderer gives the same text."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": "é", "y": {"z": [1, "2"]}}}}
    cases = [
        ([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}], None, {}),
        ([{"role": "user", "content": "Hi"}], None, {"enable_thinking": False}),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "<think>r</think>b"},
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": "", "reasoning_content": " r2 ", "tool_calls": [call, call]},
                {"role": "tool", "content": "t1"},
                {"role": "tool", "content": "t2"},
            ],
            [tool],
            {"enable_thinking": True},
        ),
    ]
    for messages, tools, kwargs in cases:
        for gen in (True, False):
            (want,), _ = chat_template_utils.render_jinja_template(
                [messages], tools=tools, chat_template=qwen35.source, add_generation_prompt=gen, **kwargs
            )
            assert qwen35.render(messages, tools=tools, add_generation_prompt=gen, kwargs=kwargs) == want


def test_template_sources_sandbox_and_a_model_without_one(tok, tmp_path):
    from router.http.chat import ChatTemplate, ChatTemplateError

    d = tmp_path / "m"
    d.mkdir()
    assert ChatTemplate.from_dir(d) is None
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "{{ messages[0].content }}!"},
                ]
            }
        )
    )
    assert ChatTemplate.from_dir(d).render([{"role": "user", "content": "a"}]) == "a!"
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")  # the file wins
    assert ChatTemplate.from_dir(d).render([{"role": "user", "content": "a"}]) == "J1"
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for %}")
    bare_dir = tmp_path / "no-template"  # the real router's answer
    bare_dir.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(DEFAULT_DIR / f, bare_dir / f)
    bare = Bare(model_dir=bare_dir)
    try:
        err = assert_error(
            post(bare.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, token=TOKEN),
            400,
            "messages",
        )
        assert "no chat template" in err["message"]
    finally:
        bare.close()


# ---------------------------------------------------------------------------------- units
def test_http_stack_is_imported_only_when_asked_for():
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from router.__main__ import main\n"
        "sys.exit(main(['--port', '0', '--prefill', '127.0.0.1:9', '--decode', '127.0.0.1:9', '--model', sys.argv[1],"
        " '--http-port', sys.argv[2]]))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BATON_LOG_LEVEL": "WARNING"}
    r = subprocess.run(
        [sys.executable, "-c", code, str(DEFAULT_DIR), str(pick_free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "needs fastapi, uvicorn and jinja2" in r.stderr, r.stderr
    probe = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from router.__main__ import serve_router, stop_router\n"
        "h, s = serve_router(prefill=['127.0.0.1:9'], decode=['127.0.0.1:9'], model_dir=sys.argv[1])\n"
        "stop_router(h, s, 0); print('uvicorn' in sys.modules, 'jinja2' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, str(DEFAULT_DIR)], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr


def test_python_m_router_serves_http_and_a_busy_port_is_a_clear_error():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BATON_LOG_LEVEL": "WARNING", "BATON_TOKEN": ""}
    port = pick_free_port()
    argv = [
        sys.executable,
        "-u",
        "-m",
        "router",
        "--port",
        "0",
        "--prefill",
        "127.0.0.1:9",
        "--decode",
        "127.0.0.1:9",
        "--model",
        str(DEFAULT_DIR),
        "--http-port",
        str(port),
    ]
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [p.stdout.readline().strip() for _ in range(2)]
        assert lines[1] == f"router: http on http://127.0.0.1:{port}", lines
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503  # no worker up
        busy = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)  # the same port again
        assert busy.returncode == 1 and f"--http-port {port}: cannot listen on 127.0.0.1:{port}" in busy.stderr
    finally:
        p.terminate()
        assert p.wait(20) == 0


def test_vllm_clients_window_echo_batches_and_extras(stack, tok):
    """What a vLLM / lm-evaluation-harness client does: max_model_len is what prompt + max_tokens may reach (the
    window less the rows reserved for decoding), a batch of token-id prompts with echo gets each prompt's text
    first, and vLLM's top-level stop_token_ids / ignore_eos act as Baton's own; max_tokens' range names the
    window."""
    client = stack.openai()
    usable = client.models.list().data[0].model_extra["max_model_len"]
    assert 0 < usable < 512  # the stack's window is 512
    ids = (tok.encode(PROMPT) * usable)[: usable - 2]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == usable and r.choices[0].finish_reason == "length"
    err = assert_error(post(stack.url, "/v1/completions", {"prompt": ids + [ids[0]] * 2}, token=stack.token), 400)
    assert err["param"] == "prompt" and f"at most {usable - 1} fit" in err["message"], err
    err = assert_error(
        post(stack.url, "/v1/completions", {"prompt": "x", "max_tokens": usable}, token=stack.token), 400
    )
    assert f"1..{usable - 1}" in err["message"], err
    hot = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=3.0, seed=7, logprobs=1)
    lp = hot.choices[0].logprobs  # at T = 3 the sampled token is often not the likeliest: it is shown all the same
    assert all(
        t in top and top[t] == v and len(top) <= 2 for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
    )
    batch = [tok.encode("def main("), tok.encode("class A:")]
    got = client.completions.create(model=MODEL, prompt=batch, max_tokens=2, echo=True, logprobs=1)
    assert [c.text[: len(t)] for c, t in zip(got.choices, ("def main(", "class A:"))] == ["def main(", "class A:"]
    assert [len(c.logprobs.tokens) for c in got.choices] == [len(b) + 2 for b in batch]
    with Client(stack.grpc, token=stack.token) as c:
        toks = [t for d in c.generate(PROMPT, max_new_tokens=12, ignore_eos=True) for t in d.token_ids]
    for ext in ({"stop_token_ids": [toks[4]], "ignore_eos": True}, {"baton": {"stop_token_ids": [toks[4]]}}):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body=ext)
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", toks.index(toks[4]) + 1), ext
    assert not any(sessions_settle(stack).values())


def test_priority_reaches_the_routers_request_on_every_api(tok):
    """vLLM's priority (an integer, lower first in the router's slot line) -> GenerateRequest.priority for
    completions, chat, Responses and Messages; absent: 0; not an integer: a 400 naming it."""
    from router.http.chat import ChatTemplate
    from router.http.errors import ApiError
    from router.http.messages import parse_messages
    from router.http.responses import parse_responses
    from router.http.schemas import Limits, parse_chat, parse_completion

    lim = Limits(MODEL, 4096, 16, tok, ChatTemplate(QWEN35_TEMPLATE.read_text(encoding="utf-8")))
    msgs = [{"role": "user", "content": "hi"}]
    bodies = [
        (parse_completion, {"prompt": PROMPT, "max_tokens": 4}),
        (parse_chat, {"messages": msgs}),
        (parse_responses, {"input": "hi"}),
        (parse_messages, {"messages": msgs, "max_tokens": 4}),
    ]
    for parse, body in bodies:
        for value, want in ((None, 0), (-5, -5), (2**31 - 1, 2**31 - 1)):
            job = parse({**body, **({} if value is None else {"priority": value})}, lim)
            job = job[0] if isinstance(job, tuple) else job
            assert [r.priority for r in job.requests] == [want], (parse.__name__, value)
        for bad_value in ("high", 1.5, 2**31):
            with pytest.raises(ApiError) as ei:
                parse({**body, "priority": bad_value}, lim)
            assert ei.value.status == 400 and ei.value.param == "priority", (parse.__name__, ei.value.message)
