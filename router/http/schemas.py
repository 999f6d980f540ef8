"""OpenAI request bodies -> the router's GenerateRequests (one per prompt), checked field by field.

    job = parse_completion(body, ctx) / parse_chat(body, ctx)   # ApiError(400) naming the field
    job.requests                        # router_pb2.GenerateRequest, one per choice: n per prompt of a batch
    job.rename                          # router field names -> this request's ("max_new_tokens" -> "max_tokens")

Accepted as OpenAI defines them: model (the served id, or absent), prompt (string, token ids, or a batch
of either) / messages, max_tokens (chat also max_completion_tokens), stream, stream_options.include_usage (and
vLLM's continuous_usage_stats: the usage so far on every chunk),
user (ignored), n (choices per prompt: each its own Generate; with a seed S, choice j of a prompt samples
with seed S + j mod 2^64, so the response replays; without, each draws its own), and for chat
add_generation_prompt, continue_final_message (vLLM's), chat_template_kwargs. Sampling goes to the
router's SamplingParams (it validates the ranges; its "sampling.<field>" messages are renamed back):
temperature (absent = 0, greedy: Baton's default, not OpenAI's 1), top_p, seed (any integer, taken mod
2^64), stop (a string or up to 16, matched on the text by the router: router/stops.py), logprobs
(completions: N alternatives; chat: true, with top_logprobs N), presence / frequency penalty, and vLLM's
top_k, min_p, repetition_penalty, echo (completions: the prompt first; with logprobs, the prompt tokens'
logprobs from the prefill, the first one null), and logit_bias ({"token id": value in [-100, 100]}, at most
300), and vLLM's stop_token_ids and ignore_eos (as "baton"'s), skip_special_tokens and include_stop_str_in_output
(GenerateRequest's), truncate_prompt_tokens (the prompt's last k tokens; -1: what the window leaves), min_tokens
(SamplingParams': at most max_tokens, checked by the router), cache_salt (GenerateRequest's: the prefill
workers' prefix cache shared only with prompts of the same salt), priority (GenerateRequest's: lower values
wait ahead in the router's slot line), and structured outputs (response_format
json_object / json_schema, vLLM's guided_* and structured_outputs: router/http/structured.py). Refused
with a 400 naming the field until Baton supports them: suffix, best_of > 1, functions, non-text content parts,
tools on /v1/completions; and n x prompts beyond the
sessions the workers hold at once (Limits.capacity: they could never all start). Chat `tools`
(tool_choice "auto", "required" or a named function; parallel_tool_calls): the template shows them, each
choice's text is split into content and `tool_calls`, and "required" / named force a call by writing its
opening after the prompt (chat_prompt; router/http/tools.py).
Baton's own fields: "baton": {"mode": "fast" | "exact", "engine": "bf16" | "fp8" | "mtp", "draft_block": K,
"stop_token_ids": [...], "ignore_eos": bool, "exact_policy": "coupling" | "rejection"}. Other top-level fields are
ignored, as OpenAI's servers do. max_tokens is at most the usable window less one prompt token (Limits.usable).
Defaults: max_tokens 16 for completions (OpenAI's), the rest of the window for chat.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.names import ENGINE_VALUES
from baton.think_tags import think_open
from baton.v1 import common_pb2, router_pb2
from router.http import structured, tool_grammar
from router.http.chat import ChatTemplateError, chat_messages
from router.http.errors import ApiError, bad
from router.http.fields import U32, _bool, _ids, _int, _is_int, _is_num, _num, _only, _stops
from router.http.reasoning import effort_kwargs
from router.http.tools import ToolChoice, tool_choice

MAX_BATCH = 64
MODES = {"fast": common_pb2.FAST, "exact": common_pb2.EXACT}
BATON_FIELDS = ("mode", "engine", "draft_block", "stop_token_ids", "ignore_eos", "exact_policy")
EXACT_POLICIES = {"coupling": common_pb2.COUPLING, "rejection": common_pb2.REJECTION}


@dataclass
class Limits:
    """What validation needs to know of the router."""

    model_id: str
    max_context: int  # the workers' window
    width: int  # W rows reserved for decoding
    tokenizer: object | None
    chat_template: object | None = None
    capacity: int = 0  # sessions the workers hold at once (Registry.capacity); 0 = unknown
    reasoning_parser: str = "none"  # RouterConfig.reasoning_parser: "qwen3" splits a chat's reasoning
    max_new_tokens: int = 0  # RouterConfig.max_new_tokens_limit (0 = unknown): the Messages API's cap

    @property
    def usable(self) -> int:
        """Prompt + new tokens a request may have at most: the window less the W rows reserved for decoding
        (what /v1/models reports as max_model_len)."""
        return self.max_context - self.width


@dataclass
class Job:
    kind: str  # "completion" | "chat"
    requests: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): usage on every chunk
    stops: tuple[str, ...] = ()
    rename: dict = field(default_factory=dict)
    mode: str = "fast"
    top_logprobs: int | None = None  # logprobs asked: how many alternatives to show (None = no logprobs)
    token_text: object = None  # token id -> its text (the tokenizer's decode), for logprobs
    n: int = 1  # choices per prompt
    tools: ToolChoice | None = None  # a chat whose text is parsed for tool calls (router/http/tools.py)
    echo: bool = False  # completions: each choice's text (and logprobs) begin with its prompt's
    echo_texts: list = field(default_factory=list)  # per prompt: its text
    capacity: int = 0  # Limits.capacity: the sessions its choices may hold at once (0 = unknown)
    reasoning: bool | None = None  # chat, the reasoning parser on: whether the text starts in reasoning


# ---- shared fields ------------------------------------------------------------------------------------
def check_model(body, lim: Limits) -> None:
    """The body is a JSON object whose `model`, when given, is the served id (404 otherwise)."""
    if not isinstance(body, dict):
        raise bad("body", f"expected a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad("model", f"expected a string, got {type(model).__name__}")
        if model != lim.model_id:
            raise ApiError(
                404,
                f"model: {model!r:.80} is not served here (served: {lim.model_id!r})",
                param="model",
                code="model_not_found",
            )


def _common(body: dict, lim: Limits, kind: str) -> tuple[Job, dict]:
    check_model(body, lim)
    job = Job(kind, stream=_bool(body, "stream", False), capacity=lim.capacity)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "expected an object")
        if not job.stream:  # as OpenAI's and vLLM's servers
            raise bad("stream_options", "only allowed with stream: true")
        job.include_usage = _bool(opts, "include_usage", False, "stream_options.")
        job.continuous_usage = _bool(opts, "continuous_usage_stats", False, "stream_options.")
        if job.continuous_usage and not job.include_usage:  # as vLLM: the per-chunk usage rides on include_usage
            raise bad("stream_options.continuous_usage_stats", "needs stream_options.include_usage: true")
    job.n = _int(body, "n", 1, MAX_BATCH) or 1
    job.stops = _stops(body.get("stop"))
    job.token_text = (lambda t: lim.tokenizer.decode([t])) if lim.tokenizer is not None else str
    gen = dict(
        mode=common_pb2.FAST, engine=common_pb2.ENGINE_UNSPECIFIED, draft_block=0, stop_token_ids=[], ignore_eos=False
    )
    gen["sampling"] = _sampling(body, job.stops)
    _only(body, "functions", lambda v: v == [], "the legacy functions field is not supported: use tools")
    spec, structured_names = structured.parse(body)  # response_format, vLLM's guided_* / structured_outputs
    if spec is not None:
        gen["sampling"].structured.CopyFrom(spec)
    # vLLM's extra parameters: those Baton has are taken as its own; the others are refused, not ignored
    gen["skip_special_tokens"] = _bool(body, "skip_special_tokens", True)
    gen["include_stop_str_in_output"] = _bool(body, "include_stop_str_in_output", False)
    gen["ignore_eos"] = _bool(body, "ignore_eos", False)
    salt = body.get("cache_salt")
    if salt is not None:  # vLLM's: the prefix cache shared only with prompts of the same salt
        if not isinstance(salt, str) or not salt:
            raise bad("cache_salt", "expected a non-empty string")
        gen["cache_salt"] = salt
    if priority := _int(body, "priority", -(2**31), 2**31 - 1):  # vLLM's: lower first in the router's slot line
        gen["priority"] = priority
    if body.get("stop_token_ids") is not None:
        gen["stop_token_ids"] = _ids(body["stop_token_ids"], "stop_token_ids", allow_empty=True)
    ext = body.get("baton")
    if ext is not None:
        if not isinstance(ext, dict):
            raise bad("baton", "expected an object")
        unknown = sorted(set(ext) - set(BATON_FIELDS))
        if unknown:
            raise bad(f"baton.{unknown[0]:.40}", f"unknown field (known: {', '.join(BATON_FIELDS)})")
        mode, engine = ext.get("mode"), ext.get("engine")
        if mode is not None:
            if mode not in MODES:
                raise bad("baton.mode", f"{mode!r:.40} is not one of fast, exact")
            gen["mode"], job.mode = MODES[mode], mode
        if engine is not None:
            if engine not in ENGINE_VALUES:
                raise bad("baton.engine", f"{engine!r:.40} is not one of bf16, fp8, mtp")
            gen["engine"] = ENGINE_VALUES[engine]
        policy = ext.get("exact_policy")
        if policy is not None:
            if policy not in EXACT_POLICIES:
                raise bad("baton.exact_policy", f"{policy!r:.40} is not one of coupling, rejection")
            gen["sampling"].exact_policy = EXACT_POLICIES[policy]
        gen["draft_block"] = _int(ext, "draft_block", 0, where="baton.") or 0
        gen["ignore_eos"] = _bool(ext, "ignore_eos", gen["ignore_eos"], "baton.")
        ids = ext.get("stop_token_ids")
        if ids is not None:
            gen["stop_token_ids"] = _ids(ids, "baton.stop_token_ids", allow_empty=True)
    job.rename = {**{f"sampling.{f}": f for f in SAMPLING_FIELDS}, "sampling.stop": "stop"}
    job.rename |= structured_names
    job.rename |= {
        "draft_block": "baton.draft_block",
        "mode": "baton.mode",
        "engine": "baton.engine",
        "stop_token_ids": "stop_token_ids" if "stop_token_ids" in body else "baton.stop_token_ids",
    }
    structured.think_budget(body, gen["sampling"], job.rename)  # vLLM's thinking_token_budget (router-resolved)
    return job, gen


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
SAMPLING_FIELDS += ("repetition_penalty", "seed", "logprobs", "logit_bias", "min_tokens")


def _sampling(body: dict, stops: tuple[str, ...]) -> common_pb2.SamplingParams:
    """The OpenAI sampling fields -> SamplingParams (ranges are the router's); logprobs are set per endpoint."""
    sp = common_pb2.SamplingParams(stop=list(stops))
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = _num(body, name)
        if v is not None:
            setattr(sp, name, v)
    top_k = _int(body, "top_k", -1)  # vLLM's -1 = off
    if top_k is not None and top_k > 0:
        sp.top_k = top_k
    sp.min_tokens = _int(body, "min_tokens", 0) or 0  # vLLM's; the router checks it against max_tokens
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1)
    if seed is not None:
        sp.seed = seed % (1 << 64)
    bias = body.get("logit_bias")
    if bias is not None:  # {"token id": value}: the router checks the ids against the vocabulary, the range
        if not isinstance(bias, dict):
            raise bad("logit_bias", "expected an object of token id -> number")
        for k, v in bias.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) < U32) or not _is_num(v):
                raise bad("logit_bias", f"{k!r:.20}: {v!r:.20}: expected a token id and a finite number")
            sp.logit_bias[int(k)] = float(v)
    return sp


def _encode(text: str, lim: Limits, name: str) -> list[int]:
    if lim.tokenizer is None:
        raise bad(name, "this router has no tokenizer: send token ids")
    if len(text) > 32 * lim.max_context:
        raise bad(name, f"{len(text)} characters is far beyond the window of {lim.max_context} tokens")
    return lim.tokenizer.encode(text)


def _max_tokens(body: dict, names: tuple[str, ...], default, lim: Limits) -> tuple[int | None, str]:
    for name in names:
        v = _int(body, name, 1, max(1, lim.usable - 1))  # at least one prompt token
        if v is not None:
            return v, name
    return default, names[0]


def _request(ids: list[int], max_tokens: int, gen: dict) -> router_pb2.GenerateRequest:
    r = router_pb2.GenerateRequest(max_new_tokens=max_tokens, **gen)
    r.token_ids.SetInParent()
    r.token_ids.ids.extend(ids)
    return r


def _choices(job: Job, requests: list) -> None:
    """job.requests: job.n choices per prompt request, in prompt order (choice index = prompt * n + j); with a
    seed S, choice j gets S + j (mod 2^64): distinct samples that replay. Each announces its n equal prompts."""
    if len(requests) * job.n > MAX_BATCH:
        raise bad("n", f"{job.n} choices x {len(requests)} prompts = {len(requests) * job.n}: at most {MAX_BATCH}")
    if job.capacity and len(requests) * job.n > job.capacity:  # all run at once: more could never all start
        raise bad(
            "n",
            f"{job.n} choices x {len(requests)} prompts = {len(requests) * job.n} sessions at once, but the workers "
            f"hold {job.capacity} (start them with more --slots, or send fewer choices per request)",
        )
    job.requests = []
    for r in requests:
        for j in range(job.n):
            c = router_pb2.GenerateRequest()
            c.CopyFrom(r)
            if j and r.sampling.HasField("seed"):
                c.sampling.seed = (r.sampling.seed + j) % (1 << 64)
            if job.n > 1:  # the choices' prompt computed once, in one pass (GenerateRequest.equal_prompts)
                c.equal_prompts = job.n
            job.requests.append(c)


def _truncated(body: dict, ids: list[int], n: int | None, lim: Limits) -> list[int]:
    """vLLM's truncate_prompt_tokens: k >= 1 keeps the prompt's last k tokens; -1 the most the window leaves
    beside max_tokens (one new token when max_tokens is the chat's default); absent: the prompt as it is."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return ids
    if not _is_int(k) or not (k == -1 or 1 <= k <= lim.usable - 1):
        raise bad("truncate_prompt_tokens", f"{k!r:.20}: expected -1 or an integer in 1..{lim.usable - 1}")
    keep = max(1, lim.usable - (n or 1)) if k == -1 else k
    return ids[-keep:]


def _window_rest(ids: list[int], lim: Limits) -> int:
    """Default max_tokens of a chat: what the window leaves (at least 1: the router names the problem)."""
    return max(1, lim.usable - len(ids))


# ---- the two endpoints ------------------------------------------------------------------------------
def parse_completion(body, lim: Limits) -> Job:
    job, gen = _common(body, lim, "completion")
    lp = _int(body, "logprobs", 0, 1 << 31)
    if lp is not None:  # N alternatives (0: the chosen token's logprob only)
        job.top_logprobs, gen["sampling"].logprobs = lp, max(lp, 1) if lp <= 20 else lp
    job.echo = _bool(body, "echo", False)
    for name in ("tools", "tool_choice"):
        _only(body, name, lambda v: False, "tool calls are a chat completions feature (/v1/chat/completions)")
    _only(body, "suffix", lambda v: v == "", "not supported")
    _only(body, "best_of", lambda v: v == 1, "only 1 is supported")
    n, name = _max_tokens(body, ("max_tokens",), 16, lim)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "required: a string, a list of token ids, or a list of either")
    if isinstance(prompt, str):
        prompts = [_encode(prompt, lim, "prompt")]
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        prompts = [_ids(prompt, "prompt", allow_empty=True)]
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompts = [_encode(p, lim, f"prompt[{i}]") for i, p in enumerate(prompt)]
    elif isinstance(prompt, list) and all(isinstance(p, list) for p in prompt):
        prompts = [_ids(p, f"prompt[{i}]", allow_empty=True) for i, p in enumerate(prompt)]
    else:
        raise bad("prompt", "expected a string, a list of token ids, or a list of strings / of token-id lists")
    if not prompts:
        raise bad("prompt", "an empty batch")
    if len(prompts) > MAX_BATCH:
        raise bad("prompt", f"a batch of {len(prompts)} prompts: at most {MAX_BATCH}")
    cut = [_truncated(body, ids, n, lim) for ids in prompts]
    reqs = [_request(ids, n, gen) for ids in cut]
    if job.echo:  # the prompt's text (as given, else decoded; truncated: decoded) first; with logprobs, its tokens'
        batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        texts = prompt if batch else [prompt]  # per prompt: its text, or its token ids (decoded)
        dec = lim.tokenizer.decode if lim.tokenizer is not None else (lambda ids: "")
        job.echo_texts = [
            t if isinstance(t, str) and len(c) == len(ids) else dec(c) for t, ids, c in zip(texts, prompts, cut)
        ]
        for r in reqs:
            if lp is not None:
                r.prompt_logprobs = min(lp, 20)
    _choices(job, reqs)
    job.rename.update({"max_new_tokens": name, "token_ids": "prompt"})
    return job


def chat_prompt(body: dict, lim: Limits) -> tuple[str, ToolChoice]:
    """A chat body -> (the prompt text, its ToolChoice): the messages rendered by the model's template
    (add_generation_prompt, chat_template_kwargs, the tools shown; continue_final_message: cut after the last
    message's content, open_final), then a forced call's opening (ToolChoice.prompt); a structured output
    closes a <think> block the rendering leaves open (structured.skip_reasoning), unless the model reasons first
    (structured.reasons_first: the reasoning parser on; the structure then applies after </think>). Chat completions and
    /tokenize both send exactly this text."""
    messages = chat_messages(body.get("messages"))
    add_gen = _bool(body, "add_generation_prompt", True)
    cont = _bool(body, "continue_final_message", False)
    if cont and add_gen:
        raise bad("continue_final_message", "cannot be used with add_generation_prompt: true (set it to false)")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "expected an object")
    kwargs = effort_kwargs(body.get("reasoning_effort"), kwargs, "reasoning_effort")  # none / minimal: no thinking
    if lim.chat_template is None:
        raise bad(
            "messages",
            f"the model {lim.model_id!r} has no chat template (no chat_template.jinja and no "
            f"chat_template in tokenizer_config.json): use /v1/completions",
        )
    choice = tool_choice(body, lim.chat_template.source)
    if choice.forced and not add_gen:
        raise bad("tool_choice", "forcing a call opens it after the generation prompt: needs add_generation_prompt")
    try:
        text = lim.chat_template.render(messages, add_generation_prompt=add_gen, tools=choice.shown, kwargs=kwargs)
    except ChatTemplateError as e:
        raise bad("messages", str(e)) from None
    if cont:
        text = open_final(text, messages[-1]["content"])
    text = choice.prompt(text)
    if not choice.forced and structured.parse(body)[0] is not None and structured.reasons_first(text, lim) is None:
        text = structured.skip_reasoning(text)
    return text, choice


def open_final(text: str, content: str) -> str:
    """vLLM's continue_final_message (as transformers' apply_chat_template does it): the rendered chat cut just
    after the last message's content, so the model continues that message (no end-of-turn after it). The
    content as given, else stripped (templates often strip it); not found in the text: a 400 naming messages."""
    for c in dict.fromkeys((content, content.strip())):
        i = text.rfind(c) if c else -1
        if i >= 0:
            return text[: i + len(c)]
    why = "it is empty" if not content.strip() else "the chat template does not render it as given"
    raise bad("messages", f"continue_final_message: the last message cannot be continued: {why}")


def parse_chat(body, lim: Limits) -> Job:
    job, gen = _common(body, lim, "chat")
    top = _int(body, "top_logprobs", 0, 20)
    if _bool(body, "logprobs", False):
        job.top_logprobs = top or 0
        gen["sampling"].logprobs = max(job.top_logprobs, 1)
    elif top is not None:
        raise bad("top_logprobs", "needs logprobs: true")
    text, choice = chat_prompt(body, lim)
    if gen["sampling"].HasField("structured") and not choice.forced:  # reasoning first: free until </think>
        if (end := structured.reasons_first(text, lim)) is not None:
            gen["sampling"].structured.after_token = end
    tool_grammar.constrain(gen, choice, lim.chat_template.source)  # a forced call held to its tool's schema
    job.tools = choice if choice.tools is not None else None
    if lim.reasoning_parser != "none":  # the prompt sent (a forced call's opening included) decides
        job.reasoning = think_open(text)
    n, name = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None, lim)
    ids = _truncated(body, _encode(text, lim, "messages"), n, lim)
    _choices(job, [_request(ids, n if n is not None else _window_rest(ids, lim), gen)])
    job.rename.update({"max_new_tokens": name, "token_ids": "messages", "prompt": "messages"})
    job.rename["sampling.logprobs"] = "top_logprobs"
    return job
