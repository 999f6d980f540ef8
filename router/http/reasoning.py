"""A chat choice's reasoning, split from its answer (the router's --reasoning-parser qwen3; none: no split).

    start = think_open(prompt)                  # baton/think_tags.py: the prompt leaves a <think> block open
    r = ReasoningSplit(start)                   # one per chat choice
    reasoning, content = r.split(text)          # a whole text: (str | None, str | None)
    reasoning_delta, content_delta = r.feed(d)  # streamed: the text safe to send now ("" when none)
    reasoning_delta, content_delta = r.finish() # at the end of the text: what was held back
    r.count(token_text); r.tokens              # each generated token's text -> the reasoning's token count

Qwen3 / Qwen3.5 think first: with thinking on their generation prompt ends inside an open block
("<|im_start|>assistant\\n<think>\\n"), so the text is "reasoning...</think>\\n\\nanswer"; some models write
the "<think>" themselves. The rules:
- the text starts in reasoning when the prompt leaves <think> open (think_open); otherwise only when it
  starts, after leading whitespace, with "<think>" (that whitespace and the tag are in neither field);
  otherwise it is all content and reasoning is None.
- "</think>" ends the reasoning: the tag is in neither field, and the newlines that follow it are not content.
  The reasoning is the text between the tags as written, less one newline right after a "<think>" the model
  wrote (the prompt's "<think>\\n" holds its own). Later tags are text: "<think>" inside reasoning stays
  reasoning, and everything after the first "</think>" is content, tags included.
- a text that ends while reasoning (max_tokens, EOS, a stop string) is all reasoning: content None. Content
  is None too when nothing follows "</think>" but newlines; reasoning is "" when the block was empty.
Streamed, a suffix that may still become a tag ("<thi", "</th") is held back until the next delta decides
it, as are the leading whitespace before a possible "<think>" and the newlines after "</think>": any
split of a text into deltas gives the same joined reasoning and content as `split` of the whole text.
Tool calls are parsed from the content alone (router/http/run.py); stop strings, logprobs and usage
count the whole text, as before.
"""

from __future__ import annotations

from baton.think_tags import THINK, THINK_END
from router.http.errors import bad
from router.stops import held_prefix

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning effort values
PARSERS = ("none", "qwen3")  # the router's --reasoning-parser values


def effort_kwargs(effort, kwargs: dict, field: str) -> dict:
    """A reasoning effort (chat's reasoning_effort, the Responses API's reasoning.effort) -> the chat template's
    kwargs: "none" / "minimal" set enable_thinking false (Qwen3.5's switch: the prompt closes an empty block),
    the others leave thinking as the template has it (on); chat_template_kwargs' own enable_thinking wins.
    None: kwargs unchanged. 400 naming `field` for another value."""
    if effort is None:
        return kwargs
    if effort not in EFFORTS:
        raise bad(field, f"{effort!r:.40} is not one of {', '.join(EFFORTS)}")
    return {"enable_thinking": False, **kwargs} if effort in ("none", "minimal") else kwargs


class ReasoningSplit:
    """One chat choice's text -> (reasoning, content), whole or streamed (module doc)."""

    def __init__(self, reasoning: bool = False):
        # "detect": before any text decides whether it opens with <think>; "reasoning"; "content"
        self._mode = "reasoning" if reasoning else "detect"
        self.reasoned = reasoning  # a reasoning block was entered (reasoning is not None)
        self._buf = ""  # held back: leading whitespace / a partial tag
        self._skip_nl = False  # drop one "\n" right after a <think> the model wrote
        self._strip_nl = False  # drop the "\n"s right after </think>
        self._counted, self._tail, self.closed = 0, "", False  # count(): tokens so far, the last texts, "</think>" seen

    def count(self, token: str) -> None:
        """One generated token's text, in order, for `tokens`: counted until the one that completes "</think>"
        (`closed` from then on: the caller may stop decoding tokens for it)."""
        if not self.closed:
            self._counted += 1
            text = self._tail + token
            self.closed = THINK_END in text
            self._tail = text[1 - len(THINK_END) :]  # a tag split across tokens completes with the next

    @property
    def tokens(self) -> int:
        """The reasoning's tokens (usage's reasoning_tokens): those counted up to and including the one that
        completes "</think>" (all of them when none did); 0 when the text had no reasoning block."""
        return self._counted if self.reasoned else 0

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole text: (reasoning or None when there was none, content or None when there is none after
        reasoning)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        content = c1 + c2
        return (r1 + r2 if self.reasoned else None), (content if content or not self.reasoned else None)

    def feed(self, delta: str) -> tuple[str, str]:
        """The next piece of text -> (reasoning, content) safe to send now."""
        self._buf += delta
        reasoning, content = "", ""
        while self._buf:
            if self._mode == "detect":
                head = self._buf.lstrip()
                if head.startswith(THINK):
                    self._buf, self._mode, self._skip_nl, self.reasoned = head[len(THINK) :], "reasoning", True, True
                    continue
                if not head or THINK.startswith(head):
                    break  # whitespace, or what may still become <think>: wait
                self._mode = "content"
            if self._mode == "content":
                if self._strip_nl:
                    self._buf = self._buf.lstrip("\n")
                    self._strip_nl = not self._buf
                content, self._buf = content + self._buf, ""
                break
            if self._skip_nl:  # reasoning: its first character decides
                self._buf, self._skip_nl = self._buf.removeprefix("\n"), False
                continue
            i = self._buf.find(THINK_END)
            if i >= 0:
                reasoning += self._buf[:i]
                self._buf, self._mode, self._strip_nl = self._buf[i + len(THINK_END) :], "content", True
                continue
            keep = len(self._buf) - held_prefix(self._buf, THINK_END)
            reasoning, self._buf = reasoning + self._buf[:keep], self._buf[keep:]
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the text: a held partial tag is text of the field it is in (leading whitespace, or a
        partial <think>, is content)."""
        rest, self._buf = self._buf, ""
        if self._mode == "reasoning":
            return rest, ""
        return "", rest
