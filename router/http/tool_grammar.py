"""A forced tool call held to its tool's schema: the structure the rest of the call must follow after the opening
the prompt ends with (router/http/tools.py: call_opening), as an xgrammar structural tag the workers compile
(StructuredOutput.structural_tag; baton/grammar.py). vLLM constrains tool_choice "required" and named calls
in the same way.

    spec = call_structure(choice, template_source)   # StructuredOutput, or None when nothing is forced
    constrain(gen, choice, template_source)          # a chat's Generate fields (router/http/schemas.py) get it

The call's format is the one call_opening writes (the chat template's: "<function=" in its source is XML):
    XML (Qwen3.5)   [<function=NAME>\\n] <parameter=P>\\nvalue\\n</parameter>\\n ... </function>\\n</tool_call>
                    the parameters held to the tool's schema by xgrammar's "qwen_xml" style (required ones
                    present, each value of its type; newlines around values optional)
    JSON (Qwen3)    [{"name": "NAME", "arguments":] {...}}\\n</tool_call>, the arguments held to the schema
The bracketed part is the opening when the call is named (already in the prompt); "required" (any tool) opens
with "<tool_call>\\n" and the structure picks one tool's call. After the call only EOS, unless
parallel_tool_calls (not named): then more calls, each "\\n<tool_call>\\n" and one tool's call, before EOS.
"""

from __future__ import annotations

import json

from baton.v1 import common_pb2
from router.http.errors import bad
from router.http.tools import END, START, ToolChoice

# whitespace runs in the arguments: a call's JSON is one line, or indented a few levels (a model that would pad
# forever is stopped, as baton/grammar.py MAX_WHITESPACE does for JSON outputs)
WHITESPACE = {"max_whitespace_cnt": 16}


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _schema(params: dict) -> dict:
    return params if params else {"type": "object"}  # no parameters schema: any object


def _call(name: str, params: dict, xml: bool, named: bool) -> dict:
    """One call to `name` after "<tool_call>\\n" (named: after the whole opening, call_opening's)."""
    if xml:
        args = {"type": "json_schema", "json_schema": _schema(params), "style": "qwen_xml", **WHITESPACE}
        head = [] if named else [_const(f"<function={name}>\n")]
        return {"type": "sequence", "elements": [*head, args, _const(f"</function>\n{END}")]}
    args = {"type": "json_schema", "json_schema": _schema(params), **WHITESPACE}
    # named: the opening ends in '"arguments":' with no space (call_opening: the model writes ' {' itself)
    head = (
        [{"type": "regex", "pattern": " ?"}] if named else [_const('{"name": ' + json.dumps(name) + ', "arguments": ')]
    )
    return {"type": "sequence", "elements": [*head, args, _const("}\n" + END)]}


def call_structure(choice: ToolChoice, template_source: str) -> common_pb2.StructuredOutput | None:
    """The StructuredOutput of a forced call's rest (module doc); None when the choice forces none."""
    if not choice.forced or not choice.tools:
        return None
    xml = "<function=" in template_source
    if choice.only is not None:
        fmt = _call(choice.only, choice.tools[choice.only], xml, named=True)
    else:
        calls = [_call(n, p, xml, named=False) for n, p in choice.tools.items()]
        one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        fmt = one
        if choice.parallel:
            more = {"type": "sequence", "elements": [_const(f"\n{START}\n"), one]}
            fmt = {"type": "sequence", "elements": [one, {"type": "star", "content": more}]}
    return common_pb2.StructuredOutput(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


def constrain(gen: dict, choice: ToolChoice, template_source: str) -> None:
    """A chat's Generate fields (`gen`: sampling, engine, mode, ignore_eos) get the forced call's structure,
    where a grammar may apply: not beside another structured output (a 400: the call is the output), not with
    ignore_eos (the router refuses grammars there: the call is then only opened, as before)."""
    if not choice.forced:
        return
    if gen["sampling"].HasField("structured"):
        raise bad("tool_choice", "a forced call is the output's structure: not with response_format / guided_*")
    if gen["ignore_eos"]:
        return
    spec = call_structure(choice, template_source)
    if spec is not None:
        gen["sampling"].structured.CopyFrom(spec)
