"""The Responses API's output, made from the chat path's stream (router/http/run.py Run.chunks).

    ev = ResponseEvents(run, req, model_id)      # run: Run(servicer, job, id_prefix="resp_"), started
    async for event in ev.stream(): ...          # streaming: each a dict with "type" and "sequence_number"
    body = await ev.collect()                    # non-streaming: the final response object

One chat completion stream (one choice: the Responses API has no n) becomes the response's `output`, its
items in the order the text gives them: a reasoning item (the reasoning parser's reasoning_content), a
message item (the content, one output_text part, with its logprobs when asked), then one function_call
item per tool call (the chat path's parser: router/http/tool_calls.py). The events are OpenAI's, with
sequence numbers from 0:
    response.created, response.in_progress                                    (status in_progress)
    per item: response.output_item.added, response.content_part.added (message, reasoning),
              response.output_text.delta / response.reasoning_text.delta / response.function_call_arguments.delta,
              ...text.done / ...arguments.done, response.content_part.done, response.output_item.done
    response.completed (status completed), or response.incomplete (the window or max_output_tokens cut it:
    incomplete_details.reason "max_output_tokens"), or response.failed (an error after the first token:
    response.error {code, message}); no `data: [DONE]` after it, as OpenAI's.
An empty answer is one message item with empty text. usage: input_tokens (input_tokens_details.cached_tokens:
restored by the prefix cache), output_tokens (output_tokens_details.reasoning_tokens: chat's
completion_tokens_details.reasoning_tokens, the reasoning's tokens up to the one that closed </think>; 0 with
the reasoning parser off), total_tokens. The router's Stats ride in "baton": {"stats"}, as in chat.
A completed or incomplete response with store true is kept (router/http/response_store.py: its object, and
its request's input items with its output items after them), as its final event is made; a failed one is not.
"""

from __future__ import annotations

import logging
import uuid

log = logging.getLogger("baton.router")
FAILED_CODE = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponseEvents:
    def __init__(self, run, req, model_id: str):
        self.run, self.req, self.model_id = run, req, model_id
        self.seq = 0
        self.output: list[dict] = []  # the items, in order
        self.open: dict | None = None  # the item being written (the last of output), or None
        self.calls: dict[int, dict] = {}  # a tool call's index in the chat stream -> its item
        self.lps: list = []  # logprobs that came before their text (held back by the stop / tool parsers)
        self.finish: str | None = None
        self.usage: dict | None = None
        self.stats: dict = {}
        self.error: dict | None = None

    # ---- the response object --------------------------------------------------------------------------
    def response(self, status: str) -> dict:
        u = self.usage
        usage = None
        if u is not None:
            usage = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {
                    "reasoning_tokens": u.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
                },
                "total_tokens": u["total_tokens"],
            }
        out = {
            "id": self.run.id,
            "object": "response",
            "created_at": self.run.created,
            "status": status,
            "model": self.model_id,
            "output": [dict(item) for item in self.output],
            "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **self.req.echo(),
            "baton": {"stats": self.stats},
        }
        if self.error is not None:
            out["error"] = self.error
        return out

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _final(self) -> dict:
        if self.error is not None:
            return self._event("response.failed", response=self.response("failed"))
        status = "incomplete" if self.finish == "length" else "completed"
        out = self._event(f"response.{status}", response=self.response(status))
        if self.req.store is not None:  # store true: kept for GET and previous_response_id (response_store.py)
            items = self.req.items + [dict(item) for item in self.output]  # the output items read back as input
            if not self.req.store.put(out["response"], items, self.req.previous_response_id):
                log.warning("response %s not stored: larger than the whole store", self.run.id)
        return out

    # ---- items --------------------------------------------------------------------------------------
    def _open(self, kind: str, **fields) -> list[dict]:
        """Closes the open item; opens a new one of `kind` (reasoning, message, function_call)."""
        ev = self._close()
        prefix = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}[kind]
        item = {"type": kind, "id": _id(prefix), "status": "in_progress", **fields}
        if kind == "message":
            item.update(role="assistant", content=[])
        elif kind == "reasoning":
            item.update(summary=[], content=[])
        self.output.append(item)
        self.open = item
        ev.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        if kind != "function_call":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            part = part if kind == "message" else {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            ev.append(self._event("response.content_part.added", **self._where(), part=dict(part)))
        return ev

    def _where(self, content: bool = True) -> dict:
        at = {"item_id": self.open["id"], "output_index": len(self.output) - 1}
        return {**at, "content_index": 0} if content else at

    def _close(self) -> list[dict]:
        item, ev = self.open, []
        if item is None:
            return ev
        status = "incomplete" if self.finish == "length" and self.error is None else "completed"
        if item["type"] == "function_call":
            done = {"arguments": item["arguments"], "name": item["name"]}
            ev.append(self._event("response.function_call_arguments.done", **self._where(False), **done))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                done = {"text": part["text"], "logprobs": part["logprobs"]}
                ev.append(self._event("response.output_text.done", **self._where(), **done))
            else:
                ev.append(self._event("response.reasoning_text.done", **self._where(), text=part["text"]))
            ev.append(self._event("response.content_part.done", **self._where(), part=dict(part)))
        item["status"] = status
        ev.append(self._event("response.output_item.done", output_index=len(self.output) - 1, item=dict(item)))
        self.open = None
        return ev

    def _text(self, kind: str, text: str, lps: list) -> list[dict]:
        ev = [] if self.open is not None and self.open["type"] == kind else self._open(kind)
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return ev + [self._event("response.reasoning_text.delta", **self._where(), delta=text)]
        lps, self.lps = self.lps + lps, []
        part["logprobs"] = part["logprobs"] + lps
        return ev + [self._event("response.output_text.delta", **self._where(), delta=text, logprobs=lps)]

    def _call(self, entry: dict) -> list[dict]:
        """One delta.tool_calls entry: a call's opening (id, name) opens its item; a piece extends it."""
        ev, fn = [], entry.get("function") or {}
        if "id" in entry:
            ev = self._open("function_call", call_id=entry["id"], name=fn.get("name", ""), arguments="")
            self.calls[entry["index"]] = self.open
        piece = fn.get("arguments") or ""
        item = self.calls.get(entry["index"])
        if piece and item is not None:  # (its own item: the chat stream finishes a call before the next)
            item["arguments"] += piece
            at = {"item_id": item["id"], "output_index": self.output.index(item)}
            ev.append(self._event("response.function_call_arguments.delta", **at, delta=piece))
        return ev

    # ---- the chat stream -> events ------------------------------------------------------------------
    def feed(self, chunk: dict) -> list[dict]:
        """One chat chunk (or a Run.chunks error body) -> the Responses events it makes."""
        if "error" in chunk:
            e = chunk["error"]
            self.error = {"code": FAILED_CODE.get(e.get("type"), "server_error"), "message": e.get("message", "")}
            return self._close()
        if not chunk.get("choices"):  # the usage chunk (stream_options.include_usage), last
            self.usage = chunk.get("usage")
            return []
        c = chunk["choices"][0]
        delta, ev = c.get("delta") or {}, []
        lps = list((c.get("logprobs") or {}).get("content") or [])
        if delta.get("reasoning_content"):
            ev += self._text("reasoning", delta["reasoning_content"], [])
        if delta.get("content"):
            ev += self._text("message", delta["content"], lps)
        else:
            self.lps += lps
        for entry in delta.get("tool_calls") or []:
            ev += self._call(entry)
        if c.get("finish_reason") is not None:
            self.finish = c["finish_reason"]
            self.stats = (chunk.get("baton") or {}).get("stats", {})
            if not self.output:  # an empty answer: an empty message
                ev += self._open("message")
            ev += self._close()
        return ev

    async def stream(self):
        """Every event of the response, the final one (completed / incomplete / failed) last."""
        try:
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            async for chunk in self.run.chunks():
                for event in self.feed(chunk):
                    yield event
                if self.error is not None:
                    break
            yield self._final()
        finally:  # the client left mid-way: the Generate ends now, not when the chunks' generator is collected
            self.run.cancel()

    async def collect(self) -> dict:
        """The final response object; ApiError for an error after the first token (nothing was sent yet)."""
        async for chunk in self.run.chunks(errors_as_chunks=False):
            self.feed(chunk)
        return self._final()["response"]
