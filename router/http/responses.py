"""OpenAI's Responses API (`POST /v1/responses`): a request as the chat request it means.

    job, req = parse_responses(body, lim, store)   # ApiError(400 / 404) naming the Responses field

A Responses request is a chat completion with other names, so it runs the chat path whole (the template,
tools and forced calls, structured outputs, the reasoning parser, sampling, exact mode, admission): this
module only translates the body (`to_chat`) and renames the chat path's errors back to the Responses
fields; router/http/response_events.py turns the chat stream into the Responses output and events.

Translation (docs/HTTP.md, "The Responses API"):
    input (a string: one user message)   -> messages; items: messages (role + content: a string, or
                                            input_text / output_text parts), function_call (-> an assistant
                                            message's tool_calls, merged into the assistant message before it),
                                            function_call_output (-> a tool message), reasoning (-> the next
                                            assistant message's reasoning_content)
    instructions                         -> a first system message, with the system / developer messages
                                            that open the input (one system message: leading_system)
    max_output_tokens                    -> max_completion_tokens
    tools [{type: function, name, ...}]  -> tools [{type: function, function: {name, description, parameters}}]
    tool_choice {type: function, name}   -> {type: function, function: {name}}
    text.format                          -> response_format (text, json_object, json_schema)
    reasoning.effort                     -> reasoning_effort (none / minimal: the template's thinking off)
    include [message.output_text.logprobs], top_logprobs -> logprobs: true, top_logprobs (other include values
                                            add nothing: nothing they name is made)
    previous_response_id                 -> the stored conversation through that response (its input and
                                            output items, router/http/response_store.py), before `input`
    temperature, top_p, parallel_tool_calls, stream, model, and Baton's / vLLM's extras (PASSED) as they are.
store (default true, as OpenAI's): the finished response is kept in the router's memory (ResponseEvents), for
GET / DELETE /v1/responses/{id} and a later previous_response_id; false, or the router's store off
(--responses-store-mb 0): not kept (echoed false).
Refused (400 naming the field): conversation (Baton keeps no conversation objects), background, prompt,
truncation other than "disabled", hosted tools, non-text content, item_reference; a previous_response_id not
stored (never, deleted, evicted, or stored by another router). Read and echoed only: metadata, user,
reasoning.summary, service_tier, safety_identifier, prompt_cache_key, max_tool_calls (null only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from router.http.errors import ApiError, bad
from router.http.fields import _str, _text
from router.http.response_store import ResponseStore, StoreMiss
from router.http.schemas import Job, Limits, parse_chat
from router.http.tools import flat_tools

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# Baton's and vLLM's own fields, passed to the chat path as they are (its own checks name them)
PASSED = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "logit_bias",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "thinking_token_budget",
    "truncate_prompt_tokens",
    "chat_template_kwargs",
    "cache_salt",
    "priority",
    "baton",
)
REFUSED = {
    "conversation": "Baton keeps no conversation objects: continue with previous_response_id, or send the whole "
    "conversation in input",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported",
}
LOGPROBS = "message.output_text.logprobs"
# the chat path's field names -> the Responses request's (its errors' leading field, and the router's statuses)
RENAMES = [
    (r"^response_format\.json_schema\.", "text.format."),
    (r"^response_format\b", "text.format"),
    (r"^max_completion_tokens\b", "max_output_tokens"),
    (r"^max_tokens\b", "max_output_tokens"),
    (r"^reasoning_effort\b", "reasoning.effort"),
    (r"^messages\b", "input"),
    (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"^tool_choice\.function\.", "tool_choice."),
]


def renamed(field: str, renames) -> str:
    """A chat field's name in another API's request (renames: [(regex, replacement)], applied in order)."""
    for pattern, new in renames:
        field = re.sub(pattern, new, field)
    return field


def rename_error(e: ApiError, renames) -> ApiError:
    """The chat path's 400 naming its field -> the same error naming the other API's field."""
    if e.param:
        new = renamed(e.param, renames)
        if e.message.startswith(e.param):
            e.message = new + e.message[len(e.param) :]
        e.param = new
    return e


@dataclass
class ResponsesRequest:
    """What the response object echoes of its request (OpenAI's Response fields)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list = field(default_factory=list)
    tool_choice: object = "auto"
    parallel_tool_calls: bool = True
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    metadata: dict = field(default_factory=dict)
    user: str | None = None
    reasoning: dict = field(default_factory=lambda: {"effort": None, "summary": None})
    top_logprobs: int | None = None  # logprobs asked (include message.output_text.logprobs): their count
    previous_response_id: str | None = None
    items: list = field(default_factory=list)  # this request's input as items (a string: one user message)
    store: ResponseStore | None = None  # where the finished response is kept (store true and the router's on)

    def echo(self) -> dict:
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": {"format": self.text_format},
            "metadata": self.metadata,
            "user": self.user,
            "reasoning": self.reasoning,
            "previous_response_id": self.previous_response_id,
            "store": self.store is not None,
            "truncation": "disabled",
            "background": False,
            "service_tier": "default",
            "top_logprobs": self.top_logprobs or 0,
            "error": None,
        }


def parse_responses(body, lim: Limits, store: ResponseStore | None = None) -> tuple[Job, ResponsesRequest]:
    """The body -> the chat path's Job (streamed, with the usage chunk: response_events.py reads its chunks
    whether the client streams or not) and what the response echoes. ApiError naming the Responses field.
    store: the router's stored responses (None: off)."""
    chat, req = to_chat(body, store)
    try:
        job = parse_chat(chat, lim)
    except ApiError as e:
        raise rename_error(e, RENAMES) from None
    job.rename = {k: renamed(v, RENAMES) for k, v in job.rename.items()}
    job.rename.setdefault("max_new_tokens", "max_output_tokens")
    return job, req


def to_chat(body, store: ResponseStore | None = None) -> tuple[dict, ResponsesRequest]:
    """A Responses body -> the chat completion body it means, and the fields the response echoes."""
    if not isinstance(body, dict):
        raise bad("body", f"expected a JSON object, got {type(body).__name__}")
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False):
            raise bad(name, why)
    if body.get("truncation", "disabled") not in ("disabled", None):
        raise bad("truncation", 'only "disabled" (a prompt over the window is refused; see truncate_prompt_tokens)')
    if body.get("max_tool_calls") is not None:
        raise bad("max_tool_calls", "not supported (parallel_tool_calls: false keeps one call)")
    chat = {k: body[k] for k in PASSED if k in body}
    req = ResponsesRequest(
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
    )
    if body.get("stream") not in (None, True, False):
        raise bad("stream", "expected a boolean")
    chat["stream"] = True  # the events are made from the chat stream, streamed to the client or not
    chat["stream_options"] = {"include_usage": True}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", f"expected a string, got {type(instructions).__name__}")
    req.instructions = instructions
    earlier = _previous(body, store, req)
    own = input_messages(body.get("input"))
    req.items = (
        [{"type": "message", "role": "user", "content": body["input"]}]
        if isinstance(body["input"], str)
        else body["input"]
    )
    if body.get("store", True) is not False:
        req.store = store
    chat["messages"] = leading_system([{"role": "system", "content": instructions or ""}] + earlier + own)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = req.max_output_tokens = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"], req.tools = (
            flat_tools(body["tools"], "function", "parameters", "only function tools (Baton runs no hosted tools)"),
            body["tools"],
        )
    if body.get("tool_choice") is not None:
        chat["tool_choice"], req.tool_choice = _tool_choice(body["tool_choice"]), body["tool_choice"]
    _text_format(body.get("text"), chat, req)
    _include(body, chat, req)
    _echoed(body, chat, req)
    return chat, req


def _previous(body: dict, store: ResponseStore | None, req: ResponsesRequest) -> list[dict]:
    """previous_response_id -> the stored conversation's chat messages (its instructions are not items: the
    request's own replace them, as OpenAI's); [] without one. 400 naming it when it cannot be continued."""
    prev = body.get("previous_response_id")
    if prev is None:
        return []
    if not isinstance(prev, str) or not prev:
        raise bad("previous_response_id", "expected a response id")
    if store is None:
        raise bad(
            "previous_response_id",
            "this router stores no responses (--responses-store-mb 0): send the whole conversation in input",
        )
    try:
        items = store.items(prev)
    except StoreMiss as e:
        why = "not found" if e.missing == prev else f"an earlier response of its conversation ({e.missing[:80]}) is not"
        raise bad(
            "previous_response_id",
            f"{prev[:80]!r}: {why} stored here (never stored, deleted, evicted, or stored by another router); "
            "send the whole conversation in input",
        ) from None
    req.previous_response_id = prev
    return input_messages(items)


def input_messages(v) -> list[dict]:
    """`input` -> chat messages (module doc); errors name input[i]."""
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise bad("input", "expected a string or a non-empty list of items")
    out: list[dict] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(where + ".role", f"{role!r:.40} is not one of {', '.join(ROLES)}")
            msg = {"role": role, "content": _text(item.get("content"), where + ".content", TEXT_PARTS)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {
                "id": _str(item, "call_id", where),
                "type": "function",
                "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)},
            }
            if out and out[-1]["role"] == "assistant":  # the message (or calls) it came with
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where + ".output", TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            parts = [p for k in ("content", "summary") if isinstance(item.get(k), list) for p in item[k]]
            reasoning = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise bad(where + ".type", f"{kind!r:.40}: only message, function_call, function_call_output and reasoning")
    return out


def leading_system(messages: list[dict]) -> list[dict]:
    """The instructions and the system / developer messages before the conversation's first other message, as
    one system message first (paragraphs in order; none when all are empty): templates such as Qwen3.5's take
    one system message, at the start, and know no developer role (a coding agent sends its environment as
    developer messages after the instructions)."""
    n = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")), len(messages))
    text = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return ([{"role": "system", "content": text}] if text else []) + messages[n:]


def _tool_choice(v):
    if isinstance(v, dict):
        if v.get("type") != "function" or not isinstance(v.get("name"), str):
            raise bad("tool_choice", 'expected "auto", "none", "required" or {"type": "function", "name": NAME}')
        return {"type": "function", "function": {"name": v["name"]}}
    return v  # a string: the chat path checks it


def _text_format(v, chat: dict, req: ResponsesRequest) -> None:
    """text.format -> response_format."""
    if v is None:
        return
    if not isinstance(v, dict):
        raise bad("text", "expected an object")
    fmt = v.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise bad("text.format", "expected an object")
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif kind in ("text", "json_object"):
        chat["response_format"] = {"type": kind}
    else:
        raise bad("text.format.type", f"{kind!r:.40} is not one of text, json_object, json_schema")
    req.text_format = fmt


def _include(body: dict, chat: dict, req: ResponsesRequest) -> None:
    """include [message.output_text.logprobs] (or top_logprobs N > 0 alone) -> the chat's logprobs. The other
    include values name what hosted tools, images or encrypted reasoning would add: none of them is made here,
    so they add nothing (a coding agent asks for reasoning.encrypted_content with store false)."""
    include = body.get("include") or []
    if not isinstance(include, list) or any(not isinstance(x, str) for x in include):
        raise bad("include", "expected a list of strings")
    top = body.get("top_logprobs")
    if LOGPROBS in include or (top and top is not True):
        chat["logprobs"], chat["top_logprobs"] = True, top if top is not None else 0
        req.top_logprobs = chat["top_logprobs"]


def _echoed(body: dict, chat: dict, req: ResponsesRequest) -> None:
    """The fields the response echoes: metadata (at most 16 string pairs, as OpenAI's), user, reasoning (its
    effort also chat's reasoning_effort)."""
    meta = body.get("metadata")
    if meta is not None:
        ok = isinstance(meta, dict) and len(meta) <= 16
        if not ok or any(not isinstance(k, str) or not isinstance(x, str) for k, x in meta.items()):
            raise bad("metadata", "expected an object of at most 16 string keys and values")
        req.metadata = meta
    if isinstance(body.get("user"), str):
        req.user = body["user"]
    r = body.get("reasoning")
    if r is not None:
        if not isinstance(r, dict):
            raise bad("reasoning", "expected an object")
        req.reasoning = {"effort": r.get("effort"), "summary": r.get("summary")}
        if r.get("effort") is not None:  # none / minimal: the template's thinking off (reasoning.effort_kwargs)
            chat["reasoning_effort"] = r["effort"]
    if body.get("store") not in (None, True, False):
        raise bad("store", "expected a boolean")
