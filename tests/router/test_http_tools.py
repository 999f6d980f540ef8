"""Chat tool calls (router/http/tools.py). The parser on its own: both formats, the schema's types, any split of
the text into deltas, blocks that are not calls. Then through the real HTTP API with the `openai` client: a
router in this process with the default model's tokenizer and the Qwen3.5 chat template, and loopback fake
workers (tests/fakes.py) that write a scripted answer (its token ids, EOS after), so the response path is
tested on a known text: content, tool_calls with typed JSON arguments, finish_reason "tool_calls", streamed
and not; the template gets the tools and an earlier assistant turn's calls; refusals name their field."""

from __future__ import annotations

import json
import shutil

import fakes
import httpx
import pytest
from conftest import pick_free_port
from test_http_api import DEFAULT_DIR, QWEN35_TEMPLATE, TOKEN, assert_error

from baton.settings import Settings
from router.http.errors import ApiError
from router.http.tools import ToolCalls, check_tools, parse_call, tool_choice

MODEL = "qwen-tools"  # the served id is the model directory's name
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        },
    },
}
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
ANSWER = "Let me look that up.\n\n" + XML_CALL


def _split(parser: ToolCalls, text: str, cuts: list[int]) -> tuple[str, list]:
    content, calls, last = "", [], 0
    for c in [*cuts, len(text)]:
        got, new = parser.feed(text[last:c])
        content, calls, last = content + got, calls + new, c
    return content + parser.finish()[0], calls


# ---- the parser ----------------------------------------------------------------------------------------
def test_xml_call_with_the_schemas_types_under_any_split():
    tools = check_tools([WEATHER])
    want_args = {"city": "New York", "days": 3, "metric": True}
    for cuts in ([], list(range(1, len(ANSWER))), [5, 30, 31, 60, 100], [len("Let me look that up.\n\n<tool")]):
        content, calls = _split(ToolCalls(tools), ANSWER + " ", cuts)
        assert content == "Let me look that up.\n\n ", cuts
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == want_args
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == 29


def test_json_calls_and_what_is_not_a_call():
    tools = check_tools([WEATHER])
    two = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n<tool_call>\n{"name": "x", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    content, calls = _split(ToolCalls(tools), two, [20, 70])
    assert content == "\n" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}, {"a": 1}]
    assert calls[0]["id"] != calls[1]["id"]
    for text in ("<tool_call>not a call</tool_call> after", "a < b and <tool_x> stays", "<tool_call>\n<function=f>\n"):
        content, calls = _split(ToolCalls(tools), text, [3])
        assert (content, calls) == (text, []), text  # returned as the model wrote it (an unfinished block too)
    assert parse_call('{"name": "f", "arguments": [1]}', tools) is None


def test_tool_definitions_and_tool_choice_are_checked():
    assert tool_choice({}) == (None, None) and tool_choice({"tools": [WEATHER], "tool_choice": "none"}) == (None, None)
    shown, parsed = tool_choice({"tools": [WEATHER]})
    assert shown == [WEATHER] and set(parsed) == {"get_weather"}
    for body, field in (
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ):
        with pytest.raises(ApiError) as ei:
            tool_choice(body)
        assert ei.value.status == 400 and ei.value.message.startswith(field + ":"), (body, ei.value.message)


# ---- through the HTTP API --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scripted(tmp_path_factory, monkeypatch_module):
    """A router (HTTP on) over fake workers whose model writes `script["ids"]` after any prompt, then EOS."""
    from baton.tokenizer import Tokenizer
    from router.__main__ import serve_router, stop_router
    from router.service import RouterConfig

    d = tmp_path_factory.mktemp("scripted") / MODEL
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(DEFAULT_DIR / f, d / f)
    shutil.copy(QWEN35_TEMPLATE, d / "chat_template.jinja")
    tok = Tokenizer.from_dir(d)
    eos = json.loads((d / "config.json").read_text())["eos_token_id"]
    script = {"ids": [], "prompt": None}

    def scripted_next(ctx):
        if script["prompt"] is None or ctx[: len(script["prompt"])] != script["prompt"]:
            script["prompt"] = list(ctx)  # the Prefill: a new request's prompt
        i = len(ctx) - len(script["prompt"])
        return script["ids"][i] if i < len(script["ids"]) else (eos if isinstance(eos, int) else eos[0])

    monkeypatch_module.setattr(fakes, "exact_next", scripted_next)
    st = Settings(token=TOKEN)
    p, dw = fakes.prefill_worker(st), fakes.decode_worker(st)
    handle, servicer = serve_router(
        prefill=[p.address],
        decode=[dw.address],
        model_dir=str(d),
        port=0,
        settings=st,
        config=RouterConfig(),
        http_port=pick_free_port(),
        poll_interval=0.1,
    )
    s = dict(url=servicer.http.url, tok=tok, script=script, prefill=p)
    end = httpx.get(s["url"] + "/health", timeout=10)
    for _ in range(100):
        if end.status_code == 200:
            break
        import time

        time.sleep(0.05)
        end = httpx.get(s["url"] + "/health", timeout=10)
    yield s
    stop_router(handle, servicer, 0)
    p.stop()
    dw.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _client(s):
    from openai import OpenAI

    return OpenAI(base_url=s["url"] + "/v1", api_key=TOKEN, max_retries=0)


def _say(s, text: str) -> None:
    s["script"]["ids"] = s["tok"].encode(text)
    assert s["tok"].decode(s["script"]["ids"]) == text


def _prompt(s) -> str:
    last = [r for m, r in s["prefill"].servicer.calls if m == "Prefill"][-1]
    return s["tok"].decode(list(last.prompt_ids))


def test_a_tool_call_comes_back_as_tool_calls(scripted):
    _say(scripted, ANSWER)
    msgs = [{"role": "user", "content": "Weather in New York?"}]
    r = _client(scripted).chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me look that up."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "New York", "days": 3, "metric": True}
    assert '"name": "get_weather"' in _prompt(scripted) and "<tools>" in _prompt(scripted)  # the template saw them


def test_streamed_tool_calls_never_leak_the_markup(scripted):
    _say(scripted, ANSWER)
    msgs = [{"role": "user", "content": "Weather?"}]
    chunks = list(
        _client(scripted).chat.completions.create(
            model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=200, stream=True
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Let me look that up.\n\n" and "<" not in text
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments)["days"] == 3
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_or_with_none_the_text_is_content(scripted):
    _say(scripted, ANSWER)
    msgs = [{"role": "user", "content": "Weather?"}]
    for kw in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        r = _client(scripted).chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, **kw)
        assert r.choices[0].message.content == ANSWER and not r.choices[0].message.tool_calls, kw
        assert r.choices[0].finish_reason == "stop" and "<tools>" not in _prompt(scripted)


def test_an_earlier_turns_calls_and_results_reach_the_template(scripted):
    _say(scripted, "It is sunny.")
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    r = _client(scripted).chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=50)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    p = _prompt(scripted)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in p and "18C, sunny" in p


def test_bad_tool_fields_are_400_naming_them(scripted):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for extra, field in (
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ):
        r = httpx.post(
            scripted["url"] + "/v1/chat/completions",
            json={**base, **extra},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert_error(r, 400, field)
