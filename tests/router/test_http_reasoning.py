"""The reasoning parser (router/http/reasoning.py, the router's --reasoning-parser qwen3). The splitter on its
own: where reasoning starts (a prompt that leaves <think> open, or a text that opens it), where it ends, the
newlines around the tags, a text that ends while reasoning, no tags at all, and any split of the text into
deltas (every split point, every character, random multi-splits) giving the whole text's fields exactly, a
partial tag never leaking into either. Then through the real HTTP API (the `openai` client and httpx), with
the loopback fake workers of tests/router/test_http_tools.py writing a scripted answer under the Qwen3.5 chat
template: chat with the parser on (reasoning_content and content, streamed pieces joining into the
non-streamed fields), off (content as today), a tool call after reasoning, a length cut inside reasoning."""

from __future__ import annotations

import random

import pytest

from router.http.reasoning import ReasoningSplit, think_open

OPEN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # Qwen3.5, thinking on
CLOSED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking off

# (starts in reasoning, text, reasoning, content)
CASES = [
    (True, "Two and two.\n</think>\n\nThe answer is 4.", "Two and two.\n", "The answer is 4."),
    (True, "r</think>c</think>d<think>e", "r", "c</think>d<think>e"),  # after the first </think>: all content
    (True, "a <think> inside\n</think>\n\n\n  x\n", "a <think> inside\n", "  x\n"),  # newlines only stripped
    (True, "still thinking when max_tokens hit </thi", "still thinking when max_tokens hit </thi", None),
    (True, "", "", None),
    (True, "</think>\n\n", "", None),
    (False, "<think>\nI should greet.\n</think>\n\nHello!", "I should greet.\n", "Hello!"),
    (False, " \n <think>\n\nx</think>y", "\nx", "y"),  # one newline after the model's <think> dropped
    (False, "<think>no newline</think>\n\nok", "no newline", "ok"),
    (False, "<think>\nunclosed", "unclosed", None),
    (False, "<think>", "", None),
    (False, "Hello! No tags here.", None, "Hello! No tags here."),
    (False, "  <thinking> is not the tag", None, "  <thinking> is not the tag"),
    (False, "<thin", None, "<thin"),  # a partial tag at the end: text
    (False, "  \n", None, "  \n"),
    (False, "", None, ""),
    (False, "The answer.</think>\n\nmore", None, "The answer.</think>\n\nmore"),  # no reasoning: tags are text
]


def _pieces(splitter: ReasoningSplit, text: str, cuts: list[int]) -> tuple[list[str], list[str]]:
    rs, cs, last = [], [], 0
    for c in [*cuts, len(text)]:
        r, k = splitter.feed(text[last:c])
        rs, cs, last = rs + [r], cs + [k], c
    r, k = splitter.finish()
    return rs + [r], cs + [k]


@pytest.mark.parametrize("start, text, reasoning, content", CASES)
def test_the_whole_text_split(start, text, reasoning, content):
    assert ReasoningSplit(start).split(text) == (reasoning, content)


@pytest.mark.parametrize("start, text, reasoning, content", CASES)
def test_any_split_into_deltas_gives_the_whole_texts_fields(start, text, reasoning, content):
    rng = random.Random(len(text))
    splits = [[], list(range(1, len(text)))] + [[k] for k in range(len(text) + 1)]
    splits += [sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6)))) for _ in range(40)]
    for cuts in splits:
        rs, cs = _pieces(ReasoningSplit(start), text, cuts)
        assert ("".join(rs), "".join(cs)) == (reasoning or "", content or ""), cuts


def test_a_partial_tag_is_held_back_until_the_next_delta_decides():
    s = ReasoningSplit(True)
    assert s.feed("Let me see.\n</th") == ("Let me see.\n", "")  # "</th" may be the tag: in neither field yet
    assert s.feed("ink>\n") == ("", "")  # the tag, then a newline that may lead the content: dropped
    assert s.feed("\nIt is 4.") == ("", "It is 4.")
    assert s.finish() == ("", "")
    s = ReasoningSplit(True)
    assert s.feed("a </") == ("a ", "") and s.feed("b>") == ("</b>", "")  # not the tag after all: reasoning
    s = ReasoningSplit(False)
    assert s.feed("\n<thi") == ("", "") and s.feed("nk>") == ("", "") and s.feed("\nhm") == ("hm", "")
    assert s.feed("</think>") == ("", "") and s.feed("\n\nok") == ("", "ok")
    s = ReasoningSplit(False)
    assert s.feed("<thi") == ("", "") and s.feed("s is content") == ("", "<this is content")
    assert s.feed(" <think>") == ("", " <think>")  # once content, always content


def test_where_the_prompt_leaves_reasoning():
    assert think_open(OPEN) and not think_open(CLOSED)
    assert not think_open("<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n")
    history = CLOSED.replace("<think>\n\n</think>\n\n", "<think>\nhm\n</think>\n\nHello<|im_end|>\n")
    assert not think_open(history + "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    assert think_open(history + "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert think_open("no chat markup <think>") and not think_open("plain prompt")
    # thinking off: the prompt's closed empty block is not reasoning; the text is all content
    assert ReasoningSplit(think_open(CLOSED)).split("Hello!") == (None, "Hello!")
    assert ReasoningSplit(think_open(OPEN)).split("Hmm.\n</think>\n\nHello!") == ("Hmm.\n", "Hello!")
