"""One <tool_call> block's inside -> an OpenAI tool call: whole (parse_call) or as its text grows (Scanner).

    call = parse_call(body, tools)      # {"id", "type", "function": {"name", "arguments"}} | None
    s = Scanner(tools, ours)            # one block, streamed (router/http/tool_calls.py)
    piece = s.step(body)                # body: the block's inside so far (never past END) -> new argument
                                        # text; s.name / s.ready once the call may be sent; s.off: never

The `arguments` string, one canonical form whether streamed or not (docs/HTTP.md, "Tool calls"):
    JSON  the model's own text of its "arguments" value, from its "{" to its matching "}", as written (the
          last "arguments" key, else the last "parameters" key, as json.loads keeps the last duplicate);
          a value given as a JSON string: that string's text; no value: "{}".
    XML   built per parameter: "{" '"p1": v1' ', "p2": v2' ... "}" ("{}" for none), each value the JSON
          of its schema conversion (json.dumps, ensure_ascii False; a repeated parameter kept each time).

Scanner's invariant: what it hands out is a prefix of the `arguments` parse_call gives for the block, if
the block ends well-formed with the head it read. JSON: the value's text, never past its matching "}"
(strings and escapes tracked); XML: one member per </parameter>, the same parameters _PARAMETER.findall
finds, none after a </function>. It is ready (the call may be sent) at the JSON value's "{"; at an XML
<function=NAME> the model wrote, or (Baton wrote the opening: a forced named call) at the first
parameter the model completes. ToolCalls checks the prefix at the block's end (a cut call otherwise).
"""

from __future__ import annotations

import json
import re
import uuid

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_PARAM_HEAD = re.compile(r"<parameter=([^>\n]+)>")
_PARAM_END, _FUNCTION_END = "</parameter>", "</function>"
_JSON_TYPES = ("integer", "number", "boolean", "object", "array", "null")
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_J = "[ \t\n\r]*"
_JSON_HEAD = re.compile(
    r"\s*\{" + _J + r'"name"' + _J + ":" + _J + r'("(?:[^"\\]|\\.)*")' + _J + "," + _J + r'"arguments"' + _J + ":" + _J,
)
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
HEAD_MAX = 512  # a head not read within this many characters is not streamed (the block is judged whole)


def new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def typed(value: str, schema: dict | None):
    """An XML parameter's text -> the JSON type its schema names (module doc of router/http/tools.py)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    if kind in _JSON_TYPES or kind is None:
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _props(tools: dict[str, dict], name: str) -> dict:
    schema = tools.get(name)
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    return props if isinstance(props, dict) else {}


def member(key: str, raw: str, props: dict, first: bool) -> str:
    """One XML parameter's piece of the arguments text ("{" before the first, ", " before the others)."""
    key = key.strip()
    value = json.dumps(typed(raw, props.get(key)), ensure_ascii=False)
    return ("{" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value


def _members(text: str) -> list[tuple[str, str]]:
    """A JSON object's top-level (key, the value's text), in order; `text` is one valid JSON object."""
    dec, out = json.JSONDecoder(), []
    i = _WS.match(text, 1).end()
    while text[i] != "}":
        key, i = dec.raw_decode(text, i)
        i = _WS.match(text, _WS.match(text, i).end() + 1).end()  # past ":"
        _, j = dec.raw_decode(text, i)
        out.append((key, text[i:j]))
        i = _WS.match(text, j).end()
        if text[i] == ",":
            i = _WS.match(text, i + 1).end()
    return out


def _json_call(text: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already a JSON string: its text, when it is an object
        try:
            return (obj["name"], args) if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    raw = dict(_members(text))  # the last duplicate of a key, as json.loads
    return obj["name"], raw.get("arguments", raw.get("parameters", "{}"))


def parse_call(body: str, tools: dict[str, dict]) -> dict | None:
    """The inside of one <tool_call> block -> OpenAI's tool call, or None when it is neither format."""
    text = body.strip()
    if text.startswith("{"):
        got = _json_call(text)
        if got is None:
            return None
        name, args = got
    elif m := _FUNCTION.fullmatch(text):
        name = m.group(1).strip()
        props = _props(tools, name)
        pieces = [member(k, v, props, i == 0) for i, (k, v) in enumerate(_PARAMETER.findall(m.group(2)))]
        args = "".join(pieces) + "}" if pieces else "{}"
    else:
        return None
    return {"id": new_id(), "type": "function", "function": {"name": name, "arguments": args}}


class Scanner:
    """One block's call as its text grows (module doc). `ours`: the body's leading characters Baton wrote
    (a forced opening). After `off` it hands out nothing: the block is judged whole at its end."""

    def __init__(self, tools: dict[str, dict], ours: int = 0):
        self.tools, self.ours = tools, ours
        self.name: str | None = None
        self.ready = self.off = False
        self._fmt: str | None = None
        self._pos: int | None = None  # after the head: JSON, the value's next character; XML, the next search
        self._depth, self._in_str, self._esc, self._done = 0, False, False, False  # JSON: done at its "}"
        self._props: dict = {}
        self._first = True

    def step(self, body: str) -> str:
        """The argument text new in `body` (a longer prefix of the same block than the last call's)."""
        if self.off:
            return ""
        if self._fmt is None:
            lead = body.lstrip()
            if not lead:
                return ""
            if lead[0] == "{":
                self._fmt = "json"
            elif lead.startswith("<function=") or "<function=".startswith(lead):
                self._fmt = "xml"
            else:
                self.off = True
                return ""
        return self._json(body) if self._fmt == "json" else self._xml(body)

    def _head(self, body: str, pattern: re.Pattern) -> re.Match | None:
        m = pattern.match(body)
        if m is None and len(body) > HEAD_MAX:
            self.off = True
        return m

    def _json(self, body: str) -> str:
        if self._pos is None:
            m = self._head(body, _JSON_HEAD)
            if m is None or m.end() >= len(body):
                return ""
            if body[m.end()] != "{":  # a string, or not an object: judged whole
                self.off = True
                return ""
            try:
                self.name = json.loads(m.group(1))
            except ValueError:
                self.off = True
                return ""
            self.ready, self._pos = True, m.end()
        start = i = self._pos
        while i < len(body) and not self._done:
            c = body[i]
            i += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                self._done = self._depth == 0
        self._pos = i
        return body[start:i]

    def _xml(self, body: str) -> str:
        if self._pos is None:
            m = self._head(body, _XML_HEAD)
            if m is None:
                name = body.lstrip()[len("<function=") :]
                if name.startswith(">") or "\n" in name.split(">")[0]:
                    self.off = True  # not a head: _FUNCTION cannot match
                return ""
            self.name, self._pos = m.group(1).strip(), m.end()
            self._props, self.ready = _props(self.tools, self.name), m.end() > self.ours
        out = ""
        while not self._done:
            p, f = body.find("<parameter=", self._pos), body.find(_FUNCTION_END, self._pos)
            if f >= 0 and (p < 0 or f < p):
                self._done = True  # </function>: no parameter after it is streamed
                break
            if p < 0:
                break
            h = _PARAM_HEAD.match(body, p)
            if h is None:
                rest = body[p + len("<parameter=") :]
                if "\n" not in rest and ">" not in rest:
                    break  # may still become a head
                self._pos = p + 1  # not a head here (as findall moves on)
                continue
            c = body.find(_PARAM_END, h.end())
            if c < 0:
                break
            raw = body[h.end() : c]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            out += member(h.group(1), raw, self._props, self._first)
            self._first, self._pos, self.ready = False, c + len(_PARAM_END), True
        return out
