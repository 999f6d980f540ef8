"""Tool calls in a chat completion's text: found as the model writes them, returned as OpenAI `tool_calls`.

    shown, tools = tool_choice(body)            # chat body's tools / tool_choice; ApiError(400) naming the field
    msg["tool_calls"] = message_tool_calls(...) # an assistant message's calls, arguments as objects (templates)
    p = ToolCalls(tools)                        # one per choice
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
"""

from __future__ import annotations

import json
import re
import uuid

from router.http.errors import bad

START, END = "<tool_call>", "</tool_call>"
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


def tool_choice(body: dict) -> tuple[list | None, dict | None]:
    """A chat body's tools + tool_choice -> (the tools the template shows, {name: schema} when the text is
    parsed for calls); both None without tools or with "none". "auto" (the default with tools) and "none"
    only: "required" or a named function need constrained decoding, which Baton does not have."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise bad(
            "tool_choice", f"{choice!r:.60}: only \"auto\" and \"none\" (forcing a call needs constrained decoding)"
        )
    if tools is None or tools == [] or choice == "none":
        if tools is not None:
            check_tools(tools)
        return None, None
    return tools, check_tools(tools)


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
    """One choice's text, split into content and tool calls as it streams (module doc)."""

    def __init__(self, tools: dict[str, dict]):
        self.tools, self._buf, self._inside, self.calls = tools, "", False, 0

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
                call = parse_call(body, self.tools)
                if call is None:
                    content += START + body + END  # not a call after all: the model's text as it wrote it
                else:
                    calls.append(call)
                    self.calls += 1

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the text: whatever was held back, an unfinished <tool_call> block as plain text."""
        rest = (START if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return rest, []
