"""A Generate request checked and turned into its Plan (router/service.py's validate step).

    plan = plan_request(request, request_id, config, meta, registry)   # or StatusError

INVALID_ARGUMENT names the field (prompt, token_ids, max_new_tokens, mode, engine, draft_block,
stop_token_ids, request_id, prompt_logprobs, sampling.<field>); text prompts are tokenized here; a request
without a seed gets a random one (sampling_rules.plan); no prefill or no decode worker up -> UNAVAILABLE.
The window is the smallest the workers report (Registry.max_context), W rows of it reserved for decoding.
"""

from __future__ import annotations

import secrets

import grpc

from baton import sampling_rules
from baton.names import MODE_NAMES, engine_name, known_engine
from baton.rpc import StatusError
from baton.v1 import common_pb2, router_pb2
from router.calls import unavailable
from router.config import ModelMeta, Plan, RouterConfig
from router.registry import Registry

MAX_STOP_IDS = 64
MAX_CACHE_SALT_BYTES = 256  # GenerateRequest.cache_salt
MAX_REQUEST_ID = 128


def _bad(field: str, why: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {why}")


def plan_request(
    r: router_pb2.GenerateRequest, request_id: str, cfg: RouterConfig, meta: ModelMeta, registry: Registry
) -> Plan:
    """The request's Plan, or the StatusError its first problem gets (module doc)."""
    W = cfg.width
    if len(r.request_id) > MAX_REQUEST_ID:
        raise _bad("request_id", f"longer than {MAX_REQUEST_ID} characters")
    if r.mode not in MODE_NAMES:
        raise _bad("mode", f"unknown value {r.mode} (FAST=1, EXACT=2)")
    if not known_engine(r.engine):
        raise _bad("engine", f"unknown value {r.engine} (BF16=1, FP8=2, MTP=3)")
    max_ctx = registry.max_context(cfg.max_context)
    which = r.WhichOneof("prompt")
    if which == "text" and r.text:
        if meta.tokenizer is None:
            raise _bad("prompt", "this router has no tokenizer; send token_ids")
        if len(r.text) > 32 * max_ctx:
            raise _bad("prompt", f"{len(r.text)} characters is far beyond the window of {max_ctx} tokens")
        ids = meta.tokenizer.encode(r.text)
    elif which == "token_ids":
        ids = r.token_ids.ids
    else:
        ids = []
    if not ids:
        raise _bad("prompt", "empty (set text or token_ids)")
    if len(ids) + W + 1 > max_ctx:
        raise _bad(
            "prompt",
            f"{len(ids)} tokens is too long: at most {max_ctx - W - 1} fit the window of "
            f"{max_ctx} ({W} rows are reserved for decoding, and one token at least is generated)",
        )
    ids = list(ids)
    if which == "token_ids" and max(ids) >= meta.vocab_size:
        i = next(i for i, t in enumerate(ids) if t >= meta.vocab_size)
        raise _bad("token_ids", f"id {ids[i]} at index {i} is out of range [0, {meta.vocab_size})")
    n = r.max_new_tokens
    if n < 1:
        raise _bad("max_new_tokens", "must be >= 1")
    if n > cfg.max_new_tokens_limit:
        raise _bad("max_new_tokens", f"{n} exceeds the limit of {cfg.max_new_tokens_limit}")
    if len(ids) + n + W > max_ctx:
        raise _bad(
            "max_new_tokens",
            f"prompt ({len(ids)}) + max_new_tokens ({n}) + {W} reserved rows exceeds the window of {max_ctx} tokens",
        )
    k = r.draft_block or cfg.default_draft_block
    if not 1 <= k <= W - 2:
        raise _bad("draft_block", f"{r.draft_block} is out of range 1..{W - 2} (0 = default)")
    if len(r.stop_token_ids) > MAX_STOP_IDS:
        raise _bad("stop_token_ids", f"at most {MAX_STOP_IDS} ids")
    bad_stop = [t for t in r.stop_token_ids if t >= meta.vocab_size]
    if bad_stop:
        raise _bad("stop_token_ids", f"id {bad_stop[0]} is out of range [0, {meta.vocab_size})")
    for role in ("prefill", "decode"):
        if not registry.up(role):
            raise unavailable(f"no {role} worker is available")
    name = engine_name(r.engine)
    if name and registry.engines_known() and name not in registry.engines():
        offered = ", ".join(sorted(registry.engines())) or "none"
        raise _bad("engine", f"{name} is not offered by any decode worker (offered: {offered})")
    mode = common_pb2.EXACT if r.mode == common_pb2.EXACT else common_pb2.FAST
    try:
        sampling, stops = sampling_rules.plan(
            r.sampling, meta.tokenizer is not None, secrets.randbits(64), meta.vocab_size
        )
        sampling_rules.think_budget(sampling, ids, meta.tokenizer)  # into structured (the workers never see it)
    except ValueError as e:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    stop_ids, timeline = tuple(r.stop_token_ids), r.handoff_timeline
    engine = r.engine
    budget_alone = sampling.structured.WhichOneof("kind") == "any_text"  # (a thinking budget: the default engine)
    if sampling_rules.structured(sampling) and not budget_alone:  # masked per pick: fast steps, verify rows
        if r.ignore_eos:
            raise _bad("sampling.structured", "ends at EOS once the structure is complete: not with ignore_eos")
        if mode != common_pb2.EXACT and not engine and (not registry.engines_known() or "bf16" in registry.engines()):
            engine = common_pb2.BF16  # not a default mtp: its rounds add a host grammar mask a draft / verify row
    if r.sampling.min_tokens > n:
        raise _bad("sampling.min_tokens", f"{r.sampling.min_tokens} is more than max_new_tokens ({n})")
    try:  # EOS and the stop ids held back for the first min_tokens tokens
        sampling_rules.ban_until(sampling, len(ids), stop_ids + (() if r.ignore_eos else tuple(meta.eos_ids)))
    except ValueError as e:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    if len(r.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise _bad("cache_salt", f"{len(r.cache_salt.encode())} bytes: at most {MAX_CACHE_SALT_BYTES}")
    plp = r.prompt_logprobs if r.HasField("prompt_logprobs") else -1
    if plp > sampling_rules.MAX_LOGPROBS:
        raise _bad("prompt_logprobs", f"{plp} alternatives: at most {sampling_rules.MAX_LOGPROBS}")
    return Plan(
        request_id, ids, n, mode, engine, stop_ids, r.ignore_eos, k, sampling, stops, timeline, plp,
        equal_prompts=r.equal_prompts,
        skip_special=r.skip_special_tokens if r.HasField("skip_special_tokens") else True,
        include_stop=r.include_stop_str_in_output,
        cache_salt=r.cache_salt,
        priority=r.priority,
    )  # fmt: skip
