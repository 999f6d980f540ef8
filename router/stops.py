"""Stop strings, matched by the router on the detokenized text, for both doors (gRPC and HTTP).

    m = StopMatcher(("\\n\\n", "```"))
    out, hit = m.push(delta)    # text safe to send now; hit = a stop string was completed
    out = m.flush()             # at the end of the stream (no stop string): what was held back
    t = TextStream(tokenizer.stream(), stops, min_tokens=0)
    text, kept = t.feed(tokens) # kept = how many of tokens to send (all, or up to the one completing a stop)
    text, hit = t.finish()      # the rest of the text at the end of the stream

Only text that cannot begin a stop string is released: a suffix of what was received that is a prefix
of some stop string is held back until the next delta decides it. The text sent is the generated text
cut just before the stop string that completed first (the earliest end in the text; on a tie the one
starting first), whatever the chunking; the stop string itself is not sent, as in OpenAI's API (with
include=True, vLLM's include_stop_str_in_output, the text ends with it instead). The
router then ends the request with finish_reason STOP: token_ids and usage end with the token that
completed the stop string (its text, and any after it, are not sent), and the downstream calls are
cancelled and the sessions released.

min_tokens N (vLLM's): no stop string is matched before the (N + 1)th token. The text of the first N tokens
is only watched for the start of a stop string (a suffix held back as above), so a stop string that begins
there and is completed by a later token ends the output, and one that lies wholly inside it never does
(vLLM's window: the new text and the len(stop) - 1 characters before it).
"""

from __future__ import annotations


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker: text that may still become the
    marker, held back until the next delta decides it (stop strings here; the tool-call and reasoning tags of
    router/http/tool_calls.py and router/http/reasoning.py)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class StopMatcher:
    """include: the text sent on a hit ends with the stop string (vLLM's include_stop_str_in_output), not
    just before it."""

    def __init__(self, stops: tuple[str, ...], include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self._held = ""
        self._frozen = 0  # chars of _held pushed unarmed: a stop string must end after them
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def push(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        """armed=False (a token before min_tokens): no stop string is matched, only a possible start held."""
        if not self.stops:
            return delta, False
        text = self._held + delta
        if armed:  # each stop string looked for where it would end in the armed text
            found = ((s, text.find(s, max(0, self._frozen - len(s) + 1))) for s in self.stops)
            hits = [(i + len(s), i, s) for s, i in found if i >= 0]
            if hits:  # the stop string completed first (the earliest end; on a tie, the longest)
                self._held, self._frozen = "", 0
                end, start, self.matched = min(hits)
                return text[: end if self.include else start], True
        keep = max(held_prefix(text, s) for s in self.stops)  # what may still become a stop string
        self._held = text[len(text) - keep :] if keep else ""
        # the unarmed chars still held: all of it after an unarmed push, else those the armed delta left in it
        self._frozen = max(0, self._frozen - (len(text) - keep)) if armed else keep
        return text[: len(text) - keep], False

    def flush(self) -> str:
        out, self._held, self._frozen = self._held, "", 0
        return out


class TextStream:
    """One request's output text: a tokenizer stream decoder (None: token ids only, no text) and its
    stop strings, fed token by token so that a stop string ends the output at the token completing it."""

    def __init__(self, decoder, stops: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0):
        self.decoder, self.matcher = decoder, StopMatcher(stops, include_stop)
        self.stopped = False
        self.min_tokens, self.fed = min_tokens, 0  # stop strings are matched from token min_tokens + 1 on

    def feed(self, tokens) -> tuple[str, int]:
        """-> (text to send, how many of `tokens` to send)."""
        if self.decoder is None:
            return "", len(tokens)
        parts = []
        for i, t in enumerate(tokens):
            self.fed += 1
            out, hit = self.matcher.push(self.decoder.push(t), armed=self.fed > self.min_tokens)
            parts.append(out)
            if hit:
                self.stopped = True
                return "".join(parts), i + 1
        return "".join(parts), len(tokens)

    def finish(self) -> tuple[str, bool]:
        """At the end of the stream: the decoder's and the matcher's held text; hit = a stop string in it."""
        if self.decoder is None:
            return "", False
        out, hit = self.matcher.push(self.decoder.flush(), armed=self.fed > self.min_tokens)
        if hit:
            self.stopped = True
            return out, True
        return out + self.matcher.flush(), False
