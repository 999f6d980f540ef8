"""One OpenAI request's Generate calls (one per prompt of a batch) and the responses built from them.

    run = Run(servicer, job, model_id)          # starts every Generate (router/http/bridge.py)
    await run.start()                           # waits for every choice's first message: ApiError if
                                                # one failed before it (validation, 429, 503: nothing sent)
    async for chunk in run.chunks(): ...        # streaming: OpenAI chunk objects, in arrival order
    body = await run.collect()                  # non-streaming: the whole response object
    run.cancel()                                # the client left (or a stop string matched): Generates end

Per choice: text deltas are the router's (it matches the stop strings, router/stops.py); finish_reason is
"length" (LENGTH) or "stop" (STOP, EOS, or a stop string); usage is the router's (prompt_tokens from the
request, completion_tokens = tokens received, which the router's own usage equals; prompt_tokens_details.
cached_tokens: those the prefill worker restored from its prefix cache; with the reasoning parser on,
completion_tokens_details.reasoning_tokens: the tokens up to the one that closed </think>); `baton.stats` is the
router's Stats of the last message; logprobs (when asked) in OpenAI's completion or chat shape.
Chat with the reasoning parser on (--reasoning-parser qwen3): each choice's own ReasoningSplit
(router/http/reasoning.py) splits its text into message.reasoning_content and content (streamed:
delta.reasoning_content chunks, then delta.content); tool calls are read from the content alone. An error
after streaming began is sent as one {"error": ...} chunk, then the stream ends (OpenAI's servers do too).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from baton.client import Delta
from baton.rpc import StatusError
from router.http.bridge import END, GenerateStream
from router.http.errors import ApiError
from router.http.reasoning import ReasoningSplit

FINISH = {"LENGTH": "length", "STOP": "stop", "EOS": "stop"}


@dataclass
class Choice:
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (token id, logprob, [(id, logprob)]) per token
    lp_chars: int = 0  # streaming: the token texts' length sent so far (logprobs' text_offset)
    tokens: int = 0
    finish: str | None = None
    stats: dict = field(default_factory=dict)
    started: bool = False
    final: bool = False  # the router's last message arrived: its Generate ends on its own
    tools: object = None  # router.http.tool_calls.ToolCalls when the chat has tools: text -> content + calls
    echo: str | None = None  # completions with echo: the prompt's text, sent before the first token's
    echo_first: int = 0  # ... and the prompt's first token id (its logprob is null)
    calls: list = field(default_factory=list)  # non-streaming: the tool calls found
    think: ReasoningSplit | None = None  # the reasoning parser on: text -> reasoning_content + content
    cached: int = 0  # of prompt_tokens, those the prefill restored from its prefix cache (the last message's usage)
    last_token: int | None = None  # the last token id received
    stop_reason: object = None  # vLLM's: the stop string or stop token id that ended it (None: EOS, length)


class Run:
    def __init__(self, servicer, job, model_id: str, id_prefix: str | None = None, request_id: str | None = None):
        """request_id (a client's X-Request-Id): the router's GenerateRequest.request_id (its log lines, Stats),
        "-i" after it for choice i of several; default: the response's id."""
        self.job, self.model_id = job, model_id
        prefix = id_prefix or ("chatcmpl-" if job.kind == "chat" else "cmpl-")  # (Responses: "resp_")
        self.id, self.created = prefix + uuid.uuid4().hex, int(time.time())
        self.request_id = request_id or self.id
        # usage counts each prompt once: its first choice (choice i is prompt i // n's, j = i % n)
        self.choices = [Choice(0 if i % job.n else len(r.token_ids.ids)) for i, r in enumerate(job.requests)]
        if job.tools is not None:  # each choice its own parser, a forced call's opening already fed
            for c in self.choices:
                c.tools = job.tools.parser(stream=job.stream)
        if job.reasoning is not None:  # each choice its own splitter
            for c in self.choices:
                c.think = ReasoningSplit(job.reasoning)
        if job.echo:
            for i, (c, r) in enumerate(zip(self.choices, job.requests)):
                c.echo, c.echo_first = job.echo_texts[i // job.n], (list(r.token_ids.ids) or [0])[0]
        self._q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._streams = []
        for i, r in enumerate(job.requests):
            r.request_id = self.request_id if len(job.requests) == 1 else f"{self.request_id}-{i}"
            self._streams.append(GenerateStream(servicer, r, out=self._q, index=i, loop=loop))
        self._early: list[tuple] = []  # events seen before every choice started

    def cancel(self) -> None:
        """Ends the Generate calls still running (a finished one is left alone: it stays OK)."""
        for c, s in zip(self.choices, self._streams):
            if not c.final:
                s.cancel()

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    async def _next(self) -> tuple[int, str, str | None, list]:
        """The next (choice, text delta, finish_reason | None, logprobs); ApiError for a router error."""
        while True:
            i, item = await self._q.get()
            c = self.choices[i]
            if c.finish is not None:
                continue  # messages still in flight after a stop string ended the choice
            c.started = True
            if isinstance(item, StatusError):
                self.cancel()
                raise ApiError.from_status(item.code, item.message, self.job.rename)
            if item is END:  # ended without a finish reason: only when cancelled
                c.finish = "stop"
                return i, "", c.finish, []
            d = Delta.from_proto(item)
            if c.echo is not None:  # the first message: the prompt's text (and its tokens' logprobs) first
                d.text, c.echo = c.echo + d.text, None
                if self.job.top_logprobs is not None:
                    d.logprobs = [(c.echo_first, None, None), *d.prompt_logprobs, *d.logprobs]
            c.final = bool(d.finish_reason)
            c.tokens += len(d.token_ids)
            for t in d.token_ids if c.think is not None else ():  # usage's reasoning_tokens
                if c.think.closed:
                    break
                c.think.count(self.job.token_text(t))
            c.last_token = d.token_ids[-1] if d.token_ids else c.last_token
            if d.finish_reason:
                c.finish, c.stats = FINISH.get(d.finish_reason, "stop"), d.stats
                if d.finish_reason == "STOP":  # a stop string, else one of stop_token_ids: the last token
                    c.stop_reason = d.stop_string if d.stop_string is not None else c.last_token
                c.cached = d.usage.get("cached_tokens", 0) if c.prompt_tokens else 0  # a prompt's first choice
            c.text.append(d.text)
            c.logprobs.extend(d.logprobs)
            return i, d.text, c.finish, d.logprobs

    async def start(self) -> None:
        """Returns once every choice has its first message; ApiError (nothing sent yet) otherwise."""
        try:
            while not all(c.started for c in self.choices):
                self._early.append(await self._next())
        except BaseException:
            self.cancel()
            raise

    def usage(self) -> dict:
        p = sum(c.prompt_tokens for c in self.choices)
        n = sum(c.tokens for c in self.choices)
        cached = sum(c.cached for c in self.choices)
        out = {
            "prompt_tokens": p,
            "completion_tokens": n,
            "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if self.job.reasoning is not None:  # the reasoning parser on: its tokens, as OpenAI's o-series count them
            out["completion_tokens_details"] = {"reasoning_tokens": sum(c.think.tokens for c in self.choices)}
        return out

    def _stats(self):
        stats = [c.stats for c in self.choices]
        return {"stats": stats[0] if len(stats) == 1 else stats}

    def _logprobs(self, lps: list, offset: int = 0):
        """OpenAI's logprobs object for these tokens (None when not asked); text_offset counts the
        tokens' own texts from `offset`."""
        n, txt = self.job.top_logprobs, self.job.token_text
        if n is None:
            return None
        if self.job.kind == "chat":
            entry = lambda t, lp: {"token": txt(t), "logprob": lp, "bytes": list(txt(t).encode())}  # noqa: E731
            return {
                "content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top[:n]]} for t, lp, top in lps]
            }
        toks = [txt(t) for t, _, _ in lps]
        offsets = [offset + sum(len(x) for x in toks[:j]) for j in range(len(toks))]
        return {
            "tokens": toks,
            "token_logprobs": [lp for _, lp, _ in lps],
            # an echoed prompt's first token has neither (None, None); the sampled token is always there, as
            # OpenAI's (so up to N + 1 entries)
            "top_logprobs": [_with_sampled(txt, t, lp, top[:n]) if top is not None else None for t, lp, top in lps]
            if n
            else None,
            "text_offset": offsets,
        }

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}

    # ---- non-streaming --------------------------------------------------------------------------------
    async def collect(self) -> dict:
        try:
            while not self.done:
                await self._next()
        finally:
            self.cancel()
        out = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.job.kind == "chat":
                reasoning, text = c.think.split(text) if c.think is not None else (None, text)
                message = {"role": "assistant", "content": text}
                if c.tools is not None and text is not None:  # the calls are the content's (none in reasoning)
                    content, c.calls = c.tools.split(text)
                    if c.calls:  # OpenAI: content null when the message is only calls
                        message = {"role": "assistant", "content": content.strip() or None, "tool_calls": c.calls}
                    else:
                        message["content"] = content
                if reasoning is not None:
                    message["reasoning_content"] = reasoning
                out.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": self._logprobs(c.logprobs),
                        "finish_reason": "tool_calls" if c.calls else c.finish,
                        "stop_reason": c.stop_reason,
                    }
                )
            else:
                lp = self._logprobs(c.logprobs)
                out.append(
                    {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish, "stop_reason": c.stop_reason}
                )
        obj = "chat.completion" if self.job.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": out, "usage": self.usage(), "baton": self._stats()}

    # ---- streaming ------------------------------------------------------------------------------------
    def _chunk(
        self, i: int, text: str | None, finish: str | None, role: bool = False, lps=(), calls=(), reasoning: str = ""
    ) -> dict:
        lp = None
        if lps:
            c = self.choices[i]
            lp = self._logprobs(list(lps), c.lp_chars)
            c.lp_chars += sum(len(self.job.token_text(t)) for t, _, _ in lps)
        if self.job.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if reasoning:
                delta["reasoning_content"] = reasoning
            if calls:  # delta.tool_calls entries, each with its index among the choice's calls
                delta["tool_calls"] = list(calls)
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
            out = {**self._head("text_completion"), "choices": [choice]}
        choice["stop_reason"] = self.choices[i].stop_reason if finish is not None else None
        if self.job.include_usage:  # the usage so far on each chunk (continuous_usage_stats), else on the last
            out["usage"] = self.usage() if self.job.continuous_usage else None
        if finish is not None:
            out["baton"] = {"stats": self.choices[i].stats}
        return out

    def _events(self, i: int, text: str, finish: str | None, lps: list):
        c = self.choices[i]
        if self.job.kind != "chat":  # completions: the text rides on the finish chunk
            if (text or lps) and finish is None:
                yield self._chunk(i, text, None, lps=lps)
            elif finish is not None:
                yield self._chunk(i, text, finish, lps=lps)
            return
        reasoning = ""
        if c.think is not None:  # reasoning first, then the content (tool calls are read from it alone)
            reasoning, text = c.think.feed(text)
            if finish is not None:
                rest = c.think.finish()
                reasoning, text = reasoning + rest[0], text + rest[1]
        items = [text] if text else []
        if c.tools is not None:  # chat with tools: content and delta.tool_calls entries (tool_calls.py)
            items = c.tools.deltas(text)
            if finish is not None:  # what was held back; a forced call the model left open may parse now
                items += c.tools.deltas_end()
                if c.tools.calls and not c.tools.cut:  # a cut call keeps the router's reason
                    finish = "tool_calls"
        groups = _groups(items) or ([("", [])] if lps and not reasoning else [])
        if reasoning:
            yield self._chunk(i, None, None, lps=lps, reasoning=reasoning)
        for k, (content, entries) in enumerate(groups):
            yield self._chunk(i, content, None, lps=lps if k == 0 and not reasoning else (), calls=entries)
        if finish is not None:
            yield self._chunk(i, "", finish)

    async def chunks(self, errors_as_chunks: bool = True):
        """OpenAI chunk objects; the caller frames them as SSE and adds `data: [DONE]`. An error after the
        first token is one {"error": ...} chunk, last (errors_as_chunks False: the ApiError is raised)."""
        try:
            if self.job.kind == "chat":
                for i in range(len(self.choices)):
                    yield self._chunk(i, None, None, role=True)
            for ev in self._early:
                for chunk in self._events(*ev):
                    yield chunk
            while not self.done:
                try:
                    ev = await self._next()
                except ApiError as e:
                    if not errors_as_chunks:
                        raise
                    yield e.body()
                    return
                for chunk in self._events(*ev):
                    yield chunk
            if self.job.include_usage:
                yield {
                    **self._head("chat.completion.chunk" if self.job.kind == "chat" else "text_completion"),
                    "choices": [],
                    "usage": self.usage(),
                }
        finally:
            self.cancel()  # the client left early (CancelledError / GeneratorExit here), or the end


def _groups(items: list) -> list[tuple[str, list[dict]]]:
    """A choice's content strs and delta.tool_calls entries, in order -> one (content, entries) per chunk:
    content before any entry of its chunk; an index at most once per chunk, a call's opening entry alone
    for its index (OpenAI: the entry with the name has arguments ""), later pieces of one index joined."""
    out: list[tuple[str, list[dict]]] = []
    for it in items:
        if isinstance(it, str):
            if out and not out[-1][1]:
                out[-1] = (out[-1][0] + it, [])
            else:
                out.append((it, []))
            continue
        same = [e for e in out[-1][1] if e["index"] == it["index"]] if out else []
        if same and "id" not in same[-1] and "id" not in it:  # two pieces of one call's arguments: one
            same[-1]["function"] = {"arguments": same[-1]["function"]["arguments"] + it["function"]["arguments"]}
        elif same or not out:
            out.append(("", [it]))
        else:
            out[-1][1].append(it)
    return out


def _with_sampled(txt, t: int, lp, top: list) -> dict:
    """A completion token's top_logprobs: its N alternatives {text: logprob}, and the sampled token t when it is
    not among them (OpenAI's completions always show it)."""
    out = {txt(a): v for a, v in top}
    if lp is not None and all(a != t for a, _ in top):
        out.setdefault(txt(t), lp)
    return out
