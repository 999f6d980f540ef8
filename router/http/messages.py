"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): a request as the chat request
it means, as router/http/responses.py does for OpenAI's Responses API.

    job, req = parse_messages(body, lim)     # ApiError(400 / 404) naming the Messages field
    count_tokens(body, lim)                  # {"input_tokens": N}: the prompt's ids, no model run

The chat path runs the request whole (the template, tools and forced calls, the reasoning parser, sampling,
exact mode, admission); router/http/message_events.py turns its stream into the Messages output and events.

Translation (docs/HTTP.md, "The Messages API"):
    system (a string or text blocks)      -> a first system message
    messages [{role: user | assistant, content: a string or blocks}]:
        text                               -> the message's content
        thinking (assistant)               -> its reasoning_content (redacted_thinking: left out)
        tool_use (assistant: id, name, input) -> its tool_calls (arguments: the input as JSON)
        tool_result (user: tool_use_id, content) -> a tool message each, before the user's own text
    max_tokens (required)                  -> max_completion_tokens, capped to the router's max_new_tokens
                                            limit and to what the window leaves after the prompt
    stop_sequences                         -> stop
    tools [{name, description, input_schema}] -> function tools; tool_choice auto / any / tool / none ->
                                            "auto" / "required" / the named function / "none";
                                            disable_parallel_tool_use -> parallel_tool_calls: false
    thinking {type: enabled | disabled}    -> chat_template_kwargs.enable_thinking (Qwen3.5's switch; a
                                            chat_template_kwargs given wins); budget_tokens -> the chat's
                                            thinking_token_budget (enforced: at most that many thinking
                                            tokens, then </think>)
    temperature, top_p, top_k, stream, model, and Baton's / vLLM's extras (PASSED) as they are.
Refused (400 naming the field): image, document and other non-text blocks, server tools (a tool with a
`type` other than "custom"), mcp_servers, container. cache_control marks, metadata and service_tier are read
and ignored.
"""

from __future__ import annotations

import json

from router.http.errors import ApiError, bad
from router.http.fields import _str, _text
from router.http.responses import rename_error, renamed
from router.http.schemas import Job, Limits, parse_chat
from router.http.tokenize import tokenize
from router.http.tools import flat_tools

PASSED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "truncate_prompt_tokens",
    "chat_template_kwargs",
    "cache_salt",
    "priority",
    "baton",
)
REFUSED = {"mcp_servers": "MCP servers are not supported", "container": "containers are not supported"}
TEXT = ("text",)  # the blocks a system prompt or a tool_result holds
TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
RENAMES = [  # the chat path's field names -> the Messages request's (responses.py rename_error)
    (r"^max_completion_tokens\b", "max_tokens"),
    (r"^stop\b", "stop_sequences"),
    (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"^tool_choice\.function\.", "tool_choice."),
    (r"^parallel_tool_calls\b", "tool_choice.disable_parallel_tool_use"),
    (r"^thinking_token_budget\b", "thinking.budget_tokens"),
]


def parse_messages(body, lim: Limits) -> tuple[Job, None]:
    """The body -> the chat path's Job (streamed, with the usage chunk); the output needs nothing more of the
    request (message_events.py: its prompt tokens are the Run's)."""
    chat = to_chat(body)
    n = body.get("max_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise bad("max_tokens", f"{n!r:.20}: required, an integer >= 1")
    # Anthropic's clients ask for far more than a window holds (32,000 is common): capped to the router's limit
    # and to what the window leaves after the prompt; the cut reads as stop_reason "max_tokens"
    chat["max_completion_tokens"] = max(1, min(n, lim.max_new_tokens or n, lim.usable - 1))
    try:
        job = parse_chat(chat, lim)
    except ApiError as e:
        raise rename_error(e, RENAMES) from None
    r = job.requests[0]
    r.max_new_tokens = max(1, min(r.max_new_tokens, lim.usable - len(r.token_ids.ids)))
    job.rename = {k: renamed(v, RENAMES) for k, v in job.rename.items()}
    job.rename.setdefault("max_new_tokens", "max_tokens")
    return job, None


def count_tokens(body, lim: Limits) -> dict:
    """POST /v1/messages/count_tokens: {"input_tokens": the ids the same request's prompt would send}."""
    chat = to_chat(body)
    keep = ("model", "messages", "tools", "tool_choice", "chat_template_kwargs")
    try:
        ids = tokenize({k: chat[k] for k in keep if k in chat}, lim)
    except ApiError as e:
        raise rename_error(e, RENAMES) from None
    return {"input_tokens": ids["count"]}


def to_chat(body) -> dict:
    """A Messages body -> the chat completion body it means (module doc), but max_tokens (parse_messages)."""
    if not isinstance(body, dict):
        raise bad("body", f"expected a JSON object, got {type(body).__name__}")
    for name, why in REFUSED.items():
        if body.get(name):
            raise bad(name, why)
    chat = {k: body[k] for k in PASSED if k in body}
    if body.get("stream") not in (None, True, False):
        raise bad("stream", "expected a boolean")
    chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    system = body.get("system")
    messages = [{"role": "system", "content": _text(system, "system", TEXT)}] if system else []
    chat["messages"] = messages + chat_messages(body.get("messages"))
    stops = body.get("stop_sequences")
    if stops is not None:
        chat["stop"] = stops
    if body.get("tools") is not None:
        chat["tools"] = flat_tools(
            body["tools"], "custom", "input_schema", "only client tools (Baton runs no server tools)"
        )
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise bad("thinking", 'expected {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}')
        kwargs = chat.get("chat_template_kwargs")
        if kwargs is None or isinstance(kwargs, dict):  # (another type: the chat path names it)
            chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled", **(kwargs or {})}
        if thinking["type"] == "enabled" and thinking.get("budget_tokens") is not None:
            chat["thinking_token_budget"] = thinking["budget_tokens"]  # enforced (the chat path checks it)
    return chat


def chat_messages(v) -> list[dict]:
    """`messages` -> chat messages (module doc); errors name messages[i].content[j]."""
    if not isinstance(v, list) or not v:
        raise bad("messages", "expected a non-empty list of messages")
    out: list[dict] = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "expected an object with role and content")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(where + ".role", f"{role!r:.40} is not one of user, assistant")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(where + ".content", f"expected a string or a list of blocks, got {type(content).__name__}")
        texts, calls, results, reasoning = [], [], [], None
        for j, b in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
                reasoning = (reasoning or "") + b["thinking"]
            elif kind == "redacted_thinking" and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise bad(at + ".input", "expected an object")
                fn = {"name": _str(b, "name", at), "arguments": json.dumps(args, ensure_ascii=False)}
                calls.append({"id": _str(b, "id", at), "type": "function", "function": fn})
            elif kind == "tool_result" and role == "user":
                c = b.get("content", "")
                text = _text(c, at + ".content", TEXT) if c else ""
                results.append({"role": "tool", "tool_call_id": _str(b, "tool_use_id", at), "content": text})
            else:
                why = "a text block" if kind == "text" else f"{kind!r:.40} blocks are not served in a {role} message"
                raise bad(at, why if kind else "expected a content block object with a type")
        out.extend(results)
        if texts or calls or reasoning is not None or not results:
            msg = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            out.append(msg)
    return out


def _tool_choice(v, chat: dict) -> None:
    kind = v.get("type") if isinstance(v, dict) else None
    if kind in TOOL_CHOICE:
        chat["tool_choice"] = TOOL_CHOICE[kind]
    elif kind == "tool" and isinstance(v.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": v["name"]}}
    else:
        raise bad("tool_choice", 'expected {"type": "auto" | "any" | "none"} or {"type": "tool", "name": NAME}')
    if v.get("disable_parallel_tool_use") is not None:
        if not isinstance(v["disable_parallel_tool_use"], bool):
            raise bad("tool_choice.disable_parallel_tool_use", "expected a boolean")
        chat["parallel_tool_calls"] = not v["disable_parallel_tool_use"]
