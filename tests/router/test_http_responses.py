"""OpenAI's Responses API (POST /v1/responses: router/http/responses.py, response_events.py) with the official
`openai` client and httpx, on a router in this process over the scripted fake workers of test_http_tools.py
(the Qwen3.5 template, --reasoning-parser qwen3): a known answer's reasoning, content and tool call become
reasoning, message and function_call items, streamed (the events in OpenAI's order, sequence numbers from 0,
the deltas joining into the non-streamed fields) or not; input items render the prompt the equivalent chat
messages render; max_output_tokens gives an incomplete response; refusals name the Responses field. Through
the real model: test_http_api.py test_responses_equal_chat_completions."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_http_api import TOKEN, assert_error
from test_http_tools import MODEL, TIME, TWO_FORMATS, WEATHER, XML_CALL, _client, _prompt, _say, scripted_routers

THOUGHT = "The user wants the weather.\n"
ANSWER = "Let me look that up.\n\n"
TEXT = THOUGHT + "</think>\n\n" + ANSWER + XML_CALL
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
ARGS = {"city": "New York", "days": 3, "metric": True}
ASK = [{"role": "user", "content": "Weather in New York?"}]


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    """Routers with --reasoning-parser qwen3 over the scripted fake workers: "url" keeps responses (the
    default store), "nostore" with --responses-store-mb 0."""
    from router.service import RouterConfig

    mp = pytest.MonkeyPatch()
    configs = {
        "url": RouterConfig(reasoning_parser="qwen3"),
        "nostore": RouterConfig(reasoning_parser="qwen3", responses_store_mb=0),
    }
    yield from scripted_routers(tmp_path_factory, mp, configs)
    mp.undo()


def _post(s, body: dict, path: str = "/v1/responses", url: str = "url") -> httpx.Response:
    return httpx.post(s[url] + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


def _events(s, body: dict) -> list[tuple[str, dict]]:
    """A streamed response's (event name, data) as sent."""
    with httpx.stream(
        "POST", s["url"] + "/v1/responses", json={**body, "stream": True}, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    names = [x[len("event: ") :] for x in lines if x.startswith("event: ")]
    data = [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: ")]
    assert len(names) == len(data) and "[DONE]" not in lines
    return list(zip(names, data))


def test_reasoning_message_and_call_items_streamed_or_not(s):
    body = {"model": MODEL, "input": ASK, "tools": [TOOL], "max_output_tokens": 300}
    _say(s, TEXT)
    r = _client(s).responses.create(**body)
    assert r.status == "completed" and r.id.startswith("resp_") and r.incomplete_details is None
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r.output
    assert reasoning.content[0].text == THOUGHT and reasoning.id.startswith("rs_")
    assert message.role == "assistant" and message.status == "completed"
    assert [p.type for p in message.content] == ["output_text"] and message.content[0].text.strip() == ANSWER.strip()
    assert r.output_text == message.content[0].text  # the client's own join of the output_text parts
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS and call.call_id.startswith("call_")
    assert r.usage.output_tokens == len(s["tok"].encode(TEXT)) + 1  # the whole text's tokens and EOS
    assert r.usage.input_tokens == len(s["tok"].encode(_prompt(s))) and r.usage.total_tokens > r.usage.input_tokens
    ids, head = s["tok"].encode(TEXT), ""  # the reasoning's tokens: up to the one that completes </think>
    thought = next(i + 1 for i, t in enumerate(ids) if "</think>" in (head := head + s["tok"].decode([t])))
    assert r.usage.output_tokens_details.reasoning_tokens == thought < r.usage.output_tokens
    assert r.tools[0].name == "get_weather" and r.store is True

    _say(s, TEXT)
    events = _events(s, body)
    names = [n for n, _ in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == n for n, d in events)
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    opened = [d["item"]["type"] for n, d in events if n == "response.output_item.added"]
    assert opened == ["reasoning", "message", "function_call"]
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"] and final["output"] == done

    def joined(kind):
        return "".join(d["delta"] for n, d in events if n == kind)

    assert joined("response.reasoning_text.delta") == THOUGHT == done[0]["content"][0]["text"]
    assert joined("response.output_text.delta") == message.content[0].text == done[1]["content"][0]["text"]
    assert joined("response.function_call_arguments.delta") == done[2]["arguments"] == call.arguments
    assert len([n for n in names if n.endswith(".delta")]) > 10  # token by token
    # every item's events lie between its added and done events, in output order
    spans = [i for i, (n, _) in enumerate(events) if n in ("response.output_item.added", "response.output_item.done")]
    assert [events[i][1]["output_index"] for i in spans] == [0, 0, 1, 1, 2, 2]
    assert final["usage"]["output_tokens"] == r.usage.output_tokens and final["status"] == "completed"
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": thought}
    assert _get(s, final["id"]).json() == final  # a streamed response is stored as its final event holds it

    # the openai client's own stream reads the same
    _say(s, TEXT)
    with _client(s).responses.stream(**body) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        got = stream.get_final_response()
    assert text == message.content[0].text and got.output[2].arguments == call.arguments


def test_input_items_render_the_equivalent_chat_prompt(s):
    """instructions, a function_call after the assistant's text, its output, and an assistant reasoning item:
    the prompt is the chat template's for the equivalent chat messages."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls, "reasoning_content": "Look it up."},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Rome?"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Look it up."}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 C"},
    ]
    _say(s, "It is sunny.")
    r = _post(s, {"input": items, "instructions": "Be brief.", "tools": [TOOL]})
    assert r.status_code == 200, r.text
    via_responses = _prompt(s)
    assert r.json()["output"][-1]["content"][0]["text"] == "It is sunny."
    _say(s, "It is sunny.")
    c = _post(s, {"messages": chat, "tools": [WEATHER]}, "/v1/chat/completions")
    assert c.status_code == 200, c.text
    assert _prompt(s) == via_responses and "Sunny, 24 C" in via_responses and "Be brief." in via_responses
    _say(s, "Hi.")
    r = _post(s, {"input": "Hello"})  # a string: one user message
    assert r.status_code == 200 and "Hello" in _prompt(s) and r.json()["output"][-1]["content"][0]["text"] == "Hi."


def test_max_output_tokens_gives_an_incomplete_response(s):
    _say(s, ANSWER * 20)
    r = _post(s, {"input": ASK, "max_output_tokens": 5, "chat_template_kwargs": {"enable_thinking": False}})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "incomplete", body
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["usage"]["output_tokens"] == 5
    assert body["output"][-1]["status"] == "incomplete" and body["max_output_tokens"] == 5
    _say(s, ANSWER * 20)
    events = _events(s, {"input": ASK, "max_output_tokens": 5})
    assert events[-1][0] == "response.incomplete" and events[-1][1]["response"]["status"] == "incomplete"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "previous_response_id": 3}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": 3}}}, "text.format"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
        ({"input": "x", "include": "message.output_text.logprobs"}, "include"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "metadata": {"a": 1}}, "metadata"),
    ],
)
def test_refusals_name_the_responses_field(s, body, field):
    r = _post(s, body)
    assert_error(r, 400)
    err = r.json()["error"]
    assert err["message"].startswith(field), err
    _say(s, "ok")
    assert _post(s, {"input": "x"}).status_code == 200  # and the next one is served


def _get(s, rid: str, url: str = "url", method: str = "GET") -> httpx.Response:
    h = {"Authorization": f"Bearer {TOKEN}"}
    return httpx.request(method, s[url] + "/v1/responses/" + rid, headers=h, timeout=10)


def test_a_stored_response_is_read_back_and_continued(s):
    """store (default true): GET /v1/responses/{id} gives the response object; previous_response_id continues
    the conversation: the prompt holds the earlier turn's input, reasoning-free answer and the new input, with
    the new request's instructions only (OpenAI's rule); a chain of three turns joins all of them."""
    api = _client(s)
    plain = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}  # the answers are all content
    _say(s, "Paris is sunny.")
    first = api.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.", **plain)
    assert first.store is True and first.previous_response_id is None
    got = api.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == "Paris is sunny." and got.status == "completed"
    assert got.model_dump() == first.model_dump()  # the object as created, field for field
    raw = _post(s, {"input": "Hi", **plain["extra_body"]}).json()
    assert _get(s, raw["id"]).json() == raw  # (raw JSON too)
    _say(s, "Rome too.")
    second = api.responses.create(
        model=MODEL, input="And Rome?", previous_response_id=first.id, instructions="Answer in one line.", **plain
    )
    prompt = _prompt(s)
    assert second.previous_response_id == first.id and second.output_text == "Rome too."
    assert prompt.index("Weather in Paris?") < prompt.index("Paris is sunny.") < prompt.index("And Rome?")
    assert "Answer in one line." in prompt and "Be brief." not in prompt  # instructions are not carried over
    _say(s, "Yes.")
    third = api.responses.create(model=MODEL, input="Both sunny?", previous_response_id=second.id, **plain)
    prompt = _prompt(s)
    order = ["Weather in Paris?", "Paris is sunny.", "And Rome?", "Rome too.", "Both sunny?"]
    assert [prompt.index(x) for x in order] == sorted(prompt.index(x) for x in order), prompt
    assert third.output_text == "Yes."
    # the same conversation sent whole renders the same prompt
    whole = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Paris is sunny."},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", "content": "Rome too."},
        {"role": "user", "content": "Both sunny?"},
    ]
    _say(s, "Yes.")
    body = {"input": whole, "store": False, **plain["extra_body"]}
    assert _post(s, body).status_code == 200 and _prompt(s) == prompt


def test_a_tool_call_is_continued_with_its_output(s):
    """The agent loop: a function_call answer, then only its function_call_output with previous_response_id."""
    _say(s, TEXT)
    r = _post(s, {"input": ASK, "tools": [TOOL]}).json()
    call = r["output"][-1]
    assert call["type"] == "function_call"
    _say(s, "It is 20 C.")
    body = {
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "20 C, clear"}],
        "previous_response_id": r["id"],
        "tools": [TOOL],
    }
    again = _post(s, body)
    assert again.status_code == 200, again.text
    prompt = _prompt(s)
    at = prompt.index("Weather in New York?")
    assert at < prompt.index("<tool_call>", at) < prompt.rindex("get_weather") < prompt.index("20 C, clear"), prompt
    assert again.json()["output"][-1]["content"][0]["text"] == "It is 20 C."


def test_store_false_deleted_and_off_are_not_continued(s):
    _say(s, "a")
    kept = _post(s, {"input": "one"}).json()
    _say(s, "b")
    child = _post(s, {"input": "two", "previous_response_id": kept["id"]}).json()
    _say(s, "c")
    unkept = _post(s, {"input": "three", "store": False}).json()
    assert unkept["store"] is False
    assert_error(_get(s, unkept["id"]), 404)
    r = _post(s, {"input": "x", "previous_response_id": unkept["id"]})
    assert_error(r, 400)
    assert r.json()["error"]["param"] == "previous_response_id" and "not found" in r.json()["error"]["message"]
    # DELETE: gone, and a later turn of its conversation can no longer be continued (it names the lost one)
    d = _get(s, kept["id"], method="DELETE")
    assert d.status_code == 200 and d.json() == {"id": kept["id"], "object": "response", "deleted": True}
    assert_error(_get(s, kept["id"]), 404)
    assert_error(_get(s, kept["id"], method="DELETE"), 404)
    r = _post(s, {"input": "x", "previous_response_id": child["id"]})
    assert_error(r, 400)
    assert kept["id"] in r.json()["error"]["message"]
    assert _get(s, child["id"]).status_code == 200  # itself still readable
    # /metrics counts what is kept
    text = httpx.get(s["url"] + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    stored = {
        ln.split(" ")[0]: float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("baton_router_responses_")
    }
    assert stored["baton_router_responses_stored"] >= 2 and stored["baton_router_responses_stored_bytes"] > 1000
    assert stored["baton_router_responses_evicted_total"] == 0
    # the router's store off: nothing kept, echoed store false, a previous_response_id names the option
    _say(s, "d")
    off = _post(s, {"input": "one"}, url="nostore").json()
    assert off["store"] is False
    assert_error(_get(s, off["id"], url="nostore"), 404)
    r = _post(s, {"input": "x", "previous_response_id": off["id"]}, url="nostore")
    assert_error(r, 400)
    assert "--responses-store-mb 0" in r.json()["error"]["message"]


_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 3),
    st.text(max_size=5),
    st.lists(st.integers(-1, 3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_part = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image", "x"]), "text": st.text(max_size=8)}
    ),
    _value,
)
_text = st.one_of(st.text(max_size=8), st.lists(_part, max_size=2), _value)
_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x"]), "content": _text}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.one_of(st.just("call_1"), _value),
            "name": st.one_of(st.just("get_weather"), _value),
            "arguments": st.one_of(st.just('{"city": "Rome"}'), _value),
        }
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("call_1"), "output": _text}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["reasoning", "item_reference"]), "content": _text, "summary": _value}
    ),
    _value,
)
_fields = {
    "input": st.one_of(st.text(max_size=8), st.lists(_item, max_size=4), _value),
    "instructions": st.one_of(st.text(max_size=8), _value),
    "tools": st.one_of(
        st.just([TOOL]),
        st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]), "name": _value}), max_size=2
        ),
        _value,
    ),
    "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required"]),
        st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["get_weather", "x"])}),
        _value,
    ),
    "text": st.one_of(
        st.fixed_dictionaries(
            {
                "format": st.one_of(
                    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_schema", "x"])}), _value
                )
            }
        ),
        _value,
    ),
    "include": st.one_of(st.just(["message.output_text.logprobs"]), _value),
    "top_logprobs": _value,
    "metadata": _value,
    "stream": st.one_of(st.booleans(), _value),
    "max_output_tokens": st.one_of(st.integers(-1, 3), _value),
    "reasoning": _value,
    "store": _value,
    "truncation": st.one_of(st.sampled_from(["disabled", "auto"]), _value),
    "parallel_tool_calls": _value,
    "temperature": _value,
    "previous_response_id": _value,
}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.fixed_dictionaries({}, optional=_fields), _value))
def test_fuzz_never_500(s, body):
    _say(s, "ok")
    r = _post(s, body)
    assert r.status_code in (200, 400, 413, 429), (body, r.status_code, r.text)
    if r.status_code != 200:
        assert_error(r, r.status_code)


def test_two_calls_are_two_function_call_items(s):
    """Two calls in one answer (a JSON one, then an XML one): two function_call items in order, each streamed
    call's argument deltas joining into its non-streamed arguments."""
    tools = [TOOL, {"type": "function", **TIME["function"]}]
    _say(s, "</think>\n\n" + TWO_FORMATS)
    body = _post(s, {"input": ASK, "tools": tools}).json()
    calls = [o for o in body["output"] if o["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_time", "get_weather"] and json.loads(calls[1]["arguments"]) == ARGS
    _say(s, "</think>\n\n" + TWO_FORMATS)
    events = _events(s, {"input": ASK, "tools": tools})
    for c in calls:
        at = next(
            d["output_index"]
            for n, d in events
            if n == "response.output_item.added" and d["item"].get("name") == c["name"]
        )
        got = "".join(
            d["delta"] for n, d in events if n == "response.function_call_arguments.delta" and d["output_index"] == at
        )
        assert got == c["arguments"], c["name"]


def test_a_coding_agents_request_is_served(s):
    """The shape of a coding agent's Responses request (Codex's, store false): a developer message, an earlier
    reasoning item with encrypted content, include reasoning.encrypted_content, prompt_cache_key, text
    verbosity, a strict function tool, streamed."""
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a command",
        "strict": False,
        "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}},
    }
    body = {
        "model": MODEL,
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_0", "summary": [], "encrypted_content": "gAAAA..."},
        ],
        "tools": [shell],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "conv-1",
        "text": {"verbosity": "medium"},
    }
    call = (
        "<tool_call>\n<function=shell>\n<parameter=command>\n[\"ls\", \"-la\"]\n</parameter>\n</function>\n</tool_call>"
    )
    _say(s, "</think>\n\n" + call)
    events = _events(s, body)
    done = events[-1][1]["response"]
    assert events[-1][0] == "response.completed" and [o["type"] for o in done["output"]] == ["function_call"]
    assert json.loads(done["output"][0]["arguments"]) == {"command": ["ls", "-la"]}
    assert "Sandbox: none." in _prompt(s) and "You are a coding agent." in _prompt(s)
