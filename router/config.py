"""The router's settings (RouterConfig) and what it knows of the model without loading weights (ModelMeta).
Both are made once by `python -m router` (router/__main__.py) and read by RouterServicer (router/service.py,
which re-exports them). Plan: one Generate request as RouterServicer validated it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from baton.names import engine_name
from baton.v1 import common_pb2

log = logging.getLogger("baton.router")
DEFAULT_QUEUE_S = 30.0  # --queue-timeout's default: a new request waits up to this long for a session slot


@dataclass(frozen=True)
class RouterConfig:
    max_inflight: int = 64  # Generate calls in flight; past it RESOURCE_EXHAUSTED
    queue_s: float = 0.0  # how long a new request waits in line for a session slot (router/slot_line.py); 0: none
    # (the servers' flags default to DEFAULT_QUEUE_S: `baton serve`, `python -m router`, deploy/launch.py)
    max_new_tokens_limit: int = 4096
    default_draft_block: int = 4  # K when a request sends draft_block = 0 (the adaptive prior)
    draft_length: str = "fixed"  # exact mode's K per round: "fixed" (the request's) | "adaptive" (per session)
    max_adaptive_k: int = 8  # the adaptive ceiling (or the request's K if larger; at most width - 2)
    width: int = 16  # W of the workers: draft_block in 1..W-2, W rows reserved
    max_context: int = 4096  # window used until workers report theirs (GetStats.max_len)
    call_timeout_s: float = 30.0  # cap on one unary downstream call (a hung worker)
    request_timeout_s: float = 600.0  # total when the client sets no deadline
    migrate_wait_s: float = 3.0  # how long a migration waits for a decode worker to come up
    max_migrations: int = 3
    # HTTP chat completions: "qwen3" splits the reasoning into reasoning_content (router/http/reasoning.py)
    reasoning_parser: str = "none"
    # the Responses API's stored responses (store: true), in MiB of JSON (router/http/response_store.py); 0: off
    responses_store_mb: int = 256


@dataclass(frozen=True)
class ModelMeta:
    """What the router knows of the model without loading weights."""

    model_id: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    tokenizer: object | None = None  # baton.tokenizer.Tokenizer; None = token_ids prompts only

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelMeta":
        from baton.config import ModelConfig
        from baton.tokenizer import Tokenizer, TokenizerError

        cfg = ModelConfig.from_hf(model_dir)
        try:
            tok = Tokenizer.from_dir(model_dir)
        except TokenizerError as e:
            log.warning("no tokenizer (%s): text prompts will be refused", e)
            tok = None
        return cls(Path(model_dir).name, cfg.vocab_size, tuple(cfg.eos_token_ids), tok)


@dataclass(frozen=True)
class Plan:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    mode: int  # common_pb2.FAST | EXACT
    engine: int  # common_pb2.Engine (0 = the decode worker's default)
    stop_ids: tuple[int, ...]
    ignore_eos: bool
    k: int  # draft block (exact mode)
    sampling: common_pb2.SamplingParams  # the workers' copy: seed resolved, no stop strings
    stops: tuple[str, ...] = ()  # stop strings, matched here on the text
    timeline: bool = False  # the first hand-off's marks into the last Stats (GenerateRequest.handoff_timeline)
    prompt_logprobs: int = -1  # >= 0: the first message carries the prompt's logprobs, with N alternatives
    equal_prompts: int = 0  # GenerateRequest.equal_prompts: its first Prefill announces them (a hint)
    skip_special: bool = True  # the text leaves special tokens out (GenerateRequest.skip_special_tokens)
    include_stop: bool = False  # a stop string ending the output is in its text (include_stop_str_in_output)
    cache_salt: str = ""  # GenerateRequest.cache_salt: its Prefills' prefix-cache salt
    priority: int = 0  # GenerateRequest.priority: its place in the slot line (router/slot_line.py), lower first

    @property
    def engine_name(self) -> str | None:
        return engine_name(self.engine)
