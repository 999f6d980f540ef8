"""Structured outputs in the HTTP API: OpenAI's response_format and vLLM's guided_* / structured_outputs ->
the router's `SamplingParams.structured` (baton.v1.StructuredOutput; compiled by the workers, baton/grammar.py).

    spec, rename = parse(body)   # (None, {}) when the body asks for none; ApiError(400) naming the field
    text = skip_reasoning(prompt)  # a chat prompt's open <think> closed empty: the structure starts at once
    end = reasons_first(prompt, lim)  # or, with the reasoning parser on, </think>'s id: the structure after it
    think_budget(body, sampling, rename)  # thinking_token_budget -> SamplingParams.thinking_budget

Accepted, at most one of them in a body:
- `response_format`: {"type": "text"} (none), {"type": "json_object"}, {"type": "json_schema", "json_schema":
  {"name", "schema": {...}, "strict", "description"}} (OpenAI's), {"type": "structural_tag", "format": {...}}
  (xgrammar's structural tag; vLLM's {"type": "structural_tag", "structures": [...], "triggers": [...]} too);
- vLLM's `guided_json` (a schema: object or JSON text), `guided_regex`, `guided_choice` (strings),
  `guided_grammar` (EBNF), and `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"};
- `guided_whitespace_pattern` is refused (Baton's JSON is either any whitespace or none:
  `structured_outputs.disable_any_whitespace` / vLLM's `guided_decoding_backend` options are not taken).
The field named in an error is the one the body used: `rename` maps the router's and workers'
"sampling.structured[.kind]" to it (Job.rename; the longer name first).
"""

from __future__ import annotations

import json

from baton.think_tags import THINK_END, think_open
from baton.v1 import common_pb2
from router.http.errors import bad
from router.http.fields import _int


def reasons_first(prompt: str, lim) -> int | None:
    """With the reasoning parser on (--reasoning-parser qwen3), a chat prompt that leaves a <think> block open
    reasons first, as vLLM's structured outputs with a reasoning parser do: -> the id of "</think>" (one token
    of the model's vocabulary), set as StructuredOutput.after_token, so the reasoning is free and the
    structure is the content after it. None (the parser off, no open block, or no such token): the structure
    starts at once, the block closed empty (skip_reasoning)."""
    if lim.reasoning_parser == "none" or lim.tokenizer is None or not think_open(prompt):
        return None
    ids = lim.tokenizer.encode(THINK_END)
    return ids[0] if len(ids) == 1 else None


def think_budget(body: dict, sampling, rename: dict) -> None:
    """A chat body's thinking budget (vLLM's thinking_token_budget, Anthropic's thinking.budget_tokens: an
    integer >= 0, else a 400 naming it) -> SamplingParams.thinking_budget, which the router resolves
    (baton/sampling_rules.py think_budget): at most that many reasoning tokens, then "</think>" is the next
    token (its logprob 0) and the model answers. No effect where the prompt leaves no <think> block open
    (thinking off, a structure or forced call that skips the reasoning) or "</think>" is not one token (vLLM's
    behaviour)."""
    budget = _int(body, "thinking_token_budget", 0)
    if budget is not None:
        sampling.thinking_budget = budget
        rename["sampling.thinking_budget"] = "thinking_token_budget"


def skip_reasoning(prompt: str) -> str:
    """A structured output starts at the first generated token, so it skips the model's reasoning: a <think>
    block the chat prompt leaves open (Qwen3.5 with thinking on) is closed empty first, as enable_thinking false
    renders it (a forced tool call does the same, router/http/tools.py); the text is then content, not reasoning."""
    return prompt + "\n" + THINK_END + "\n\n" if think_open(prompt) else prompt


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def parse(body: dict) -> tuple[common_pb2.StructuredOutput | None, dict[str, str]]:
    given = [k for k in ("response_format", *GUIDED, "structured_outputs") if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None and isinstance(rf, dict) and rf.get("type") == "text" and len(rf) == 1:
        given.remove("response_format")  # OpenAI's default: no structure
    if body.get("guided_whitespace_pattern") is not None:
        raise bad("guided_whitespace_pattern", "not supported (structured_outputs.disable_any_whitespace is)")
    if not given:
        return None, {}
    if len(given) > 1:
        raise bad(given[1], f"only one structured output a request (also given: {given[0]})")
    field, v = given[0], body[given[0]]
    out = common_pb2.StructuredOutput()
    if field == "response_format":
        _response_format(v, out)
    elif field == "guided_json":
        out.json_schema = _schema(v, field)
    elif field == "guided_choice":
        out.choice.options.extend(_strings(v, field))
    elif field in ("guided_regex", "guided_grammar"):
        setattr(out, field.removeprefix("guided_"), _string(v, field))
    else:
        _structured_outputs(v, out)
    kind = out.WhichOneof("kind")
    where = {
        "response_format": "response_format.json_schema.schema" if kind == "json_schema" else field,
        "structured_outputs": f"structured_outputs.{ {'json_schema': 'json'}.get(kind, kind) }",
    }.get(field, field)
    return out, {f"sampling.structured.{kind}": where, "sampling.structured": field}


def _response_format(v, out) -> None:
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema", "structural_tag"):
        raise bad(
            "response_format", 'expected {"type": "text" | "json_object" | "json_schema" | "structural_tag", ...}'
        )
    if v["type"] == "text":
        raise bad("response_format", '{"type": "text"} takes no other field')
    if v["type"] == "json_object":
        out.json_object = True
        return
    if v["type"] == "structural_tag":  # xgrammar's (or vLLM's "structures" / "triggers"): the workers compile it
        out.structural_tag = json.dumps(v)
        return
    js = v.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
        raise bad("response_format.json_schema", 'expected {"name": ..., "schema": {...}}')
    if "schema" not in js:
        raise bad("response_format.json_schema.schema", "missing (the JSON Schema the output must follow)")
    out.json_schema = _schema(js["schema"], "response_format.json_schema.schema")


def _structured_outputs(v, out) -> None:
    if not isinstance(v, dict):
        raise bad("structured_outputs", "expected an object")
    unknown = sorted(set(v) - set(STRUCTURED_KEYS))
    if unknown:
        raise bad(f"structured_outputs.{unknown[0]:.40}", f"unknown field (known: {', '.join(STRUCTURED_KEYS)})")
    kinds = [k for k in STRUCTURED_KEYS[:5] if v.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad("structured_outputs", "set exactly one of json, regex, choice, grammar, json_object")
    (kind,) = kinds
    where = f"structured_outputs.{kind}"
    if kind == "json":
        out.json_schema = _schema(v[kind], where)
    elif kind == "choice":
        out.choice.options.extend(_strings(v[kind], where))
    elif kind == "json_object":
        if v[kind] is not True:
            raise bad(where, "expected true")
        out.json_object = True
    else:
        setattr(out, kind, _string(v[kind], where))
    disable = v.get("disable_any_whitespace", False)
    if not isinstance(disable, bool):
        raise bad("structured_outputs.disable_any_whitespace", "expected a boolean")
    out.compact_whitespace = disable


def _schema(v, where: str) -> str:
    if isinstance(v, str):
        return v  # JSON text: the router checks it is a JSON object
    if not isinstance(v, dict):
        raise bad(where, "expected a JSON Schema object")
    return json.dumps(v)


def _string(v, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise bad(where, "expected a non-empty string")
    return v


def _strings(v, where: str) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
        raise bad(where, "expected a non-empty list of non-empty strings")
    return v
