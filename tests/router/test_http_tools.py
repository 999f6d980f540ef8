"""Chat tool calls (router/http/tools.py, tool_calls.py, tool_parse.py). The parser on its own: both formats,
the schema's types, any split of the text into deltas, blocks that are not calls; streamed calls (stream mode):
the name entry, then argument pieces that join into the whole call's arguments (byte-equal), and cut calls.
Then through the real HTTP API with the `openai` client (and httpx for the raw SSE chunks): a router in this
process with the default model's tokenizer and the Qwen3.5 chat template, and loopback fake workers
(tests/fakes.py) that write a scripted answer (its token ids, EOS after), so the response path is tested on
a known text: content, tool_calls with typed JSON arguments, finish_reason "tool_calls", streamed (calls in
pieces equal to the non-streamed arguments, cut calls) and not; the template gets the tools and an earlier
assistant turn's calls; refusals name their field."""

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
from router.http.tools import ToolCalls, ToolChoice, call_opening, check_tools, parse_call, tool_choice

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
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"properties": {"tz": {"type": "string"}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
JSON_OPENING = '<tool_call>\n{"name": "get_weather", "arguments":'
XML_TEMPLATE = QWEN35_TEMPLATE.read_text(encoding="utf-8")  # teaches <function=NAME> calls
# A Qwen3-like template that teaches JSON calls (no "<function=" in it)
JSON_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    'Reply with <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
ANSWER = "Let me look that up.\n\n" + XML_CALL
XML_REST = "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tok():
    from baton.tokenizer import Tokenizer

    return Tokenizer.from_dir(DEFAULT_DIR)


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
    assert tool_choice({}) == ToolChoice() and tool_choice({"tools": [WEATHER], "tool_choice": "none"}) == ToolChoice()
    assert tool_choice({}).parser() is None
    auto = tool_choice({"tools": [WEATHER]}, XML_TEMPLATE)
    assert auto.shown == [WEATHER] and set(auto.tools) == {"get_weather"} and auto.forced == "" and auto.parallel
    for body, field in (
        ({"tool_choice": "required"}, "tool_choice"),  # forcing a call needs tools
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ):
        with pytest.raises(ApiError) as ei:
            tool_choice(body, XML_TEMPLATE)
        assert ei.value.status == 400 and ei.value.message.startswith(field + ":"), (body, ei.value.message)
    with pytest.raises(ApiError, match="^tool_choice: the function 'get_time' is not one"):
        tool_choice({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})


# ---- forcing a call: tool_choice "required" or named -------------------------------------------------
def test_the_forced_opening_follows_the_templates_format():
    assert call_opening(None, XML_TEMPLATE) == call_opening(None, JSON_TEMPLATE) == "<tool_call>\n"
    assert call_opening("get_weather", XML_TEMPLATE) == "<tool_call>\n<function=get_weather>\n"
    assert call_opening("get_weather", JSON_TEMPLATE) == '<tool_call>\n{"name": "get_weather", "arguments":'
    req = tool_choice({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}, XML_TEMPLATE)
    assert (req.forced, req.only, req.parallel) == ("<tool_call>\n", None, False)
    named = tool_choice({"tools": [WEATHER, TIME], "tool_choice": NAMED}, JSON_TEMPLATE)
    assert named.only == "get_weather" and named.forced == JSON_OPENING and named.shown == [WEATHER, TIME]


@pytest.mark.parametrize("source", ["xml", "json"])
def test_the_rendered_prompt_ends_with_the_forced_opening(tok, source):
    from router.http.chat import ChatTemplate
    from router.http.schemas import Limits, chat_prompt, parse_chat
    from router.http.tokenize import tokenize

    template = ChatTemplate(QWEN35_TEMPLATE.read_text(encoding="utf-8") if source == "xml" else JSON_TEMPLATE)
    lim = Limits(MODEL, 4096, 16, tok, template)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, TIME]}
    if source == "xml":  # Qwen3.5 without thinking: its generation prompt ends in an empty, closed <think> block
        body["chat_template_kwargs"] = {"enable_thinking": False}
    plain, _ = chat_prompt(body, lim)
    want = {"xml": "<tool_call>\n<function=get_weather>\n", "json": JSON_OPENING}[source]
    for choice, opening in (
        ("required", "<tool_call>\n"),
        (NAMED, want),
        ({"type": "function", "function": {"name": "get_time"}}, want.replace("weather", "time")),
    ):
        text, got = chat_prompt({**body, "tool_choice": choice}, lim)
        assert text == plain + opening and got.forced == opening, choice  # the template's own prompt, then the opening
        job = parse_chat({**body, "tool_choice": choice}, lim)
        assert list(job.requests[0].token_ids.ids) == tok.encode(plain + opening)
        assert job.tools.forced == opening
        # /tokenize renders the same prompt: the opening's tokens counted
        assert tokenize({**body, "tool_choice": choice}, lim)["count"] == len(tok.encode(plain + opening))
    assert tokenize(body, lim)["count"] == len(tok.encode(plain)) < len(tok.encode(plain + want))
    with pytest.raises(ApiError, match="^tool_choice: .*add_generation_prompt"):
        chat_prompt({**body, "tool_choice": "required", "add_generation_prompt": False}, lim)
    if source == "xml":  # thinking on: the prompt ends in an open "<think>\n"; a forced call closes it empty first
        thinking = {**body, "chat_template_kwargs": {}, "tool_choice": NAMED}
        assert chat_prompt({**thinking, "tool_choice": "auto"}, lim)[0].endswith("<|im_start|>assistant\n<think>\n")
        assert chat_prompt(thinking, lim)[0] == plain + want and plain.endswith("<think>\n\n</think>\n\n")


def test_a_forced_named_call_parses_as_if_the_model_wrote_its_opening():
    tools = check_tools([WEATHER, TIME])
    xml_rest = "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    json_rest = '{"city": "Paris", "days": 2}}\n</tool_call>'
    for opening, rest in (("<tool_call>\n<function=get_weather>\n", xml_rest), (JSON_OPENING, json_rest)):
        for cuts in ([], list(range(1, len(rest))), [4, 17]):
            p = ToolCalls(tools, forced=opening, only="get_weather")
            content, calls = _split(p, rest + " Done.", cuts)
            assert content == " Done." and [c["function"]["name"] for c in calls] == ["get_weather"], (opening, cuts)
            assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}  # typed: 2 an int
        # the model ends (EOS) without closing the call Baton opened: parsed as if closed
        content, calls = ToolCalls(tools, forced=opening, only="get_weather").split(rest.replace("</tool_call>", ""))
        assert content == "" and json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"
        # a forced block that is not a call: the model's own text, never the opening
        for text in ("oops</tool_call> then text", "cut off by max_tokens"):
            content, calls = ToolCalls(tools, forced=opening, only="get_weather").split(text)
            assert (content, calls) == (text, []) and "<tool_call>" not in content


def test_a_named_choice_accepts_only_its_function_and_parallel_false_only_the_first_call():
    tools = check_tools([WEATHER, TIME])
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    # JSON's last duplicate key wins: the model renamed the forced call; returned as its text, opening left out
    renamed = '{"tz": "UTC"}, "name": "get_time"}\n</tool_call>'
    content, calls = ToolCalls(tools, forced=JSON_OPENING, only="get_weather").split(renamed)
    assert (content, calls) == (renamed, [])
    weather = '{"city": "Rome"}}\n</tool_call>\n'
    content, calls = ToolCalls(tools, forced=JSON_OPENING, only="get_weather").split(weather + other)
    assert content == "\n" + other and [c["function"]["name"] for c in calls] == ["get_weather"]
    # "required": any function; parallel_tool_calls false: the first call only, later calls dropped
    both = '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n' + other
    content, calls = ToolCalls(tools, forced="<tool_call>\n").split(both)
    assert content == "\n" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    content, calls = ToolCalls(tools, forced="<tool_call>\n", parallel=False).split(both + " end")
    assert content == "\n end" and [c["function"]["name"] for c in calls] == ["get_weather"]
    with pytest.raises(ValueError):
        ToolCalls(tools, forced="{")


# ---- streamed calls: delta.tool_calls in pieces ------------------------------------------------------
XML_OPENING = "<tool_call>\n<function=get_weather>\n"
JSON_TWO = (
    'Both: <tool_call>\n{"name": "get_weather", "arguments": {"city":"Ro}me \\"x\\"", "days": 2,'
    ' "opts": {"a": [1, {"b": null}]}}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def _deltas(p: ToolCalls, text: str, cuts: list[int]) -> list:
    out, last = [], 0
    for c in [*cuts, len(text)]:
        out, last = out + p.deltas(text[last:c]), c
    return out + p.deltas_end()


def _assemble(items: list) -> tuple[str, list[dict]]:
    """Streamed items -> (content, calls as whole mode gives them), checking OpenAI's shape: a call's first
    entry has index, id, type and name with arguments "", every later one only index and a piece."""
    content, calls = "", {}
    for it in items:
        if isinstance(it, str):
            content += it
        elif it["index"] not in calls:
            assert set(it) == {"index", "id", "type", "function"} and it["type"] == "function", it
            assert it["function"]["arguments"] == "" and it["index"] == len(calls), it
            calls[it["index"]] = {"id": it["id"], "type": "function", "function": dict(it["function"])}
        else:
            assert set(it) == {"index", "function"} and set(it["function"]) == {"arguments"}, it
            assert it["function"]["arguments"], it  # no empty pieces
            calls[it["index"]]["function"]["arguments"] += it["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def _pieces(items: list, index: int = 0) -> list[str]:
    return [it["function"]["arguments"] for it in items if isinstance(it, dict) and it["index"] == index][1:]


STREAM_CASES = [
    ({}, ANSWER + " "),
    ({}, JSON_TWO),
    ({"forced": JSON_OPENING, "only": "get_weather"}, ' {"city": "Paris", "days": 2}}\n</tool_call> Done.'),
    ({"forced": XML_OPENING, "only": "get_weather"}, XML_REST + " Done."),
    ({"forced": XML_OPENING, "only": "get_weather"}, XML_REST.replace("\n</tool_call>", "")),  # parsed as closed
    ({}, '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'),  # a string
    ({}, '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n</tool_call>'),  # name last: whole
    ({}, "<tool_call>\n<function=get_time>\n</function>\n</tool_call>x"),  # no parameters: "{}"
    ({"parallel": False}, JSON_TWO),  # the second call is neither streamed nor content
    ({"only": "get_time"}, JSON_TWO),  # get_weather is another function's call: content
    ({}, "<tool_call>not a call</tool_call> after <tool_x>"),
]


@pytest.mark.parametrize("kw, text", STREAM_CASES)
def test_streamed_pieces_join_into_the_whole_calls_arguments_under_any_split(kw, text):
    """Stream mode gives the content and calls whole mode gives (arguments byte-equal), in OpenAI's shape."""
    tools = check_tools([WEATHER, TIME])
    want_content, want = ToolCalls(tools, **kw).split(text)
    for cuts in ([], list(range(1, len(text))), [3, 17, 18, 40, 41, 90]):
        p = ToolCalls(tools, stream=True, **kw)
        content, calls = _assemble(_deltas(p, text, cuts))
        assert content == want_content and p.cut == 0, (kw, cuts)
        assert [c["function"] for c in calls] == [c["function"] for c in want], (kw, cuts)
    assert want or "<tool_call>" in want_content or kw.get("only") == "get_time"


def test_the_canonical_arguments_are_the_models_json_text_or_the_xml_parameters_built():
    tools = check_tools([WEATHER, TIME])
    _, calls = ToolCalls(tools).split(JSON_TWO)
    assert [c["function"]["arguments"] for c in calls] == [
        '{"city":"Ro}me \\"x\\"", "days": 2, "opts": {"a": [1, {"b": null}]}}',  # as written (no space after ":")
        "{}",
    ]
    assert parse_call('{"name": "f", "arguments": "{\\"a\\":1}"}', tools)["function"]["arguments"] == '{"a":1}'
    assert parse_call('{"name": "f"}', tools)["function"]["arguments"] == "{}"
    dup = '{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}'  # json.loads keeps the last
    assert parse_call(dup, tools)["function"]["arguments"] == '{"b": 2}'
    xml = "<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n03\n</parameter>\n</function>"
    assert parse_call(xml, tools)["function"]["arguments"] == '{"city": "São Paulo", "days": "03"}'  # 03: not JSON
    _, (call,) = ToolCalls(tools).split(ANSWER)
    assert call["function"]["arguments"] == '{"city": "New York", "days": 3, "metric": true}'


def test_json_arguments_stream_as_written_and_never_past_their_closing_brace():
    tools = check_tools([WEATHER])
    text = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    p, sent, seen = ToolCalls(tools, stream=True), [], []
    for k, ch in enumerate(text):
        items = p.deltas(ch)
        sent += [it for it in items if isinstance(it, dict)]
        seen.append((text[: k + 1], "".join(_pieces(sent))))
    got = dict(seen)
    assert got['Hi <tool_call>\n{"name": "get_weather", "arguments": '] == ""  # the name only: nothing sent yet
    assert sent[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert got['Hi <tool_call>\n{"name": "get_weather", "arguments": {"ci'] == '{"ci'  # as it is written
    assert got[text] == '{"city": "Rome"}'  # the outer "}" and the markup are never arguments
    assert len(_pieces(sent)) == len('{"city": "Rome"}') and p.deltas_end() == []


def test_xml_arguments_stream_one_piece_per_parameter():
    tools = check_tools([WEATHER])
    p = ToolCalls(tools, stream=True)
    head = "Let me look that up.\n\n<tool_call>\n<function=get_weather>"
    first = p.deltas(head)  # the model wrote the name: the call's entry is sent at once
    assert first[-1] == {"index": 0, "id": first[-1]["id"], "type": "function", **_fn("get_weather", "")}
    items = first + _deltas(p, ANSWER[len(head) :], list(range(1, len(ANSWER) - len(head))))
    assert _pieces(items) == ['{"city": "New York"', ', "days": 3', ', "metric": true', "}"]
    # a forced named call (Baton wrote <function=NAME>) is sent at the model's first complete parameter
    p = ToolCalls(tools, forced=XML_OPENING, only="get_weather", stream=True)
    assert p.deltas("<parameter=city>\nParis\n</parameter") == []
    items = p.deltas(">")  # the call's entry, then its first piece
    assert items[0]["function"] == {"name": "get_weather", "arguments": ""} and _pieces(items) == ['{"city": "Paris"']
    p = ToolCalls(tools, forced=XML_OPENING, only="get_weather", stream=True)
    assert _deltas(p, "I would rather not.", [3]) == ["I would rather not."]  # no call: its text, never a call


def _fn(name, arguments):
    return {"function": {"name": name, "arguments": arguments}}


def test_a_streamed_call_its_block_does_not_give_is_cut():
    """Once a call's entry is sent it stays: a block that ends malformed sends nothing more (cut)."""
    tools = check_tools([WEATHER, TIME])
    for kw, text, pieces, content in (
        (
            {},
            'a<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}, oops}\n</tool_call>b',
            '{"city": "Rome"}',
            "ab",
        ),
        ({}, 'a<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro', '{"city": "Ro', "a"),  # text ended
        (
            {},
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Ro</tool_call>b',
            '{"city": "Ro',
            "b",
        ),  # no markup
        (
            {},
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\njunk\n</tool_call>",
            '{"city": "Rome"',
            "",
        ),
        (
            {"forced": JSON_OPENING, "only": "get_weather"},
            ' {"tz": "UTC"}, "name": "get_time"}\n</tool_call>',
            '{"tz": "UTC"}',
            "",
        ),
    ):
        p = ToolCalls(tools, stream=True, **kw)
        items = _deltas(p, text, list(range(1, len(text))))
        got, calls = _assemble(items)
        assert (got, p.cut, p.calls) == (content, 1, 1), text
        assert calls[0]["function"] == {"name": "get_weather", "arguments": pieces}, text
        # not streamed: today's rule, the block is the model's text as written (a forced opening left out)
        assert ToolCalls(tools, **kw).split(text) == (text, []), text
    # parallel_tool_calls false: a cut call is the one call; the next is not streamed
    p = ToolCalls(tools, stream=True, parallel=False)
    text = '<tool_call>\n{"name": "get_time", "arguments": {}, x}</tool_call>' + JSON_TWO
    got, calls = _assemble(_deltas(p, text, [30, 60]))
    assert [c["function"]["name"] for c in calls] == ["get_time"] and (p.cut, got) == (1, "Both: \n")


# ---- through the HTTP API --------------------------------------------------------------------------------
def scripted_routers(tmp_path_factory, monkeypatch, configs: dict):
    """Routers (HTTP on), one per RouterConfig of `configs`, over the same fake workers whose model writes
    `script["ids"]` after any prompt, then EOS. Yields {name: that router's URL, "tok", "script", "prefill"}."""
    from baton.tokenizer import Tokenizer
    from router.__main__ import serve_router, stop_router

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

    monkeypatch.setattr(fakes, "exact_next", scripted_next)
    st = Settings(token=TOKEN)
    p, dw = fakes.prefill_worker(st), fakes.decode_worker(st)
    s, routers = dict(tok=tok, script=script, prefill=p), []
    for name, config in configs.items():
        handle, servicer = serve_router(
            prefill=[p.address],
            decode=[dw.address],
            model_dir=str(d),
            port=0,
            settings=st,
            config=config,
            http_port=pick_free_port(),
            poll_interval=0.1,
        )
        routers.append((handle, servicer))
        s[name] = servicer.http.url
        end = httpx.get(s[name] + "/health", timeout=10)
        for _ in range(100):
            if end.status_code == 200:
                break
            import time

            time.sleep(0.05)
            end = httpx.get(s[name] + "/health", timeout=10)
    yield s
    for handle, servicer in routers:
        stop_router(handle, servicer, 0)
    p.stop()
    dw.stop()


def reasoning_router(tmp_path_factory):
    """scripted_routers' one router, "url", with --reasoning-parser qwen3 (the Responses and Messages APIs' tests)."""
    from router.service import RouterConfig

    mp = pytest.MonkeyPatch()
    yield from scripted_routers(tmp_path_factory, mp, {"url": RouterConfig(reasoning_parser="qwen3")})
    mp.undo()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, monkeypatch_module):
    """A router (HTTP on) over fake workers whose model writes `script["ids"]` after any prompt, then EOS."""
    from router.service import RouterConfig

    yield from scripted_routers(tmp_path_factory, monkeypatch_module, {"url": RouterConfig()})


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _client(s):
    from openai import OpenAI

    return OpenAI(base_url=s["url"] + "/v1", api_key=TOKEN, max_retries=0)


def _say(s, text: str) -> None:
    s["script"]["ids"], s["script"]["prompt"] = s["tok"].encode(text), None  # the next Prefill starts it
    assert s["tok"].decode(s["script"]["ids"]) == text


def _prompt(s) -> str:
    last = [r for m, r in s["prefill"].servicer.calls if m == "Prefill"][-1]
    return s["tok"].decode(list(last.prompt_ids))


def _streamed_calls(chunks, choice: int = 0) -> list[tuple[int, str, str]]:
    """The openai client's chunks -> (index, name, arguments) per call of one choice, the pieces joined."""
    calls: dict[int, list] = {}
    for ch in chunks:
        for c in ch.choices:
            for tc in (c.delta.tool_calls or []) if c.index == choice else []:
                if tc.index not in calls:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
    return [(i, name, args) for i, (name, args) in sorted(calls.items())]


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
    ((index, name, args),) = _streamed_calls(chunks)
    assert (index, name) == (0, "get_weather") and json.loads(args)["days"] == 3
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
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": 0}, "parallel_tool_calls"),
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


def test_a_named_tool_choice_forces_the_call_streamed_or_not(scripted):
    """The scripted model writes only the rest of the call: the router wrote its opening after the prompt."""
    _say(scripted, XML_REST)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=200)
    r = _client(scripted).chat.completions.create(n=2, **kw)
    assert _prompt(scripted).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n"
    )
    for c in r.choices:  # n = 2: each choice forced the same way
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris",
            "days": 2,
        }
    chunks = list(_client(scripted).chat.completions.create(stream=True, n=2, **kw))
    text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert text == "" and {c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason} == {"tool_calls"}
    for j in (0, 1):  # each choice its own calls, indexes from 0, arguments as the non-streamed response's
        assert _streamed_calls(chunks, j) == [(0, "get_weather", r.choices[j].message.tool_calls[0].function.arguments)]


def test_a_forced_call_that_does_not_parse_is_content_without_the_opening(scripted):
    msgs = [{"role": "user", "content": "Weather?"}]
    for choice in ("required", NAMED):
        _say(scripted, "I would rather not.")  # the named prompt extends the required one: a new script
        kw = dict(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice=choice, max_tokens=200)
        r = _client(scripted).chat.completions.create(**kw)
        assert _prompt(scripted).endswith("<tool_call>\n" + ("<function=get_weather>\n" if choice == NAMED else ""))
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("I would rather not.", "stop")
        assert not r.choices[0].message.tool_calls
        chunks = list(_client(scripted).chat.completions.create(stream=True, **kw))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "I would rather not."


def test_required_with_parallel_calls_off_returns_the_first_call(scripted):
    two = "<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n" + XML_REST
    _say(scripted, two)
    msgs = [{"role": "user", "content": "Time and weather?"}]
    kw = dict(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200)
    r = _client(scripted).chat.completions.create(**kw)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time", "get_weather"]
    r = _client(scripted).chat.completions.create(parallel_tool_calls=False, **kw)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def test_a_forced_call_the_model_ends_without_closing_is_still_a_call(scripted):
    """EOS right after </function>: the block Baton opened is parsed at the end, streamed or not."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice=NAMED, max_tokens=200)
    _say(scripted, XML_REST.replace("\n</tool_call>", ""))
    c = _client(scripted).chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
    _say(scripted, XML_REST.replace("\n</tool_call>", ""))
    chunks = list(_client(scripted).chat.completions.create(stream=True, **kw))
    assert _streamed_calls(chunks) == [(0, "get_weather", '{"city": "Paris", "days": 2}')]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# ---- streamed calls through the HTTP API ------------------------------------------------------------
def _sse(s, body: dict) -> list[dict]:
    """A streamed chat completion's chunks as sent (raw JSON), `data: [DONE]` checked and left out."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream("POST", s["url"] + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _post(s, body: dict) -> dict:
    r = httpx.post(
        s["url"] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()


TWO_FORMATS = (
    'Checking both.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "{iso}"}}\n'
    "</tool_call>\n" + XML_CALL
)


def test_a_streamed_call_comes_in_pieces_that_join_into_the_non_streamed_arguments(scripted):
    """A JSON call then an XML call (greedy, the same tokens both times): each call's first chunk has its id,
    type and name, later ones only its index and a piece; the pieces join into the non-streamed arguments."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Time and weather?"}],
        "tools": [WEATHER, TIME],
        "max_tokens": 200,
        "temperature": 0,
        "seed": 7,
    }
    _say(scripted, TWO_FORMATS)
    whole = _post(scripted, body)
    want = whole["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in want] == ["get_time", "get_weather"]
    assert want[0]["function"]["arguments"] == '{"tz": "Europe/Paris", "fmt": "{iso}"}'  # the model's text
    _say(scripted, TWO_FORMATS)
    chunks = _sse(scripted, {**body, "stream": True, "stream_options": {"include_usage": True}})
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    entries = [[e for e in d.get("tool_calls", [])] for d in deltas]
    assert all(len({e["index"] for e in es}) == len(es) for es in entries)  # an index once per chunk
    content, calls = _assemble([d.get("content") or "" for d in deltas] + [e for es in entries for e in es])
    assert content == "Checking both.\n\n" and [e["index"] for es in entries for e in es if "id" in e] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in want]  # byte-equal arguments, names
    assert calls[0]["id"] != calls[1]["id"] and all(c["id"].startswith("call_") for c in calls)
    for i, n in ((0, 5), (1, 4)):  # the JSON call's text, token by token; the XML call's 3 parameters and "}"
        chunks_of_i = [es for es in entries if any(e["index"] == i for e in es)]
        assert len(chunks_of_i) >= n, (i, chunks_of_i)
    xml_pieces = [e["function"]["arguments"] for es in entries for e in es if e["index"] == 1 and "id" not in e]
    assert xml_pieces == ['{"city": "New York"', ', "days": 3', ', "metric": true', "}"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_a_streamed_call_cut_short_keeps_its_pieces_and_the_routers_finish_reason(scripted):
    """max_tokens ends the text inside a call's arguments: the stream has sent the call's entry and the
    pieces so far and ends with "length"; the non-streamed response has the text as content (docs/HTTP.md).
    A call whose block turns out malformed after its arguments were sent ends likewise, with "stop"."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "days": 4}}\n</tool_call>'
    ids = scripted["tok"].encode(text)
    k = next(k for k in range(len(ids)) if '"city": "San' in scripted["tok"].decode(ids[:k]))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    _say(scripted, text)
    whole = _post(scripted, {**body, "max_tokens": k})["choices"][0]
    cut = scripted["tok"].decode(ids[:k])
    assert whole["message"] == {"role": "assistant", "content": cut} and whole["finish_reason"] == "length"
    _say(scripted, text)
    chunks = _sse(scripted, {**body, "max_tokens": k, "stream": True})
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    content, calls = _assemble(
        [d.get("content") or "" for d in deltas] + [e for d in deltas for e in d.get("tool_calls", [])]
    )
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": cut[cut.index("{\"city") :]}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # closed, but not a call: junk after the arguments' value
    junk = text.replace("4}}", "4}, oops}") + "\nSorry."
    _say(scripted, junk)
    whole = _post(scripted, {**body, "max_tokens": 200})["choices"][0]
    assert whole["message"]["content"] == junk and whole["finish_reason"] == "stop"
    _say(scripted, junk)
    chunks = _sse(scripted, {**body, "max_tokens": 200, "stream": True})
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    content, calls = _assemble(
        [d.get("content") or "" for d in deltas] + [e for d in deltas for e in d.get("tool_calls", [])]
    )
    assert content == "\nSorry." and calls[0]["function"]["arguments"] == '{"city": "San Francisco", "days": 4}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_structured_output_closes_an_open_think_block_first(tok):
    """Qwen3.5 with thinking on leaves "<think>\\n" open: a structured output starts at the first generated
    token, so the prompt closes the block empty (as enable_thinking false renders it) and the text is content;
    without thinking, or without a structured output, the prompt is the template's."""
    from router.http.chat import ChatTemplate
    from router.http.schemas import Limits, chat_prompt

    lim = Limits(MODEL, 4096, 16, tok, ChatTemplate(QWEN35_TEMPLATE.read_text(encoding="utf-8")))
    body = {"messages": [{"role": "user", "content": "A number?"}]}
    fmt = {"response_format": {"type": "json_object"}}
    thinking, _ = chat_prompt(body, lim)
    assert thinking.endswith("<think>\n")
    assert chat_prompt({**body, **fmt}, lim)[0] == thinking + "\n</think>\n\n"
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    assert chat_prompt({**off, **fmt}, lim)[0] == chat_prompt(off, lim)[0]
