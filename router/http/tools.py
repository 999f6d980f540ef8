"""Tool calls in a chat completion's text: found as the model writes them, returned as OpenAI `tool_calls`.

    choice = tool_choice(body, template_source) # chat body's tools / tool_choice / parallel_tool_calls:
                                                # ToolChoice (ApiError(400) naming the field)
    text = choice.prompt(rendered)              # the template's prompt, then a forced call's opening (if any)
    msg["tool_calls"] = message_tool_calls(...) # an assistant message's calls, arguments as objects (templates)
    p = choice.parser(stream)                   # ToolCalls, one per choice (None when the text is not parsed):
                                                # whole calls, or streamed ones (router/http/tool_calls.py)

The models' chat templates tell them to wrap a call in <tool_call> ... </tool_call>; inside, two formats:
    JSON (Qwen3, Hermes)     {"name": "get_weather", "arguments": {"city": "Paris"}}
    XML (Qwen3.5, Qwen3-Coder) <function=get_weather>
                               <parameter=city>
                               Paris
                               </parameter>
                               </function>
An XML parameter's text becomes the JSON type its tool's schema names (integer, number, boolean, object,
array: parsed as JSON, else kept as text; string: kept as text); a parameter the schema does not know is
parsed as JSON when it is JSON. A block that parses as neither format is returned as content, as the model
wrote it. Text that may still become "<tool_call>" is held back until it cannot (like stop strings).
Each call gets an id "call_<24 hex>" and its arguments as a JSON string, as OpenAI sends them: the
model's own text of a JSON call's arguments object, an XML call's parameters built into one (the
canonical form: router/http/tool_parse.py). Streamed, a call is sent in pieces as its text is read (its
name, then its arguments' text); a streamed call its block then does not give is cut (tool_calls.py).

tool_choice "required" or {"type": "function", "function": {"name": NAME}} forces a call by writing its
opening after the rendered prompt: the model's text continues it, held to the tools' schemas by a grammar
(router/http/tool_grammar.py; not with fast mtp or ignore_eos, where it continues freely). call_opening()
is the one place that picks it: "<tool_call>\n" for "required"; for NAME, the format the template teaches
("<function=" in its source: the XML "<tool_call>\n<function=NAME>\n", else the JSON
"<tool_call>\n{"name": "NAME", "arguments": "); ToolChoice.prompt closes an open <think> block before it
(a forced call skips reasoning). The parser is fed that opening first, so the call parses as
if the model had written it, and the opening is never content: a forced block that does not parse is
returned as the model's own text (the opening left out), and one the model did not close before its text
ended is parsed as if closed (else returned likewise). A named choice accepts only calls to NAME: a block
calling another function is returned as content, as a block that parses as neither format is. "required"
accepts any name, as "auto" does. parallel_tool_calls false: only the first call is returned; later
blocks that parse as calls are dropped (neither calls nor content); text around them is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from baton.think_tags import THINK_END, think_open
from router.http.errors import bad
from router.http.tool_calls import ToolCalls
from router.http.tool_parse import END, START, parse_call

__all__ = ["END", "START", "ToolCalls", "ToolChoice", "call_opening", "check_tools", "parse_call", "tool_choice"]


def check_tools(v) -> dict[str, dict]:
    """OpenAI's `tools` -> {function name: its parameters schema ({} when absent)}."""
    if not isinstance(v, list):
        raise bad("tools", "expected a list of {\"type\": \"function\", \"function\": {...}}")
    out: dict[str, dict] = {}
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad(where, "expected {\"type\": \"function\", \"function\": {\"name\", \"parameters\", ...}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
            raise bad(where + ".function.name", "expected 1 to 64 letters, digits, _ . : -")
        if name in out:
            raise bad(where + ".function.name", f"{name!r} is defined twice")
        params = f.get("parameters", {})
        if not isinstance(params, dict):
            raise bad(where + ".function.parameters", "expected a JSON Schema object")
        out[name] = params
    return out


def message_tool_calls(v, where: str) -> list[dict]:
    """An assistant message's OpenAI tool_calls -> the templates' shape: arguments as an object (templates
    iterate them with |items), given as a JSON string (OpenAI) or an object."""
    if not isinstance(v, list):
        raise bad(where, "expected a list of tool calls")
    out = []
    for i, c in enumerate(v):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad(f"{where}[{i}]", "expected {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"{where}[{i}].function.arguments", "not a JSON object") from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{i}].function.arguments", "expected a JSON object")
        out.append({**c, "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


@dataclass(frozen=True)
class ToolChoice:
    """What a chat body's tool fields ask of the prompt and of the parser.

    shown: the tools the template renders (None: it shows none); tools: {function name: parameters schema}
    the text is parsed against (None: the text is all content); forced: appended to the rendered prompt,
    the opening of a call ("" unless tool_choice forces one; it always starts with START); only: the one
    function a call may name (a named tool_choice), else None; parallel: more than one call may be returned.
    """

    shown: list | None = None
    tools: dict[str, dict] | None = None
    forced: str = ""
    only: str | None = None
    parallel: bool = True

    def prompt(self, rendered: str) -> str:
        """The prompt text to send: the template's rendering, then the forced opening (if any). A forced call
        skips the model's reasoning: a <think> block the rendering leaves open (Qwen3.5 with thinking on
        ends in "<think>\n": router/http/reasoning.py think_open) is closed empty first, as enable_thinking
        false renders it."""
        if not self.forced:
            return rendered
        if think_open(rendered):
            rendered += "\n" + THINK_END + "\n\n"
        return rendered + self.forced

    def parser(self, stream: bool = False) -> ToolCalls | None:
        """A fresh parser for one choice's text, the forced opening already fed; None without tools. stream:
        it hands out OpenAI's incremental delta.tool_calls entries (router/http/tool_calls.py)."""
        if self.tools is None:
            return None
        return ToolCalls(self.tools, forced=self.forced, only=self.only, parallel=self.parallel, stream=stream)


def call_opening(name: str | None, template_source: str) -> str:
    """The text that opens a forced call, appended to the rendered prompt: any call (name None) or one to
    `name`, in the format the chat template teaches (module doc). `name` is a checked tool name
    (check_tools: letters, digits, _ . : -), so it needs no escaping in either format."""
    if name is None:
        return START + "\n"
    if "<function=" in template_source:
        return f"{START}\n<function={name}>\n"
    # (no space after "arguments": BPE vocabularies hold ' {' as one token, so the model writes it itself)
    return START + '\n{"name": ' + json.dumps(name) + ', "arguments":'


def tool_choice(body: dict, template_source: str = "") -> ToolChoice:
    """A chat body's tools + tool_choice + parallel_tool_calls -> ToolChoice. "none" (or no tools): nothing
    shown, nothing parsed. "auto" (the default with tools): shown and parsed. "required" or a named
    function: also forced (call_opening, with `template_source`, the chat template's text); they need
    tools, and a named function must be one of them (400 naming tool_choice)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"expected true or false, got {type(parallel).__name__}")
    name = None
    if isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad(
                "tool_choice", f"{choice!r:.60}: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
            )
    elif choice is not None and choice not in ("auto", "none", "required"):
        raise bad("tool_choice", f"{choice!r:.60}: expected \"auto\", \"none\", \"required\" or a named function")
    schemas = check_tools(tools) if tools is not None else {}
    if choice == "none" or (not schemas and choice in (None, "auto")):
        return ToolChoice()
    if not schemas:
        raise bad("tool_choice", f"{choice!r:.60} forces a call and needs a non-empty tools list")
    if name is not None and name not in schemas:
        raise bad("tool_choice", f"the function {name!r:.70} is not one of the tools' functions")
    forced = call_opening(name, template_source) if choice not in (None, "auto") else ""
    return ToolChoice(tools, schemas, forced, name, parallel)


def flat_tools(v, kind: str, schema: str, why: str) -> list[dict]:
    """Tools written flat, {"type": kind, "name", "description", <schema>} (the Responses API's function tools,
    schema "parameters"; the Messages API's client tools, "input_schema", their type optional) -> chat's
    {"type": "function", "function": {name, description, parameters}}, keys in that order (the template writes
    them as JSON); check_tools checks the rest. A tool of another type: 400 naming tools[i].type, saying why."""
    if not isinstance(v, list):
        raise bad("tools", "expected a list")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type", kind) != kind:
            got = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad(f"tools[{i}].type", f"{got!r:.40}: {why}")
        fn = {"name": t.get("name")}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if t.get(schema) is not None:
            fn["parameters"] = t[schema]
        out.append({"type": "function", "function": fn})
    return out
