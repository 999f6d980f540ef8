"""The reasoning parser (router/http/reasoning.py, the router's --reasoning-parser qwen3). The splitter on its
own: where reasoning starts (a prompt that leaves <think> open, or a text that opens it), where it ends, the
newlines around the tags, a text that ends while reasoning, no tags at all, and any split of the text into
deltas (every split point, every character, random multi-splits) giving the whole text's fields exactly, a
partial tag never leaking into either. Then through the real HTTP API (the `openai` client and httpx), with
the loopback fake workers of tests/router/test_http_tools.py writing a scripted answer under the Qwen3.5 chat
template: chat with the parser on (reasoning_content and content, streamed pieces joining into the
non-streamed fields), off (content as today), a tool call after reasoning, a length cut inside reasoning."""

from __future__ import annotations

import random

import httpx
import pytest
from test_http_api import TOKEN
from test_http_tools import (
    MODEL,
    WEATHER,
    XML_CALL,
    XML_REST,
    _client,
    _post,
    _prompt,
    _say,
    _sse,
    scripted_routers,
)

from baton.think_tags import think_open
from baton.v1 import common_pb2
from router.http.reasoning import ReasoningSplit

OPEN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # Qwen3.5, thinking on
CLOSED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking off

# (starts in reasoning, text, reasoning, content)
CASES = [
    (True, "Two and two.\n</think>\n\nThe answer is 4.", "Two and two.\n", "The answer is 4."),
    (True, "r</think>c</think>d<think>e", "r", "c</think>d<think>e"),  # after the first </think>: all content
    (True, "a <think> inside\n</think>\n\n\n  x\n", "a <think> inside\n", "  x\n"),  # newlines only stripped
    (True, "still thinking when max_tokens hit </thi", "still thinking when max_tokens hit </thi", None),
    (True, "", "", None),
    (True, "</think>\n\n", "", None),
    (False, "<think>\nI should greet.\n</think>\n\nHello!", "I should greet.\n", "Hello!"),
    (False, " \n <think>\n\nx</think>y", "\nx", "y"),  # one newline after the model's <think> dropped
    (False, "<think>no newline</think>\n\nok", "no newline", "ok"),
    (False, "<think>\nunclosed", "unclosed", None),
    (False, "<think>", "", None),
    (False, "Hello! No tags here.", None, "Hello! No tags here."),
    (False, "  <thinking> is not the tag", None, "  <thinking> is not the tag"),
    (False, "<thin", None, "<thin"),  # a partial tag at the end: text
    (False, "  \n", None, "  \n"),
    (False, "", None, ""),
    (False, "The answer.</think>\n\nmore", None, "The answer.</think>\n\nmore"),  # no reasoning: tags are text
]


def _pieces(splitter: ReasoningSplit, text: str, cuts: list[int]) -> tuple[list[str], list[str]]:
    rs, cs, last = [], [], 0
    for c in [*cuts, len(text)]:
        r, k = splitter.feed(text[last:c])
        rs, cs, last = rs + [r], cs + [k], c
    r, k = splitter.finish()
    return rs + [r], cs + [k]


@pytest.mark.parametrize("start, text, reasoning, content", CASES)
def test_the_whole_text_split(start, text, reasoning, content):
    assert ReasoningSplit(start).split(text) == (reasoning, content)


@pytest.mark.parametrize("start, text, reasoning, content", CASES)
def test_any_split_into_deltas_gives_the_whole_texts_fields(start, text, reasoning, content):
    rng = random.Random(len(text))
    splits = [[], list(range(1, len(text)))] + [[k] for k in range(len(text) + 1)]
    splits += [sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6)))) for _ in range(40)]
    for cuts in splits:
        rs, cs = _pieces(ReasoningSplit(start), text, cuts)
        assert ("".join(rs), "".join(cs)) == (reasoning or "", content or ""), cuts


def test_a_partial_tag_is_held_back_until_the_next_delta_decides():
    s = ReasoningSplit(True)
    assert s.feed("Let me see.\n</th") == ("Let me see.\n", "")  # "</th" may be the tag: in neither field yet
    assert s.feed("ink>\n") == ("", "")  # the tag, then a newline that may lead the content: dropped
    assert s.feed("\nIt is 4.") == ("", "It is 4.")
    assert s.finish() == ("", "")
    s = ReasoningSplit(True)
    assert s.feed("a </") == ("a ", "") and s.feed("b>") == ("</b>", "")  # not the tag after all: reasoning
    s = ReasoningSplit(False)
    assert s.feed("\n<thi") == ("", "") and s.feed("nk>") == ("", "") and s.feed("\nhm") == ("hm", "")
    assert s.feed("</think>") == ("", "") and s.feed("\n\nok") == ("", "ok")
    s = ReasoningSplit(False)
    assert s.feed("<thi") == ("", "") and s.feed("s is content") == ("", "<this is content")
    assert s.feed(" <think>") == ("", " <think>")  # once content, always content


def test_where_the_prompt_leaves_reasoning():
    assert think_open(OPEN) and not think_open(CLOSED)
    assert not think_open("<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n")
    history = CLOSED.replace("<think>\n\n</think>\n\n", "<think>\nhm\n</think>\n\nHello<|im_end|>\n")
    assert not think_open(history + "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    assert think_open(history + "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert think_open("no chat markup <think>") and not think_open("plain prompt")
    # thinking off: the prompt's closed empty block is not reasoning; the text is all content
    assert ReasoningSplit(think_open(CLOSED)).split("Hello!") == (None, "Hello!")
    assert ReasoningSplit(think_open(OPEN)).split("Hmm.\n</think>\n\nHello!") == ("Hmm.\n", "Hello!")


# ---- through the HTTP API --------------------------------------------------------------------------------
THOUGHT = "The user asks for 2 + 2.\nThat is <b>4</b>.\n"  # "<b>" starts like a tag: held, then reasoning
REASONED = THOUGHT + "</think>\n\nThe answer is 4."


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two routers over the same scripted fake workers (tests/router/test_http_tools.py): "url" with
    --reasoning-parser qwen3, "off" without."""
    from router.service import RouterConfig

    mp = pytest.MonkeyPatch()
    configs = {"url": RouterConfig(reasoning_parser="qwen3"), "off": RouterConfig()}
    yield from scripted_routers(tmp_path_factory, mp, configs)
    mp.undo()


def _ask(s, text: str, url: str = "url", **kw) -> dict:
    """The scripted model writes `text`: the chat response's JSON (raw), then its SSE chunks (raw)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 200, **kw}
    _say(s, text)
    whole = _post({"url": s[url]}, body)
    _say(s, text)
    return whole, _sse({"url": s[url]}, {**body, "stream": True})


def _joined(chunks: list[dict], choice: int = 0) -> tuple[str, str, list[str]]:
    """A choice's streamed reasoning_content and content joined, and the order its fields came in."""
    deltas = [c["delta"] for ch in chunks for c in ch["choices"] if c["index"] == choice]
    order = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    return (
        "".join(d.get("reasoning_content", "") for d in deltas),
        "".join(d.get("content") or "" for d in deltas),
        order,
    )


def _fields(order: list[str]) -> list[str]:
    return [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]


def test_reasoning_content_then_content_streamed_or_not(two):
    whole, chunks = _ask(two, REASONED)
    (choice,) = whole["choices"]
    assert choice["message"] == {"role": "assistant", "content": "The answer is 4.", "reasoning_content": THOUGHT}
    assert choice["finish_reason"] == "stop" and _prompt(two).endswith("<|im_start|>assistant\n<think>\n")
    assert whole["usage"]["completion_tokens"] == len(two["tok"].encode(REASONED)) + 1  # the whole text's, EOS
    reasoning, content, order = _joined(chunks)
    assert (reasoning, content) == (THOUGHT, "The answer is 4.")  # the non-streamed fields, exactly
    assert _fields(order) == ["reasoning_content", "content"] and len(order) > 5  # token by token, in that order
    assert not any("think>" in (d or "") for ch in chunks for c in ch["choices"] for d in c["delta"].values())
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # the openai client reads the same fields
    _say(two, REASONED)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    m = _client(two).chat.completions.create(model=MODEL, messages=msgs, max_tokens=200).choices[0].message
    assert (m.reasoning_content, m.content) == (THOUGHT, "The answer is 4.")
    _say(two, REASONED)
    stream = _client(two).chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, stream=True)
    parts = [(getattr(c.delta, "reasoning_content", None), c.delta.content) for ch in stream for c in ch.choices]
    assert "".join(r or "" for r, _ in parts) == THOUGHT and "".join(t or "" for _, t in parts) == "The answer is 4."


def _reasoning_tokens(tok, text: str) -> int:
    """The tokens of `text` up to the one whose text completes "</think>" (decoded one by one, as the router)."""
    acc = ""
    for i, t in enumerate(tok.encode(text)):
        acc += tok.decode([t])
        if "</think>" in acc:
            return i + 1
    return len(tok.encode(text))


def test_usage_counts_the_reasoning_tokens(two):
    """usage.completion_tokens_details.reasoning_tokens: the tokens up to the one that completes </think>, in
    the whole response, the streamed usage chunk and the openai client; all of a text cut inside its
    reasoning; none when the text had no reasoning block (thinking off), and no field with the parser off."""
    want = _reasoning_tokens(two["tok"], REASONED)
    assert 5 < want < len(two["tok"].encode(REASONED))  # the answer's tokens come after
    whole, _ = _ask(two, REASONED)
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
    _say(two, REASONED)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 200}
    streamed = _sse({"url": two["url"]}, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
    _say(two, REASONED)
    r = _client(two).chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=200)
    assert r.usage.completion_tokens_details.reasoning_tokens == want
    whole, _ = _ask(two, REASONED, n=2)  # each choice's own count
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * want}
    whole, _ = _ask(two, REASONED, max_tokens=4)  # cut inside the reasoning: every token is reasoning
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    whole, _ = _ask(two, "Hello! </think> is text here.", **off)
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    whole, _ = _ask(two, REASONED, url="off")
    assert "completion_tokens_details" not in whole["usage"]


def test_each_choice_has_its_own_splitter(two):
    whole, chunks = _ask(two, REASONED, n=3)
    for j in range(3):
        assert whole["choices"][j]["message"]["reasoning_content"] == THOUGHT
        assert _joined(chunks, j)[:2] == (THOUGHT, "The answer is 4.")


def test_with_the_parser_off_the_text_is_content_as_before(two):
    whole, chunks = _ask(two, REASONED, url="off")
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": REASONED}  # no reasoning_content key
    assert _joined(chunks)[:2] == ("", REASONED) and _fields(_joined(chunks)[2]) == ["content"]
    assert not any("reasoning_content" in c["delta"] for ch in chunks for c in ch["choices"])
    # completions are never split, parser on or not
    _say(two, REASONED)
    body = {"model": MODEL, "prompt": "<|im_start|>assistant\n<think>\n", "max_tokens": 200}
    r = httpx.post(two["url"] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.json()["choices"][0]["text"] == REASONED


def test_thinking_off_or_a_model_that_opens_its_own_block(two):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    whole, chunks = _ask(two, "Hello!", **off)  # the prompt's block is closed: all content
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}
    assert _joined(chunks)[:2] == ("", "Hello!") and _fields(_joined(chunks)[2]) == ["content"]
    assert _prompt(two).endswith("<think>\n\n</think>\n\n")
    whole, chunks = _ask(two, "<think>\nHm.\n</think>\n\nHello!", **off)  # the model opens one itself
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello!", "reasoning_content": "Hm.\n"}
    assert _joined(chunks)[:2] == ("Hm.\n", "Hello!")


def test_a_tool_call_after_reasoning(two):
    thought = "Maybe <tool_call> with get_weather.\n"  # markup in the reasoning is not a call
    whole, chunks = _ask(two, thought + "</think>\n\n" + XML_CALL, tools=[WEATHER])
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == thought
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "New York", "days": 3, "metric": true}'}
    reasoning, content, _ = _joined(chunks)
    assert (reasoning, content) == (thought, "")
    entries = [e for ch in chunks for c in ch["choices"] for e in c["delta"].get("tool_calls", [])]
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(e["function"]["arguments"] for e in entries) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a forced call closes the prompt's block: no reasoning, the call parsed as with the parser off
    forced = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole, chunks = _ask(two, XML_REST, **forced)
    msg = whole["choices"][0]["message"]
    assert (
        "reasoning_content" not in msg
        and msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'
    )
    assert _joined(chunks)[:2] == ("", "")


def test_a_length_cut_inside_the_reasoning_is_all_reasoning(two):
    ids = two["tok"].encode(REASONED)
    k = next(k for k in range(len(ids)) if "That is" in two["tok"].decode(ids[:k]))
    cut = two["tok"].decode(ids[:k])
    whole, chunks = _ask(two, REASONED, max_tokens=k)
    (choice,) = whole["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "reasoning_content": cut}
    assert choice["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == k
    assert _joined(chunks)[:2] == (cut, "") and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # a stop string inside the reasoning ends it there too (stop strings apply to the whole text)
    whole, chunks = _ask(two, REASONED, stop=["<b>"])
    assert whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "The user asks for 2 + 2.\nThat is ",
    }
    assert _joined(chunks)[:2] == ("The user asks for 2 + 2.\nThat is ", "")


def test_the_option_is_checked_on_both_entry_points(capsys):
    import argparse
    import subprocess
    import sys
    from pathlib import Path

    from deploy.serve_args import add_arguments

    p = argparse.ArgumentParser(prog="baton serve")
    add_arguments(p)
    assert p.parse_args([]).reasoning_parser == "none" and p.parse_args(["--reasoning-parser", "qwen3"])
    with pytest.raises(SystemExit) as ei:
        p.parse_args(["--reasoning-parser", "deepseek"])
    assert ei.value.code == 2 and "choose from none, qwen3" in capsys.readouterr().err.replace("'", "")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-m", "router", "--reasoning-parser", "qwen", "--prefill", "x:1", "--decode", "x:2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--reasoning-parser: invalid choice: " in r.stderr, r.stderr
    assert "none, qwen3" in r.stderr.replace("'", "")


def test_a_structured_output_after_reasoning_with_the_parser_on():
    """Chat with response_format and the reasoning parser on (vLLM's behaviour): a prompt that leaves <think>
    open stays open and the structure applies after "</think>" (StructuredOutput.after_token = its id, when
    it is one token of the vocabulary); with the parser off, or no such token, the block is closed empty
    first and the structure starts at once (as before)."""
    from test_http_tools import DEFAULT_DIR, QWEN35_TEMPLATE

    from baton.tokenizer import Tokenizer
    from router.http.chat import ChatTemplate
    from router.http.schemas import Limits, parse_chat

    real = Tokenizer.from_dir(DEFAULT_DIR)

    class OneTag:  # the default model's tokenizer, with "</think>" as one token (Qwen3.5's is: 248069)
        def encode(self, text):
            return [7] if text == "</think>" else real.encode(text)

        def decode(self, ids, **kw):
            return real.decode(ids, **kw)

    template = ChatTemplate(QWEN35_TEMPLATE.read_text(encoding="utf-8"))
    body = {"messages": [{"role": "user", "content": "A user as JSON"}], "response_format": {"type": "json_object"}}
    for tok, parser, after in ((OneTag(), "qwen3", 7), (OneTag(), "none", None), (real, "qwen3", None)):
        job = parse_chat(body, Limits(MODEL, 4096, 16, tok, template, reasoning_parser=parser))
        (r,) = job.requests
        prompt = real.decode(list(r.token_ids.ids))
        assert r.sampling.structured.json_object
        if after is None:
            assert not r.sampling.structured.HasField("after_token") and prompt.endswith("</think>\n\n")
            assert not job.reasoning
        else:
            assert r.sampling.structured.after_token == after and think_open(prompt) and job.reasoning


def test_a_thinking_budget_bounds_the_reasoning_on_every_api():
    """vLLM's thinking_token_budget (chat, completions, Responses) and Anthropic's thinking.budget_tokens ->
    SamplingParams.thinking_budget, which the router resolves (baton/sampling_rules.py think_budget) in the
    workers' copy: alone, any_text with after_token = "</think>"'s id and after_budget; beside a structure that reasons
    first, its after_budget. No effect where nothing is reasoned (thinking off, a structure that skips the
    reasoning with the parser off, "</think>" not one token); beside structured.after_budget, refused.
    A bad value is a 400 naming the field the body used."""
    import dataclasses

    from test_http_tools import DEFAULT_DIR, QWEN35_TEMPLATE

    from baton.sampling_rules import think_budget
    from baton.tokenizer import Tokenizer
    from router.http.chat import ChatTemplate
    from router.http.errors import ApiError
    from router.http.messages import parse_messages
    from router.http.responses import parse_responses
    from router.http.schemas import Limits, parse_chat, parse_completion

    real = Tokenizer.from_dir(DEFAULT_DIR)

    class OneTag:  # "</think>" as one token, as Qwen3.5's
        def encode(self, text):
            return [7] if text == "</think>" else real.encode(text)

        def decode(self, ids, **kw):
            return real.decode(ids, **kw)

    template = ChatTemplate(QWEN35_TEMPLATE.read_text(encoding="utf-8"))
    lim = Limits(MODEL, 4096, 16, OneTag(), template, reasoning_parser="qwen3")
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]

    def resolved(parse, body, limits=lim, tok=OneTag()):
        """(the request's thinking_budget, the workers' structured after the router resolved it, job)."""
        job = parse(body, limits)
        job = job[0] if isinstance(job, tuple) else job
        (r,) = job.requests
        asked = r.sampling.thinking_budget if r.sampling.HasField("thinking_budget") else None
        think_budget(r.sampling, r.token_ids.ids, tok)
        assert not r.sampling.HasField("thinking_budget")  # the workers never see it
        return asked, (r.sampling.structured if r.sampling.HasField("structured") else None), job

    asked, s, job = resolved(parse_chat, {"messages": msgs, "thinking_token_budget": 12})
    assert asked == 12 and (s.any_text, s.after_token, s.after_budget) == (True, 7, 12)
    assert job.rename["sampling.thinking_budget"] == "thinking_token_budget"
    json_obj = {"response_format": {"type": "json_object"}}
    _, s, _ = resolved(parse_chat, {"messages": msgs, "thinking_token_budget": 0, **json_obj})
    assert s.json_object and (s.after_token, s.after_budget) == (7, 0)
    thinking = {"type": "enabled", "budget_tokens": 30}
    _, s, _ = resolved(parse_messages, {"messages": msgs, "max_tokens": 64, "thinking": thinking})
    assert (s.any_text, s.after_token, s.after_budget) == (True, 7, 30)
    _, s, _ = resolved(parse_responses, {"input": "What is 2 + 2?", "thinking_token_budget": 5})
    assert (s.any_text, s.after_budget) == (True, 5)
    raw = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # completions: the prompt's own text
    _, s, _ = resolved(parse_completion, {"prompt": raw, "max_tokens": 8, "thinking_token_budget": 4})
    assert (s.any_text, s.after_token, s.after_budget) == (True, 7, 4)
    assert resolved(parse_completion, {"prompt": "2 + 2 =", "max_tokens": 8, "thinking_token_budget": 4})[1] is None
    # nothing reasoned: no budget
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert resolved(parse_chat, {"messages": msgs, "thinking_token_budget": 12, **off})[1] is None
    assert resolved(parse_messages, {"messages": msgs, "max_tokens": 9, "thinking": {"type": "disabled"}})[0] is None
    assert resolved(parse_chat, {"messages": msgs, "thinking_token_budget": 12}, tok=real)[1] is None
    parser_off = dataclasses.replace(lim, reasoning_parser="none")
    _, s, _ = resolved(parse_chat, {"messages": msgs, "thinking_token_budget": 3, **json_obj}, parser_off)
    assert not s.HasField("after_budget") and not s.HasField("after_token")
    job = parse_chat({"messages": msgs, "thinking_token_budget": 3}, lim)
    job.requests[0].sampling.structured.CopyFrom(
        common_pb2.StructuredOutput(any_text=True, after_token=7, after_budget=1)
    )
    with pytest.raises(ValueError, match=r"^sampling.thinking_budget: not with sampling.structured.after_budget"):
        think_budget(job.requests[0].sampling, job.requests[0].token_ids.ids, OneTag())
    for parse, body, field in (
        (parse_chat, {"messages": msgs, "thinking_token_budget": -1}, "thinking_token_budget"),
        (parse_chat, {"messages": msgs, "thinking_token_budget": "9"}, "thinking_token_budget"),
        (
            parse_messages,
            {"messages": msgs, "max_tokens": 9, "thinking": {"type": "enabled", "budget_tokens": 1.5}},
            "thinking.budget_tokens",
        ),
    ):
        with pytest.raises(ApiError) as ei:
            parse(body, lim)
        assert ei.value.status == 400 and ei.value.param == field, (ei.value.param, ei.value.message)


def test_a_reasoning_effort_of_none_or_minimal_turns_thinking_off(two):
    """chat's reasoning_effort / the Responses API's reasoning.effort (reasoning.effort_kwargs): none and minimal
    render the prompt with thinking off (a closed empty block: all content), the others leave it on;
    chat_template_kwargs' own enable_thinking wins; another value is a 400 naming the field."""
    for effort, closed in (("none", True), ("minimal", True), ("low", False), ("high", False)):
        whole, _ = _ask(two, "Hello!" if closed else REASONED, reasoning_effort=effort)
        assert _prompt(two).endswith("<think>\n\n</think>\n\n") is closed, effort
        msg = whole["choices"][0]["message"]
        assert ("reasoning_content" not in msg) is closed and msg["content"] in ("Hello!", "The answer is 4.")
    kw = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    _ask(two, REASONED, **kw)
    assert _prompt(two).endswith("<|im_start|>assistant\n<think>\n")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}
    r = httpx.post(
        two["url"] + "/v1/chat/completions", json=ask, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    _say(two, "Hello!")
    body = {"model": MODEL, "input": "Hi", "reasoning": {"effort": "minimal"}}
    got = httpx.post(two["url"] + "/v1/responses", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert got.status_code == 200 and _prompt(two).endswith("<think>\n\n</think>\n\n")
    assert got.json()["reasoning"]["effort"] == "minimal" and got.json()["output"][-1]["content"][0]["text"] == "Hello!"
    body["reasoning"] = {"effort": "extreme"}
    bad = httpx.post(two["url"] + "/v1/responses", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort", bad.text


def test_the_reasoning_token_count_ends_at_the_token_that_completes_the_tag():
    """ReasoningSplit.count / tokens: a tag inside one long token, or split across two, closes the count there."""
    r = ReasoningSplit(True)
    for t in ("Hm.", "</think>\n\nThe answer is four, as asked.", "more"):
        r.count(t)
    assert r.closed and r.tokens == 2
    r = ReasoningSplit(True)
    for t in ("a", "</thi", "nk>", "b"):
        r.count(t)
    assert r.closed and r.tokens == 3
    r = ReasoningSplit(False)  # no reasoning block entered: none counted
    r.count("x")
    assert r.tokens == 0
