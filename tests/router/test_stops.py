"""router/stops.py: stop strings on the streamed text (StopMatcher) and per token (TextStream)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from router.stops import StopMatcher, TextStream


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    include=st.booleans(),
)
def test_stop_matcher_cuts_at_the_earliest_stop_whatever_the_chunking(text, stops, cuts, include):
    """The text ends just before the stop string that completes first, or (include: vLLM's
    include_stop_str_in_output) with it, however the text arrives."""
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    want = text[: min(hits)[0 if include else 1]] if hits else text  # the stop string that completes first
    m, out, hit = StopMatcher(tuple(stops), include), [], False
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    for a, b in zip(bounds, bounds[1:]):
        piece, hit = m.push(text[a:b])
        out.append(piece)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    assert ("".join(out), hit) == (want, bool(hits))


class Chars:
    """A stream decoder whose tokens are characters (token t -> chr(t)); flush() returns nothing."""

    def push(self, t):
        return chr(t)

    def flush(self):
        return ""


def test_text_stream_ends_at_the_token_completing_the_stop_string():
    toks = [ord(c) for c in "abcXYdef"]
    t = TextStream(Chars(), ("XY", "zz"))
    assert t.feed(toks[:4]) == ("abc", 4)  # "X" held back: it may begin "XY"
    assert t.feed(toks[4:]) == ("", 1) and t.stopped  # "Y" completes it: 1 token of these is sent
    t = TextStream(Chars(), ("XZ",))
    assert t.feed(toks[:4]) == ("abc", 4)
    assert t.feed(toks[4:]) == ("XYdef", 4) and not t.stopped
    assert t.finish() == ("", False)
    t = TextStream(Chars(), ("f!",))
    assert t.feed(toks) == ("abcXYde", 8)
    assert t.finish() == ("f", False)  # the held-back text at the end of the stream
    assert TextStream(None, ("x",)).feed([1, 2]) == ("", 2)  # no tokenizer: no text, nothing cut


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=24),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=3),
    min_tokens=st.integers(0, 12),
    cuts=st.lists(st.integers(0, 24), max_size=5),
    include=st.booleans(),
)
def test_min_tokens_matches_only_stop_strings_completed_after_it(text, stops, min_tokens, cuts, include):
    """vLLM's min_tokens: a stop string ends the output only when the token completing it comes after the
    first min_tokens (it may begin before them); one wholly inside them never ends it. One char a token."""
    ends = [(e, e - len(s)) for e in range(min_tokens + 1, len(text) + 1) for s in stops if text[:e].endswith(s)]
    if ends:
        end, start = min(ends)
        want = (text[: end if include else start], True, end)
    else:
        want = (text, False, len(text))
    t, out, sent = TextStream(Chars(), tuple(stops), include, min_tokens=min_tokens), [], 0
    toks = [ord(c) for c in text]
    bounds = sorted({0, len(toks), *[c for c in cuts if c <= len(toks)]})
    for a, b in zip(bounds, bounds[1:]):
        piece, kept = t.feed(toks[a:b])
        out.append(piece)
        sent += kept
        if t.stopped:
            break
    if not t.stopped:
        out.append(t.finish()[0])
    assert ("".join(out), t.stopped, sent) == want


def test_min_tokens_example():
    toks = [ord(c) for c in "XYabXY"]
    t = TextStream(Chars(), ("XY",), min_tokens=2)
    assert t.feed(toks) == ("XYab", 6) and t.stopped  # the first "XY" is inside min_tokens: not a stop
    t = TextStream(Chars(), ("XY",), min_tokens=1)
    assert t.feed(toks) == ("", 2) and t.stopped  # "X" in the first token, "Y" completes it after: a stop
    t = TextStream(Chars(), ("a", "a\na"), min_tokens=1)  # hypothesis found it: "a" held (it may begin "a\na")
    assert t.feed([ord("a"), ord("\n")]) == ("", 2) and t.finish() == ("a\n", False)  # still inside min_tokens


def test_the_matcher_names_the_stop_string_that_ended_the_text():
    """StopMatcher.matched (GenerateResponse.stop_string, vLLM's stop_reason): the string that completed first,
    whatever the chunking; None while none has, and when the text ends without one."""
    for cuts in ([], [1], [3, 4], list(range(1, 12))):
        m, text, pos = StopMatcher(("END", "xy", "never")), "ab xEND xy", 0
        for c in [*cuts, len(text)]:
            _, hit = m.push(text[pos:c])
            pos = c
            if hit:  # (the router ends the output there)
                break
        assert m.matched == "END", cuts
    m = StopMatcher(("zz",))
    m.push("abc z")
    assert m.matched is None and m.flush() == "z"
