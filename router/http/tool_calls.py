"""One chat choice's text, split into content and tool calls as it streams (router/http/tools.py's module doc).

    p = ToolCalls(tools, forced=..., only=..., parallel=..., stream=False)  # ToolChoice.parser()
    content, calls = p.feed(text_delta)         # whole calls: text safe to send as content now, calls completed
    content, calls = p.finish()                 # at the end: what was held back (an unfinished call as text)
    content, calls = p.split(text)              # a whole text (the non-streaming response)

    p = ToolCalls(..., stream=True)             # a streamed choice: OpenAI's incremental delta.tool_calls
    items = p.deltas(text_delta)                # [content str | a delta.tool_calls entry (with "index")]
    items = p.deltas_end()                      # at the end
    p.calls, p.cut                              # calls begun; streamed calls their block then did not give

Lifecycle of one <tool_call> block: text that may still become START is held back; from START on the block's
inside is held until END (or the end of the text). Whole mode judges it there with parse_call: a call,
else the block as written is content (a forced opening left out). Stream mode also reads it as it grows
with a Scanner (router/http/tool_parse.py), on the inside minus a suffix that may still become END: once
the scanner is ready (and the call's name is allowed: a named tool_choice's, and the first call when
parallel_tool_calls is false), the call is *streamed*: an entry {"index", "id", "type", "function":
{"name", "arguments": ""}}, then an entry {"index", "function": {"arguments": piece}} per piece. At END the
block is judged as in whole mode; for a streamed call, when parse_call gives the same name and arguments
that extend the pieces sent, the rest of the arguments is one last piece (XML's "}"); otherwise the call
is *cut*: nothing more is sent for it, the rest of its block is dropped, and `cut` counts it. A block not
streamed by its end is sent whole at its end, as an entry with the name then one with all the arguments.

Invariants: content never holds a forced opening's text (`_ours` counts its characters at the head of
the open block until that block ends); the pieces of a call not cut concatenate to the `arguments` that
whole mode gives for the same text; `calls` counts every call returned or begun, so a call's index is
its order among them.
"""

from __future__ import annotations

from router.http.tool_parse import END, START, Scanner, new_id, parse_call
from router.stops import held_prefix


class ToolCalls:
    """One choice's text -> content and calls (module doc)."""

    def __init__(
        self,
        tools: dict[str, dict],
        *,
        forced: str = "",
        only: str | None = None,
        parallel: bool = True,
        stream: bool = False,
    ):
        self.tools, self._buf, self._inside, self.calls, self.cut = tools, "", False, 0, 0
        self.only, self.parallel, self.stream, self._ours = only, parallel, stream, 0
        self._out: list = []  # what the current feed returns: content strs, calls (stream mode: entries)
        self._scan: Scanner | None = None  # stream mode: the open block's
        self._open: dict | None = None  # stream mode: the call streamed from the open block {index, name, sent}
        if forced:
            if not forced.startswith(START):
                raise ValueError(f"a forced opening starts with {START}: {forced!r}")
            self._ours = len(forced)
            self._push(forced)  # all of it held: START opens the block, the rest waits for END

    # ---- the two modes' entry points --------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[dict]]:
        assert not self.stream, "a streaming parser is read with deltas()"
        return self._whole(self._push, text)

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the text: whatever was held back. An unfinished <tool_call> block is plain text, unless
        it is a forced call's (Baton opened it): then it is parsed as if closed, and is text if it fails."""
        assert not self.stream, "a streaming parser is read with deltas_end()"
        return self._whole(self._end_of_text)

    def split(self, text: str) -> tuple[str, list[dict]]:
        """A whole text at once (feed, then finish): (content, calls)."""
        content, calls = self.feed(text)
        rest, last = self.finish()
        return content + rest, calls + last

    def deltas(self, text: str) -> list:
        """Stream mode: content strs and delta.tool_calls entries, in the text's order."""
        assert self.stream, "a whole-call parser is read with feed()"
        self._out = []
        self._push(text)
        return self._out

    def deltas_end(self) -> list:
        assert self.stream, "a whole-call parser is read with finish()"
        self._out = []
        self._end_of_text()
        return self._out

    def _whole(self, fn, *args) -> tuple[str, list[dict]]:
        self._out = []
        fn(*args)
        return "".join(x for x in self._out if isinstance(x, str)), [x for x in self._out if isinstance(x, dict)]

    # ---- blocks -----------------------------------------------------------------------------------------
    def _push(self, text: str) -> None:
        self._buf += text
        while True:
            if not self._inside:
                i = self._buf.find(START)
                if i < 0:
                    keep = held_prefix(self._buf, START)
                    self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._content(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(START) :], True
                if self.stream:
                    self._scan, self._open = Scanner(self.tools, max(0, self._ours - len(START))), None
            else:
                j = self._buf.find(END)
                if j < 0:
                    if self._scan is not None:
                        self._step(self._buf[: len(self._buf) - held_prefix(self._buf, END)])
                    return
                body, self._buf, self._inside = self._buf[:j], self._buf[j + len(END) :], False
                self._block(body, closed=True)

    def _content(self, text: str) -> None:
        if text:
            self._out.append(text)

    def _allowed(self, name: str) -> bool:
        return (self.only is None or name == self.only) and (self.parallel or not self.calls)

    def _step(self, body: str) -> None:
        """Stream mode: the open block's inside so far (none of it END) -> its call's entries, once ready."""
        sc = self._scan
        piece = sc.step(body)
        if self._open is None:
            if not sc.ready or sc.off:
                return
            if not self._allowed(sc.name):
                sc.off = True  # judged whole at its end: text, or dropped
                return
            self._open = {"index": self.calls, "name": sc.name, "sent": ""}
            self.calls += 1
            fn = {"name": sc.name, "arguments": ""}
            self._out.append({"index": self._open["index"], "id": new_id(), "type": "function", "function": fn})
        self._piece(piece)

    def _piece(self, piece: str) -> None:
        if piece:
            self._open["sent"] += piece
            self._out.append({"index": self._open["index"], "function": {"arguments": piece}})

    def _block(self, body: str, closed: bool) -> None:
        """One <tool_call> block's inside (closed: END followed it) -> its content or its call."""
        call = parse_call(body, self.tools)
        if call is not None and self.only is not None and call["function"]["name"] != self.only:
            call = None  # a named tool_choice: a call to another function is text
        ours, self._ours = self._ours, 0
        streamed, self._open, self._scan = self._open, None, None
        if streamed is not None:  # its head was sent: the block completes the call, or cuts it
            fn = call["function"] if call is not None else {}
            if fn.get("name") == streamed["name"] and fn["arguments"].startswith(streamed["sent"]):
                self._open = streamed
                self._piece(fn["arguments"][len(streamed["sent"]) :])
                self._open = None
            else:
                self.cut += 1
            return
        if call is None:  # not a call after all: the model's text as it wrote it
            self._content((START + body + (END if closed else ""))[ours:])
            return
        if not self._allowed(call["function"]["name"]):
            return  # parallel_tool_calls false: only the first call
        self.calls += 1
        if not self.stream:
            self._out.append(call)
            return
        args, call["function"]["arguments"] = call["function"]["arguments"], ""
        self._out.append({"index": self.calls - 1, **call})
        self._open = {"index": self.calls - 1, "name": call["function"]["name"], "sent": ""}
        self._piece(args)
        self._open = None

    def _end_of_text(self) -> None:
        if self._inside and self._ours:  # a forced call the model left open: parsed as if closed
            body, self._buf, self._inside = self._buf, "", False
            self._block(body, closed=False)
        elif self._inside and self._open is not None:  # a streamed call its text did not close: cut
            self._buf, self._inside, self._open, self._scan = "", False, None, None
            self.cut += 1
        else:
            rest = (START if self._inside else "") + self._buf
            self._buf, self._inside, self._scan = "", False, None
            self._content(rest)
