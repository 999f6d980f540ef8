"""baton/grammar.py: structured outputs' grammars (xgrammar) as per-token masks, and the router's cheap check."""

import json
import re

import pytest
import torch

from baton import grammar
from baton.client import structured_output
from baton.loading import resolve_model_dir
from baton.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(resolve_model_dir(None))


@pytest.fixture(scope="module")
def grammars(tok):
    from baton.config import ModelConfig

    cfg = ModelConfig.from_hf(resolve_model_dir(None))
    return grammar.Grammars.of_model(resolve_model_dir(None), cfg.vocab_size, cfg.eos_token_ids)


def spec(**kw) -> bytes:
    return structured_output(kw).SerializeToString(deterministic=True)


def allowed(c, V) -> set[int]:
    bits = torch.empty(grammar.words(V), dtype=torch.int32)
    c.fill(bits)
    return {t for t in range(V) if (int(bits[t // 32]) >> (t % 32)) & 1}


def walk(grammars, tok, s: bytes, text: str) -> list[int]:
    """The tokens of text, each checked to be allowed where it comes; -> the allowed set's sizes."""
    c = grammars.constraint(s)
    sizes = []
    for t in tok.encode(text):
        ok = allowed(c, grammars.vocab_size)
        assert t in ok, (text, t)
        sizes.append(len(ok))
        c.accept([t])
    return sizes


def test_a_choice_allows_exactly_its_strings_and_then_only_eos(grammars, tok):
    s = spec(choice=['say "hi"', "back\\slash", "ünï"])
    for text in ('say "hi"', "back\\slash", "ünï"):
        walk(grammars, tok, s, text)
        c = grammars.constraint(s)
        c.accept(tok.encode(text))
        assert allowed(c, grammars.vocab_size) <= set(tok.eos_token_ids)  # complete: EOS only
    c = grammars.constraint(s)
    with pytest.raises(ValueError, match="does not continue the grammar"):
        c.accept(tok.encode("nope"))


def test_json_schema_json_object_and_regex_masks(grammars, tok):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    walk(grammars, tok, spec(json_schema=schema), '{"n": 12}')
    c = grammars.constraint(spec(json_schema=schema, compact_whitespace=True))
    assert tok.encode("{")[0] in allowed(c, grammars.vocab_size)
    c.accept(tok.encode("{"))
    assert tok.encode(" ")[0] not in allowed(c, grammars.vocab_size)  # compact: no whitespace
    first = allowed(grammars.constraint(spec(json_object=True)), grammars.vocab_size)
    assert tok.encode("{")[0] in first and tok.encode("[")[0] not in first  # an object, not any JSON value
    walk(grammars, tok, spec(regex="[0-9]{3}-x"), "123-x")
    assert tok.encode("a")[0] not in allowed(grammars.constraint(spec(regex="[0-9]{3}-x")), grammars.vocab_size)
    walk(grammars, tok, spec(grammar='root ::= "a" root | "b"'), "aab")


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(json_schema={"type": 5}), "json_schema"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="root ::= nothing_defined"), "grammar"),
    ],
)
def test_what_xgrammar_refuses_is_a_value_error_naming_the_kind(grammars, kw, field):
    with pytest.raises(ValueError, match=re.escape(f"sampling.structured.{field}: ")):
        grammars.constraint(spec(**kw))


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        (dict(json_schema="not json"), "json_schema: not JSON"),
        (dict(json_schema="[1]"), "json_schema: a JSON Schema is a JSON object"),
        (dict(json_object=False), "json_object"),
        (dict(regex=""), "regex: empty"),
        (dict(choice=[]), "choice"),
        (dict(choice=["a", ""]), "choice"),
        (dict(regex="x" * (grammar.MAX_SPEC_BYTES + 1)), "bytes, at most"),
    ],
)
def test_the_routers_check_names_the_field(kw, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        grammar.check(structured_output(kw))


def test_check_of_an_unset_spec_and_a_model_without_tokenizer(tmp_path):
    from baton.v1 import common_pb2

    with pytest.raises(ValueError, match="set one of"):
        grammar.check(common_pb2.StructuredOutput())
    with pytest.raises(ValueError, match="no tokenizer.json"):
        grammar.Grammars.of_model(tmp_path, 100, (1,))
    with pytest.raises(ValueError, match="no tokenizer"):
        grammar.none()
    assert json.loads(structured_output({"json_schema": {"type": "object"}}).json_schema) == {"type": "object"}
    with pytest.raises(ValueError, match="one of"):
        structured_output({"regex": "a", "choice": ["b"]})


def test_json_whitespace_runs_are_bounded(grammars, tok):
    """Any whitespace, but at most MAX_WHITESPACE characters in a run: a model that would pad forever moves on."""
    c = grammars.constraint(spec(json_schema={"type": "object"}))
    c.accept(tok.encode("{"))
    nl = tok.encode("\n")[0]
    for _ in range(grammar.MAX_WHITESPACE):
        assert nl in allowed(c, grammars.vocab_size)
        c.accept([nl])
    assert nl not in allowed(c, grammars.vocab_size) and tok.encode("}")[0] in allowed(c, grammars.vocab_size)


def test_after_token_leaves_the_reasoning_free_and_applies_the_grammar_after_it(grammars, tok):
    """StructuredOutput.after_token (a reasoning model's </think>): every token is allowed until it (all bits:
    the unconstrained pick), the grammar applies from the token after it; a rollback across it (a verify
    block's rows) frees the matcher again, and the compiled grammar is shared with the spec without it."""
    V, END = grammars.vocab_size, 7
    s = structured_output({"choice": ["yes", "no"], "after_token": END}).SerializeToString(deterministic=True)
    c = grammars.constraint(s)
    everything = allowed(c, V)
    assert len(everything) == V and not c.finished
    free = [t for t in tok.encode("any text at all, even nope") if t != END]
    c.accept(free)
    assert allowed(c, V) == everything
    c.accept([END])  # the grammar begins
    plain = grammars.constraint(spec(choice=["yes", "no"]))
    assert allowed(c, V) == allowed(plain, V) and len(allowed(c, V)) < V
    with pytest.raises(ValueError, match="does not continue the grammar"):
        grammars.constraint(s).accept(free + [END] + tok.encode("nope"))
    c.accept(tok.encode("yes"))
    assert allowed(c, V) <= set(tok.eos_token_ids) and not c.finished
    c.accept(tok.eos_token_ids[:1])
    assert c.finished
    c.rollback(len(tok.encode("yes")) + 2)  # back before END (and EOS): free again
    assert allowed(c, V) == everything and not c.finished
    assert c.try_accept(tok.encode("nope")[0])  # free text again
    c.rollback(1)
    c.accept([END, *tok.encode("no"), tok.eos_token_ids[0]])
    assert c.finished
    hits = grammars._compiled.cache_info().hits
    grammars.constraint(s), grammars.constraint(spec(choice=["yes", "no"]))
    assert grammars._compiled.cache_info().hits == hits + 2  # one compiled grammar, with after_token or not


def test_a_thinking_budget_forces_the_after_token_and_a_rollback_frees_it(grammars, tok):
    """StructuredOutput.after_budget: after that many free tokens the mask holds the after_token alone (one bit,
    also for bit 31 of its word) and any other token is refused; the after_token earlier is the switch as
    before; a rollback below the budget frees the other tokens again; the grammar is the spec's without it."""
    V = grammars.vocab_size
    for END in (7, 31, 63):
        c = grammars.constraint(spec(choice=["yes", "no"], after_token=END, after_budget=3))
        free = [t for t in tok.encode("some free reasoning text here") if t != END][:3]
        assert len(free) == 3 and c.budget_left == 3
        c.accept(free[:2])
        assert len(allowed(c, V)) == V and not c.spent and c.budget_left == 1
        c.accept(free[2:])
        assert allowed(c, V) == {END} and c.spent and c.budget_left == 0
        assert not c.try_accept(free[0])
        with pytest.raises(ValueError, match="does not continue"):
            c.accept([free[0]])
        c.rollback(1)
        assert len(allowed(c, V)) == V and c.try_accept(free[2])
        c.accept([END])  # the grammar begins
        assert not c.free and allowed(c, V) == allowed(grammars.constraint(spec(choice=["yes", "no"])), V)
        c.rollback(1)
        assert allowed(c, V) == {END}
    early = grammars.constraint(spec(choice=["yes", "no"], after_token=7, after_budget=3))
    early.accept([free[0], 7, *tok.encode("no")])  # the after_token before the budget's end: the grammar's
    assert not early.free and allowed(early, V) <= set(tok.eos_token_ids)
    zero = grammars.constraint(spec(choice=["yes", "no"], after_token=7, after_budget=0))
    assert allowed(zero, V) == {7}


def test_a_thinking_budget_alone_compiles_nothing_and_frees_the_rest():
    """any_text (with after_token and after_budget): no grammar, so a worker without one (grammar.none) builds
    it; the budget is kept as above, and after the after_token every token is allowed and it never finishes."""
    V, END = 1000, 5
    c = grammar.constraint(grammar.none, spec(any_text=True, after_token=END, after_budget=2), V)
    assert c.grammarless and len(allowed(c, V)) == V
    c.accept([1, 2])
    assert allowed(c, V) == {END} and not c.try_accept(3)
    c.accept([END, 3, 4, 999, END])
    assert len(allowed(c, V)) == V and not c.finished and not c.free
    c.rollback(5)
    assert allowed(c, V) == {END}
    with pytest.raises(grammar.Unavailable):  # a grammar still needs the worker's grammars
        grammar.constraint(grammar.none, spec(regex="a+", after_token=END, after_budget=2), V)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        (dict(regex="a+", after_budget=4), "sampling.structured.after_budget: "),
        (dict(any_text=True, after_token=5), "sampling.structured.any_text: "),
        (dict(any_text=True), "sampling.structured.any_text: "),
    ],
)
def test_a_budget_needs_its_after_token_and_any_text_needs_a_budget(kw, why):
    with pytest.raises(ValueError) as ei:
        grammar.check(structured_output(kw))
    assert str(ei.value).startswith(why), str(ei.value)
    grammar.check(structured_output(dict(any_text=True, after_token=5, after_budget=0)))


def test_after_token_beyond_the_vocabulary_is_refused_by_the_router():
    from baton import sampling_rules
    from baton.v1 import common_pb2

    p = common_pb2.SamplingParams()
    p.structured.regex = "[a-z]+"
    p.structured.after_token = 1000
    with pytest.raises(ValueError, match="structured.after_token"):
        sampling_rules.check(p, vocab=1000)
    p.structured.after_token = 999
    sampling_rules.check(p, vocab=1000)


def test_a_commit_past_the_grammars_end_feeds_nothing_after_the_eos(grammars, tok):
    """Masker.commit of a verify's kept tokens that run past a drafted EOS (the rows after it are free): the
    grammar takes the tokens up to the EOS, none after (the request ends there), and the position counts them
    all; a token the grammar refuses before its end is still a ValueError."""
    from baton.engine.sampling import SamplingTable

    table = SamplingTable(2, "cpu", 4, max_len=64, vocab_size=grammars.vocab_size)
    m = grammar.Masker(grammars.constraint(spec(choice=["red", "blue"])), table, 0)
    m.start([], 10)
    red, eos = tok.encode("red"), tok.eos_token_ids[0]
    m.commit([*red, eos, 5, 6])
    assert m.c.finished and m.next == 10 + len(red) + 3
    m = grammar.Masker(grammars.constraint(spec(choice=["red", "blue"])), table, 1)
    m.start([], 0)
    with pytest.raises(ValueError, match="does not continue the grammar"):
        m.commit(tok.encode("green"))
