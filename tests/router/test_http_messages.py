"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens: router/http/messages.py,
message_events.py) with the official `anthropic` client and httpx, on a router in this process over the
scripted fake workers of test_http_tools.py (the Qwen3.5 template, --reasoning-parser qwen3): a known answer's
reasoning, text and tool call become thinking, text and tool_use blocks, streamed (Anthropic's events, the
deltas joining into the non-streamed blocks) or not; blocks render the prompt the equivalent chat messages
render; stop_reason and stop_sequence; x-api-key; errors in Anthropic's shape naming the Messages field; a
fuzz that never gets a 500. Through the real model: test_http_api.py test_messages_equal_chat_completions."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_http_api import TOKEN
from test_http_tools import MODEL, TIME, TWO_FORMATS, WEATHER, XML_CALL, _prompt, _say, reasoning_router

anthropic = pytest.importorskip("anthropic")

THOUGHT = "The user wants the weather.\n"
ANSWER = "Let me look that up.\n\n"
TEXT = THOUGHT + "</think>\n\n" + ANSWER + XML_CALL
TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}
ARGS = {"city": "New York", "days": 3, "metric": True}
ASK = [{"role": "user", "content": "Weather in New York?"}]


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    yield from reasoning_router(tmp_path_factory)


def _client(s):
    return anthropic.Anthropic(base_url=s["url"], api_key=TOKEN, max_retries=0)


def _post(s, body: dict, path: str = "/v1/messages", headers=None) -> httpx.Response:
    h = {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"} if headers is None else headers
    return httpx.post(s["url"] + path, json=body, headers=h, timeout=30)


def _events(s, body: dict) -> list[tuple[str, dict]]:
    h = {"x-api-key": TOKEN}
    with httpx.stream("POST", s["url"] + "/v1/messages", json={**body, "stream": True}, headers=h) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    names = [x[len("event: ") :] for x in lines if x.startswith("event: ")]
    data = [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: ")]
    assert len(names) == len(data)
    return list(zip(names, data))


def _error(r: httpx.Response, status: int, kind: str, field: str | None = None) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    if field is not None:
        assert body["error"]["message"].startswith(field), body
    return body["error"]["message"]


def test_thinking_text_and_tool_use_blocks_streamed_or_not(s):
    kw = dict(model=MODEL, max_tokens=300, messages=ASK, tools=[TOOL])
    _say(s, TEXT)
    m = _client(s).messages.create(**kw)
    assert m.id.startswith("msg_") and m.role == "assistant" and m.type == "message"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = m.content
    assert thinking.thinking == THOUGHT and text.text == ANSWER
    assert call.name == "get_weather" and call.input == ARGS and m.stop_reason == "tool_use"
    assert m.usage.output_tokens == len(s["tok"].encode(TEXT)) + 1  # the whole text's tokens and EOS
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(s["tok"].encode(_prompt(s)))

    _say(s, TEXT)
    events = _events(s, kw)
    names = [n for n, _ in events]
    assert all(d["type"] == n for n, d in events)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"] and names.count("content_block_stop") == 3
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == THOUGHT
    assert "".join(d.get("text", "") for d in deltas) == ANSWER
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == ARGS
    assert len(deltas) > 10  # token by token
    last = events[-2][1]
    assert last["delta"]["stop_reason"] == "tool_use" and last["usage"]["output_tokens"] == m.usage.output_tokens

    _say(s, TEXT)  # the anthropic client's own stream
    with _client(s).messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == ANSWER and [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == ARGS and final.stop_reason == "tool_use"


def test_blocks_render_the_equivalent_chat_prompt(s):
    """system blocks, an assistant turn with thinking, text and tool_use, the user's tool_result then text."""
    calls = [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    ]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls, "reasoning_content": "Look it up."},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 24 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Rome?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 24 C"}]},
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    body = {"max_tokens": 50, "system": [{"type": "text", "text": "Be brief."}], "messages": messages, "tools": [TOOL]}
    _say(s, "</think>\n\nRain.")
    r = _post(s, body)
    assert r.status_code == 200, r.text
    via_messages = _prompt(s)
    assert r.json()["content"] == [{"type": "text", "text": "Rain."}] and r.json()["stop_reason"] == "end_turn"
    count = _post(s, {k: v for k, v in body.items() if k != "max_tokens"}, "/v1/messages/count_tokens")
    assert count.status_code == 200 and count.json() == {"input_tokens": len(s["tok"].encode(via_messages))}
    _say(s, "</think>\n\nRain.")
    c = httpx.post(
        s["url"] + "/v1/chat/completions",
        json={"messages": chat, "tools": [WEATHER], "max_tokens": 50},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert c.status_code == 200, c.text
    assert _prompt(s) == via_messages and "Sunny, 24 C" in via_messages and "Be brief." in via_messages


def test_stop_sequences_and_max_tokens(s):
    _say(s, "one two STOP three")
    m = _client(s).messages.create(
        model=MODEL, max_tokens=50, messages=ASK, stop_sequences=["STOP", "zzz"], thinking={"type": "disabled"}
    )
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == ("one two ", "stop_sequence", "STOP")
    _say(s, "one two three four five six")
    m = _client(s).messages.create(model=MODEL, max_tokens=3, messages=ASK, thinking={"type": "disabled"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3 and m.stop_sequence is None
    _say(s, "short")  # far past the router's limit and the window: capped, not refused
    with _client(s).messages.stream(model=MODEL, max_tokens=10**6, messages=ASK, thinking={"type": "disabled"}) as st_:
        m = st_.get_final_message()
    assert (m.content[0].text, m.stop_reason) == ("short", "end_turn")
    assert _prompt(s).endswith("<think>\n\n</think>\n\n")  # thinking disabled: the template closes the block


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}],
            },
            "messages[0].content[0]",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools[0].type",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
            "tool_choice",
        ),
        ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "maybe"}}, "tool_choice"),
        ({"max_tokens": 5, "messages": ASK, "stop_sequences": 3}, "stop_sequences"),
        ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "sometimes"}}, "thinking"),
        ({"max_tokens": 5, "messages": ASK, "stream": "yes"}, "stream"),
        ({"max_tokens": 5, "messages": ASK, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ],
)
def test_refusals_are_anthropic_errors_naming_the_field(s, body, field):
    _error(_post(s, body), 400, "invalid_request_error", field)
    _say(s, "ok")
    assert _post(s, {"max_tokens": 5, "messages": ASK}).status_code == 200  # and the next one is served


def test_auth_and_model_errors(s):
    ok = {"max_tokens": 5, "messages": ASK}
    _error(_post(s, ok, headers={"x-api-key": "wrong"}), 401, "authentication_error")
    _error(_post(s, ok, headers={}), 401, "authentication_error")
    _say(s, "ok")
    assert _post(s, ok, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200  # either header
    _error(_post(s, {**ok, "model": "claude-x"}), 404, "not_found_error", "model")
    r = httpx.post(s["url"] + "/v1/messages", content=b"{nope", headers={"x-api-key": TOKEN}, timeout=10)
    _error(r, 400, "invalid_request_error", "body")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=s["url"], api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=ASK
        )
    # the OpenAI paths keep OpenAI's error shape, and take x-api-key too
    r = httpx.post(s["url"] + "/v1/chat/completions", json={"messages": []}, headers={"x-api-key": TOKEN}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


_value = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 3), st.text(max_size=5), st.lists(st.integers(-1, 3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip
_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=8), _value)}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": st.one_of(st.just("t1"), _value), "name": st.just("get_weather"),
         "input": st.one_of(st.just({"city": "Rome"}), _value)}
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.one_of(st.just("t1"), _value),
         "content": st.one_of(st.text(max_size=6), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=4)}), max_size=2), _value)}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "x"]), "thinking": _value}),
    _value,
)  # fmt: skip
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]),
     "content": st.one_of(st.text(max_size=8), st.lists(_block, max_size=3), _value)}
)  # fmt: skip
_fields = {
    "messages": st.one_of(st.lists(_message, max_size=3), _value),
    "max_tokens": st.one_of(st.integers(-1, 3), _value),
    "system": st.one_of(st.text(max_size=6), st.lists(_block, max_size=2), _value),
    "tools": st.one_of(st.just([TOOL]), st.lists(st.fixed_dictionaries({"name": _value, "type": st.sampled_from(["custom", "bash_20250124"])}), max_size=2), _value),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"]), "name": _value}), _value),
    "stop_sequences": st.one_of(st.lists(st.text(max_size=3), max_size=3), _value),
    "stream": st.one_of(st.booleans(), _value),
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])}), _value),
    "temperature": _value,
    "top_k": _value,
    "metadata": _value,
}  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.fixed_dictionaries({}, optional=_fields), _value))
def test_fuzz_never_500(s, body):
    _say(s, "ok")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = _post(s, body, path)
        assert r.status_code in (200, 400, 413, 429), (path, body, r.status_code, r.text)
        if r.status_code != 200:
            assert r.json()["type"] == "error" and r.json()["error"]["type"] in (
                "invalid_request_error",
                "rate_limit_error",
            )


def test_a_coding_agents_request_is_served(s):
    """The shape of a coding agent's request (Claude Code's): system text blocks with cache_control, tools whose
    input_schema carries $schema and additionalProperties, metadata, max_tokens far past the window, streamed."""
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"command": {"type": "string", "description": "The command"}, "timeout": {"type": "number"}},
        "required": ["command"],
        "additionalProperties": False,
    }
    body = {
        "model": MODEL,
        "max_tokens": 32000,
        "temperature": 1,
        "stream": True,
        "metadata": {"user_id": "user_abc"},
        "system": [
            {"type": "text", "text": "You are a coding agent."},
            {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [{"name": "Bash", "description": "Runs a command", "input_schema": schema, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}}]}],
    }  # fmt: skip
    call = "<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>"
    _say(s, "</think>\n\n" + call)
    events = _events(s, body)
    blocks = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in blocks] == ["tool_use"] and blocks[0]["name"] == "Bash"
    args = "".join(d["delta"].get("partial_json", "") for n, d in events if n == "content_block_delta")
    assert json.loads(args) == {"command": "ls -la"} and events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert "You are a coding agent.Be careful." in _prompt(s)


def test_two_calls_are_two_tool_use_blocks(s):
    tools = [TOOL, {"name": "get_time", "input_schema": TIME["function"]["parameters"]}]
    _say(s, "</think>\n\n" + TWO_FORMATS)
    body = _post(s, {"max_tokens": 300, "messages": ASK, "tools": tools}).json()
    uses = [b for b in body["content"] if b["type"] == "tool_use"]
    assert [b["name"] for b in uses] == ["get_time", "get_weather"] and uses[1]["input"] == ARGS
    assert uses[0]["input"] == {"tz": "Europe/Paris", "fmt": "{iso}"} and body["stop_reason"] == "tool_use"
    _say(s, "</think>\n\n" + TWO_FORMATS)
    events = _events(s, {"max_tokens": 300, "messages": ASK, "tools": tools})
    starts = {
        d["content_block"]["name"]: d["index"]
        for n, d in events
        if n == "content_block_start" and d["content_block"]["type"] == "tool_use"
    }
    for b in uses:
        got = "".join(
            d["delta"]["partial_json"]
            for n, d in events
            if n == "content_block_delta" and d["index"] == starts[b["name"]]
        )
        assert json.loads(got) == b["input"], b["name"]
