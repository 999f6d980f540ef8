"""Python client of the Baton router (the public `baton.v1.Router` service).

    with Client("127.0.0.1:50051", token=None, tls_ca=None) as c:
        for d in c.generate("def main", max_new_tokens=32, mode="exact", engine="fp8"):
            print(d.text, end="")          # d.token_ids, and on the last delta: finish_reason, usage, stats
        info = c.model_info()              # baton.v1.ModelInfo
        c.health()                         # "SERVING" | "NOT_SERVING" | ... | an error code name

Leaving the `generate` loop early (break, exception, garbage collection) cancels the call, and the
router then releases the request's sessions on both workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.names import ENGINE_VALUES
from baton.rpc import make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, router_pb2, router_pb2_grpc

DEFAULT_ADDR = "127.0.0.1:50051"
MODES = {"fast": common_pb2.FAST, "exact": common_pb2.EXACT}
ENGINES = {None: common_pb2.ENGINE_UNSPECIFIED, **ENGINE_VALUES}
EXACT_POLICIES = {
    None: common_pb2.EXACT_POLICY_UNSPECIFIED,
    "coupling": common_pb2.COUPLING,
    "rejection": common_pb2.REJECTION,
}


@dataclass
class Delta:
    """One streamed message. finish_reason ("LENGTH" | "STOP" | "EOS"), usage and stats are set on
    the last one only."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    logprobs: list = field(default_factory=list)  # (token id, logprob, [(id, logprob)]) per token, when asked
    prompt_logprobs: list = field(default_factory=list)  # the first message, when asked: prompt tokens 1 .. n-1
    stop_string: str | None = None  # the last message: the stop string that ended the output, if one did

    @classmethod
    def from_proto(cls, m: router_pb2.GenerateResponse) -> "Delta":
        lps = [(e.token_id, e.logprob, [(a.token_id, a.logprob) for a in e.top]) for e in m.logprobs]
        plps = [(e.token_id, e.logprob, [(a.token_id, a.logprob) for a in e.top]) for e in m.prompt_logprobs]
        if not m.finish_reason:
            return cls(list(m.token_ids), m.text, logprobs=lps, prompt_logprobs=plps)
        usage = {
            "prompt_tokens": m.usage.prompt_tokens,
            "completion_tokens": m.usage.completion_tokens,
            "cached_tokens": m.usage.cached_tokens,
        }
        s = m.stats
        stats = {
            k: getattr(s, k)
            for k in (
                "ttft_ms",
                "bridge_bytes",
                "bridge_seconds",
                "drafted",
                "accepted",
                "acceptance_rate",
                "migrations",
                "decode_tokens_per_s",
                "request_id",
                "seed",
                "handoff_ms",
                "first_decode_ms",
                "rounds",
                "draft_ms",
                "verify_ms",
                "handoffs",
                "draft_only_handoffs",
                "mean_accept_len",
            )
        }
        if s.HasField("handoff_timeline"):  # asked for: the first hand-off's marks, name -> monotonic ns
            stats["handoff_timeline"] = dict(s.handoff_timeline.marks_ns)
        finish = common_pb2.FinishReason.Name(m.finish_reason)
        return cls(list(m.token_ids), m.text, finish, usage, stats, lps, plps, m.stop_string or None)


class Client:
    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        token: str | None = None,
        tls_ca: str | None = None,
        *,
        settings: Settings | None = None,
    ):
        """settings None = Settings.from_env() (BATON_TOKEN, BATON_TLS_CA...) with `token`/`tls_ca` winning."""
        settings = settings or Settings.from_env(token=token, tls_ca=tls_ca)
        self.addr = addr
        self._channel = make_channel(addr, settings)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 64,
        mode: str = "fast",
        engine: str | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        draft_block: int = 0,
        timeout: float | None = None,
        request_id: str = "",
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        logprobs: int = 0,
        repetition_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        exact_policy: str | None = None,
        handoff_timeline: bool = False,
        logit_bias: dict[int, float] | None = None,
        prompt_logprobs: int | None = None,
        equal_prompts: int = 0,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        structured: dict | None = None,
        cache_salt: str = "",
        priority: int = 0,
        thinking_budget: int | None = None,
    ) -> Iterator[Delta]:
        """Stream a completion. `prompt` is text or a list of token ids (or pass token_ids=).
        Sampling (SamplingParams): temperature 0 = greedy; seed None = the router draws one (the last
        delta's stats["seed"]); stop strings end the text before them; logprobs = N alternatives;
        repetition_penalty (prompt + generated tokens), presence_penalty / frequency_penalty (generated
        tokens) as in vLLM / OpenAI, neutral 0 (docs/CONTRACTS.md, "Sampling"); logit_bias {token id: value in
        [-100, 100]} added to those logits after the penalties. prompt_logprobs N (<= 20): the first delta's
        prompt_logprobs, each prompt token's logprob given those before it (raw logits), with N alternatives.
        exact_policy (exact mode at T > 0): "coupling" (token-identical to the exact model's seeded
        decode) or "rejection" (speculative rejection sampling, exact in distribution); None = the server's.
        handoff_timeline (diagnostics): the last delta's stats["handoff_timeline"] holds the first state
        hand-off's marks, name -> monotonic ns (baton/handoff/timeline.py). equal_prompts N: this call is one of
        N Generate calls of the same prompt sent together (samples of one prompt): the prefill worker waits a
        few ms for the others so their prompt is computed once (a hint; the tokens never depend on it).
        skip_special_tokens False: the text keeps special tokens (an EOS's "<|im_end|>"); include_stop_str_in_output:
        the text ends with the stop string that ended it (vLLM's two options; token_ids never change).
        min_tokens N (vLLM's, <= max_new_tokens): the first N tokens are never EOS or a stop token id, and no
        stop string is matched before the (N + 1)th token completes it. structured (fast mode, bf16 / fp8): one
        of {"json_schema": dict or JSON text}, {"json_object": True}, {"regex": str}, {"grammar": EBNF str},
        {"choice": [str, ...]} (StructuredOutput; "compact_whitespace": True beside json_schema): every token
        is one the grammar allows, and the output ends at EOS once the structure is complete. cache_salt: the
        prefill workers' prefix cache is shared only with prompts of the same salt (vLLM's; "": unsalted).
        priority (vLLM's): while the workers' slots are full, lower values wait ahead in the router's line.
        thinking_budget N (vLLM's thinking_token_budget): at most N tokens inside the <think> block the prompt
        leaves open, then "</think>" comes next (no effect where none is open or "</think>" is not one token).
        Raises grpc.RpcError with the router's status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)."""
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {sorted(MODES)}")
        if engine not in ENGINES:
            raise ValueError(f"engine: {engine!r} is not one of bf16, fp8, mtp")
        if exact_policy not in EXACT_POLICIES:
            raise ValueError(f"exact_policy: {exact_policy!r} is not one of coupling, rejection")
        req = router_pb2.GenerateRequest(
            request_id=request_id,
            max_new_tokens=max_new_tokens,
            mode=MODES[mode],
            engine=ENGINES[engine],
            stop_token_ids=list(stop_token_ids),
            ignore_eos=ignore_eos,
            draft_block=draft_block,
            handoff_timeline=handoff_timeline,
            equal_prompts=equal_prompts,
            skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=include_stop_str_in_output,
            cache_salt=cache_salt,
            priority=priority,
            sampling=common_pb2.SamplingParams(
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                seed=seed,
                stop=list(stop),
                logprobs=logprobs,
                repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                exact_policy=EXACT_POLICIES[exact_policy],
                logit_bias=dict(logit_bias or {}),
                min_tokens=min_tokens,
            ),
        )
        if structured is not None:
            req.sampling.structured.CopyFrom(structured_output(structured))
        if thinking_budget is not None:
            req.sampling.thinking_budget = thinking_budget
        if prompt_logprobs is not None:
            req.prompt_logprobs = prompt_logprobs
        if token_ids is None and prompt is not None and not isinstance(prompt, str):
            token_ids = prompt
        if token_ids is not None:
            req.token_ids.ids.extend(int(t) for t in token_ids)
        else:
            req.text = prompt or ""
        return self._stream(req, timeout)

    def _stream(self, req, timeout) -> Iterator[Delta]:
        call = self._stub.Generate(req, timeout=timeout)
        try:
            for m in call:
                yield Delta.from_proto(m)
        finally:
            call.cancel()  # no-op once the stream has ended; cancels it when the caller stops early

    def model_info(self, timeout: float = 10.0) -> router_pb2.ModelInfo:
        return self._stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=timeout)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """The serving status name, or the gRPC error code name when the check fails (e.g. UNAVAILABLE)."""
        try:
            return self.check_health(service, timeout)
        except grpc.RpcError as e:
            return e.code().name

    def check_health(self, service: str = "", timeout: float = 5.0) -> str:
        """The serving status name; grpc.RpcError when the check itself fails (its details say why)."""
        resp = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def structured_output(spec: dict):
    """{"json_schema": dict or str} | {"json_object": True} | {"regex": str} | {"grammar": str} |
    {"choice": [str, ...]} (with "compact_whitespace" beside json_schema; "after_token": id beside any: the
    structure applies after that token, a reasoning model's end of thinking; "after_budget": N beside it, a
    thinking budget: at most N tokens before it; {"any_text": True} with both: the budget alone)
    -> baton.v1.StructuredOutput."""
    import json

    spec = dict(spec)
    compact = bool(spec.pop("compact_whitespace", False))
    after = spec.pop("after_token", None)
    budget = spec.pop("after_budget", None)
    if len(spec) != 1:
        raise ValueError(f"structured: one of json_schema, json_object, regex, grammar, choice (got {sorted(spec)})")
    ((kind, value),) = spec.items()
    out = common_pb2.StructuredOutput(compact_whitespace=compact)
    if kind == "json_schema":
        out.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        out.choice.options.extend(value)
    elif kind in ("json_object", "regex", "grammar", "any_text"):
        setattr(out, kind, value)
    elif kind == "structural_tag":
        out.structural_tag = value if isinstance(value, str) else json.dumps(value)
    else:
        raise ValueError(f"structured: unknown kind {kind!r}")
    if after is not None:
        out.after_token = int(after)
    if budget is not None:
        out.after_budget = int(budget)
    return out
