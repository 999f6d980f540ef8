"""Tool calls in a chat completion's text: found as the model writes them, returned as OpenAI `tool_calls`.

    choice = tool_choice(body, template_source) # chat body's tools / tool_choice / parallel_tool_calls:
                                                # ToolChoice (ApiError(400) naming the field)
    text = choice.prompt(rendered)              # the template's prompt, then a forced call's opening (if any)
    msg["tool_calls"] = message_tool_calls(...) # an assistant message's calls, arguments as objects (templates)
    p = choice.parser()                         # ToolCalls, one per choice (None when the text is not parsed)
    content, calls = p.feed(text_delta)         # text safe to send as content now, tool calls completed
    content, calls = p.finish()                 # at the end: what was held back (an unfinished call as text)

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
Each call gets an id "call_<24 hex>" and its arguments as a JSON string, as OpenAI sends them.

tool_choice "required" or {"type": "function", "function": {"name": NAME}} forces a call by writing its
opening after the rendered prompt (no constrained decoding): the model's text continues it. call_opening()
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
import uuid
from dataclasses import dataclass

from router.http.errors import bad

START, END = "<tool_call>", "</tool_call>"
THINK, THINK_END = "<think>", "</think>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_JSON_TYPES = ("integer", "number", "boolean", "object", "array", "null")


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
        ends in "<think>\n") is closed empty first, as enable_thinking false renders it."""
        if not self.forced:
            return rendered
        if rendered.rfind(THINK) > rendered.rfind(THINK_END):
            rendered += "\n" + THINK_END + "\n\n"
        return rendered + self.forced

    def parser(self) -> "ToolCalls | None":
        """A fresh parser for one choice's text, the forced opening already fed; None without tools."""
        if self.tools is None:
            return None
        return ToolCalls(self.tools, forced=self.forced, only=self.only, parallel=self.parallel)


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


def _typed(value: str, schema: dict | None):
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    if kind in _JSON_TYPES or kind is None:
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def parse_call(body: str, tools: dict[str, dict]) -> dict | None:
    """The inside of one <tool_call> block -> OpenAI's tool call, or None when it is neither format."""
    text = body.strip()
    name = args = None
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):  # already a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
    elif m := _FUNCTION.fullmatch(text):
        name = m.group(1).strip()
        props = tools.get(name, {}).get("properties", {}) if isinstance(tools.get(name), dict) else {}
        args = {k.strip(): _typed(v, props.get(k.strip())) for k, v in _PARAMETER.findall(m.group(2))}
    if name is None or not isinstance(args, dict):
        return None
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (it may still become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCalls:
    """One choice's text, split into content and tool calls as it streams (module doc).

    Invariants: content never holds a forced opening's text (`forced`, fed at construction: _ours counts
    its characters at the head of the open block until that block ends); `calls` counts the calls returned.
    """

    def __init__(self, tools: dict[str, dict], *, forced: str = "", only: str | None = None, parallel: bool = True):
        self.tools, self._buf, self._inside, self.calls = tools, "", False, 0
        self.only, self.parallel, self._ours = only, parallel, 0
        if forced:
            if not forced.startswith(START):
                raise ValueError(f"a forced opening starts with {START}: {forced!r}")
            self.feed(forced)  # all of it held: START opens the block, the rest waits for END
            self._ours = len(forced)

    def _block(self, body: str, closed: bool) -> tuple[str, list[dict]]:
        """One <tool_call> block's inside (closed: END followed it) -> (its content, its calls)."""
        call = parse_call(body, self.tools)
        if call is not None and self.only is not None and call["function"]["name"] != self.only:
            call = None  # a named tool_choice: a call to another function is text
        ours, self._ours = self._ours, 0
        if call is None:  # not a call after all: the model's text as it wrote it
            return (START + body + (END if closed else ""))[ours:], []
        if self.calls and not self.parallel:
            return "", []  # parallel_tool_calls false: only the first call
        self.calls += 1
        return "", [call]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        content, calls = "", []
        while True:
            if not self._inside:
                i = self._buf.find(START)
                if i < 0:
                    keep = _held(self._buf, START)
                    content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return content, calls
                content, self._buf, self._inside = content + self._buf[:i], self._buf[i + len(START) :], True
            else:
                j = self._buf.find(END)
                if j < 0:
                    return content, calls
                body, self._buf, self._inside = self._buf[:j], self._buf[j + len(END) :], False
                got, new = self._block(body, closed=True)
                content, calls = content + got, calls + new

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the text: whatever was held back. An unfinished <tool_call> block is plain text, unless
        it is a forced call's (Baton opened it): then it is parsed as if closed, and is text if it fails."""
        if self._inside and self._ours:
            body, self._buf, self._inside = self._buf, "", False
            return self._block(body, closed=False)
        rest = (START if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return rest, []

    def split(self, text: str) -> tuple[str, list[dict]]:
        """A whole text at once (feed, then finish): (content, calls)."""
        content, calls = self.feed(text)
        rest, last = self.finish()
        return content + rest, calls + last
