"""Anthropic's Messages output, made from the chat path's stream (router/http/run.py Run.chunks), as
router/http/response_events.py makes the Responses API's.

    ev = MessageEvents(run, None, model_id)      # run: Run(servicer, job, id_prefix="msg_"), started
    async for event in ev.stream(): ...          # streaming: each a dict with "type"
    body = await ev.collect()                    # non-streaming: the message object

The content blocks come in the order the text gives them: a thinking block (the reasoning parser's
reasoning_content; its signature is empty: Baton signs nothing), a text block, then a tool_use block per tool
call (its input: the call's arguments as an object). stop_reason: "max_tokens" (the limit or the window),
"tool_use" (the text held a call), "stop_sequence" (with stop_sequence: the string that ended it), else
"end_turn". usage as Anthropic counts it: input_tokens are the prompt tokens computed, cache_read_input_tokens
those the prefix cache restored (cache_creation_input_tokens 0), output_tokens the tokens generated.
Events: message_start (the message, content empty), per block content_block_start, content_block_delta
(text_delta, thinking_delta, input_json_delta: pieces that join into the input's JSON), content_block_stop;
then message_delta (stop_reason, stop_sequence, usage) and message_stop; an error after the first token is one
`error` event, last. The router's Stats ride in "baton": {"stats"} of the message (message_delta when
streaming).
"""

from __future__ import annotations

import json

from router.http.errors import ERROR_TYPE as OPENAI_TYPES

ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOPS = {"length": "max_tokens", "tool_calls": "tool_use"}
STATUS_OF = {t: s for s, t in reversed(OPENAI_TYPES.items())}  # an OpenAI error body's type -> its status


def error_body(status: int, message: str) -> dict:
    """An Anthropic error body."""
    return {"type": "error", "error": {"type": ERROR_TYPE.get(status, "api_error"), "message": message}}


class MessageEvents:
    def __init__(self, run, _request, model_id: str):  # (parse_messages' request part: None, nothing to echo)
        self.run, self.model_id = run, model_id
        self.blocks: list[dict] = []  # content blocks, in order
        self.open: dict | None = None  # the block being written (the last), or None
        self.calls: dict[int, dict] = {}  # a tool call's index in the chat stream -> its block
        self.finish: str | None = None
        self.stop_string: str | None = None
        self.usage: dict | None = None
        self.stats: dict = {}
        self.error: dict | None = None

    # ---- the message --------------------------------------------------------------------------------
    def _usage(self) -> dict:
        u = self.usage or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {
            "input_tokens": u.get("prompt_tokens", self.run.choices[0].prompt_tokens) - cached,
            "output_tokens": u.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _stop(self) -> tuple[str | None, str | None]:
        if self.finish is None:
            return None, None
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use", None
        if self.stop_string is not None and self.finish == "stop":
            return "stop_sequence", self.stop_string
        return STOPS.get(self.finish, "end_turn"), None

    def message(self, started: bool = False) -> dict:
        reason, sequence = self._stop()
        out = {
            "id": self.run.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": [] if started else [_final(b) for b in self.blocks] or [{"type": "text", "text": ""}],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self._usage() if not started else {**self._usage(), "output_tokens": 0},
        }
        if not started:
            out["baton"] = {"stats": self.stats}
        return out

    # ---- blocks -------------------------------------------------------------------------------------
    def _open(self, kind: str, **fields) -> list[dict]:
        ev = self._close()
        block = {"type": kind, **fields}
        if kind == "text":
            block["text"] = ""
        elif kind == "thinking":
            block.update(thinking="", signature="")
        self.blocks.append(block)
        self.open = block
        start = _final(block) if kind == "tool_use" else dict(block)  # (a tool_use starts with input {})
        ev.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start})
        return ev

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _text(self, kind: str, text: str) -> list[dict]:
        ev = [] if self.open is not None and self.open["type"] == kind else self._open(kind)
        key = "text" if kind == "text" else "thinking"
        self.open[key] += text
        return ev + [self._delta({"type": f"{key}_delta", key: text})]

    def _call(self, entry: dict) -> list[dict]:
        ev, fn = [], entry.get("function") or {}
        if "id" in entry:
            ev = self._open("tool_use", id=entry["id"], name=fn.get("name", ""), arguments="")
            self.calls[entry["index"]] = self.open
        piece, block = fn.get("arguments") or "", self.calls.get(entry["index"])
        if piece and block is not None:  # (its own block: the chat stream finishes a call before the next)
            block["arguments"] += piece
            delta = {"type": "input_json_delta", "partial_json": piece}
            ev.append({"type": "content_block_delta", "index": self.blocks.index(block), "delta": delta})
        return ev

    # ---- the chat stream -> events ------------------------------------------------------------------
    def feed(self, chunk: dict) -> list[dict]:
        """One chat chunk (or a Run.chunks error body) -> the Messages events it makes."""
        if "error" in chunk:
            e = chunk["error"]
            self.error = error_body(STATUS_OF.get(e.get("type"), 500), e.get("message", ""))
            return self._close()
        if not chunk.get("choices"):  # the usage chunk, last
            self.usage = chunk.get("usage")
            return []
        c = chunk["choices"][0]
        delta, ev = c.get("delta") or {}, []
        if delta.get("reasoning_content"):
            ev += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            ev += self._text("text", delta["content"])
        for entry in delta.get("tool_calls") or []:
            ev += self._call(entry)
        if c.get("finish_reason") is not None:
            self.finish = c["finish_reason"]
            self.stats = (chunk.get("baton") or {}).get("stats", {})
            reason = c.get("stop_reason")
            self.stop_string = reason if isinstance(reason, str) else None
            ev += self._close()
        return ev

    async def stream(self):
        """Every event of the message: message_start first, message_stop (or an error event) last."""
        try:
            yield {"type": "message_start", "message": self.message(started=True)}
            async for chunk in self.run.chunks():
                for event in self.feed(chunk):
                    yield event
                if self.error is not None:
                    yield self.error
                    return
            reason, sequence = self._stop()
            yield {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": self._usage(),
                "baton": {"stats": self.stats},
            }
            yield {"type": "message_stop"}
        finally:  # the client left mid-way: the Generate ends now
            self.run.cancel()

    async def collect(self) -> dict:
        """The message; ApiError for an error after the first token (nothing was sent yet)."""
        async for chunk in self.run.chunks(errors_as_chunks=False):
            self.feed(chunk)
        return self.message()


def _final(block: dict) -> dict:
    """A block as the message holds it: a tool_use's arguments as its input object."""
    if block["type"] != "tool_use":
        return dict(block)
    try:
        args = json.loads(block["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": args}
