"""router/http/tool_grammar.py: a forced tool call's structure (xgrammar structural tag) compiled by the workers'
grammar code (baton/grammar.py) on the default model's tokenizer: the rest of the call after the prompt's
opening must be a call of the tool's schema, in the template's format (Qwen3.5 XML, Qwen3 JSON), then EOS
(or, "required" with parallel_tool_calls, more calls); what breaks the schema is refused token by token."""

import pytest
import torch
from test_http_tools import JSON_TEMPLATE, TIME, WEATHER, XML_CALL, XML_TEMPLATE

from baton import grammar
from baton.loading import resolve_model_dir
from baton.tokenizer import Tokenizer
from router.http.tool_grammar import call_structure
from router.http.tools import tool_choice


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(resolve_model_dir(None))


@pytest.fixture(scope="module")
def grammars():
    from baton.config import ModelConfig

    cfg = ModelConfig.from_hf(resolve_model_dir(None))
    return grammar.Grammars.of_model(resolve_model_dir(None), cfg.vocab_size, cfg.eos_token_ids)


def _takes(grammars, tok, spec, text: str) -> bool:
    """Whether the constraint accepts text's tokens, then allows EOS (the call complete)."""
    c = grammars.constraint(spec.SerializeToString(deterministic=True))
    if not all(c.try_accept(t) for t in tok.encode(text)):
        return False
    bits = torch.empty(grammar.words(grammars.vocab_size), dtype=torch.int32)
    c.fill(bits)
    allowed = {t for t in range(grammars.vocab_size) if (int(bits[t // 32]) >> (t % 32)) & 1}
    return bool(allowed & set(tok.eos_token_ids))


# WEATHER with its city required
CITY = {
    **WEATHER,
    "function": {**WEATHER["function"], "parameters": {**WEATHER["function"]["parameters"], "required": ["city"]}},
}


def _spec(body, template):
    choice = tool_choice({"tools": [CITY, TIME], **body}, template)
    return choice, call_structure(choice, template)


def test_a_named_xml_call_is_held_to_the_tools_schema(grammars, tok):
    choice, spec = _spec({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, XML_TEMPLATE)
    assert choice.forced == "<tool_call>\n<function=get_weather>\n" and spec.HasField("structural_tag")
    rest = XML_CALL[len(choice.forced) :]  # the Qwen3.5 template's own call, after the opening
    assert _takes(grammars, tok, spec, rest)
    assert _takes(grammars, tok, spec, "<parameter=city>Rome</parameter></function>\n</tool_call>")  # newlines optional
    assert not _takes(grammars, tok, spec, "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")  # no city
    assert not _takes(grammars, tok, spec, rest.replace("\n3\n", "\nthree\n"))  # days: an integer
    assert not _takes(grammars, tok, spec, rest + "\n<tool_call>\n")  # named: one call, then EOS


def test_required_picks_any_tool_and_parallel_allows_more_calls(grammars, tok):
    call = XML_CALL[len("<tool_call>\n") :]
    other = "<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
    for parallel in (True, False):
        choice, spec = _spec({"tool_choice": "required", "parallel_tool_calls": parallel}, XML_TEMPLATE)
        assert choice.forced == "<tool_call>\n"
        assert _takes(grammars, tok, spec, call) and _takes(grammars, tok, spec, other)
        assert _takes(grammars, tok, spec, call + "\n<tool_call>\n" + other) == parallel
        assert not _takes(grammars, tok, spec, "<function=get_news>\n</function>\n</tool_call>")  # not a tool


def test_json_calls_hold_their_arguments_to_the_schema(grammars, tok):
    choice, spec = _spec({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, JSON_TEMPLATE)
    assert choice.forced.endswith('"arguments":')
    for text in (' {"city": "Rome", "days": 2}}\n</tool_call>', '{"city": "Rome"}}\n</tool_call>'):
        assert _takes(grammars, tok, spec, text), text
    assert not _takes(grammars, tok, spec, ' {"days": 2}}\n</tool_call>')  # city is required
    choice, spec = _spec({"tool_choice": "required", "parallel_tool_calls": False}, JSON_TEMPLATE)
    assert _takes(grammars, tok, spec, '{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    assert not _takes(grammars, tok, spec, '{"name": "get_news", "arguments": {}}\n</tool_call>')


def test_nothing_forced_is_no_structure():
    assert call_structure(tool_choice({"tools": [WEATHER]}, XML_TEMPLATE), XML_TEMPLATE) is None
    assert call_structure(tool_choice({}, XML_TEMPLATE), XML_TEMPLATE) is None


def test_constrain_sets_the_structure_only_where_a_grammar_may_apply():
    from baton.v1 import common_pb2
    from router.http.errors import ApiError
    from router.http.tool_grammar import constrain

    choice = tool_choice({"tools": [CITY], "tool_choice": "required"}, XML_TEMPLATE)

    def gen(**kw):
        base = dict(sampling=common_pb2.SamplingParams(), engine=0, mode=common_pb2.FAST, ignore_eos=False)
        return {**base, **kw}

    g = gen()
    constrain(g, choice, XML_TEMPLATE)
    assert g["sampling"].structured.structural_tag == call_structure(choice, XML_TEMPLATE).structural_tag
    g = gen(ignore_eos=True)  # no grammar there: only the opening
    constrain(g, choice, XML_TEMPLATE)
    assert not g["sampling"].HasField("structured")
    for g in (gen(engine=common_pb2.MTP), gen(engine=common_pb2.MTP, mode=common_pb2.EXACT)):  # held: plain
        constrain(g, choice, XML_TEMPLATE)  # rounds (fast mtp) and the verify's masks (exact mode)
        assert g["sampling"].HasField("structured")
    g = gen()
    g["sampling"].structured.json_object = True
    with pytest.raises(ApiError) as e:
        constrain(g, choice, XML_TEMPLATE)
    assert e.value.status == 400 and e.value.message.startswith("tool_choice:")
