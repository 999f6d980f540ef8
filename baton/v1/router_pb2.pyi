from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "max_new_tokens", "mode", "engine", "stop_token_ids", "ignore_eos", "draft_block", "sampling", "handoff_timeline", "prompt_logprobs", "equal_prompts", "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TIMELINE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EQUAL_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    max_new_tokens: int
    mode: _common_pb2.Mode
    engine: _common_pb2.Engine
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    draft_block: int
    sampling: _common_pb2.SamplingParams
    handoff_timeline: bool
    prompt_logprobs: int
    equal_prompts: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    cache_salt: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.Mode, str]] = ..., engine: _Optional[_Union[_common_pb2.Engine, str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., draft_block: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., handoff_timeline: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., equal_prompts: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("ttft_ms", "bridge_bytes", "drafted", "accepted", "acceptance_rate", "migrations", "bridge_seconds", "decode_tokens_per_s", "request_id", "seed", "handoff_ms", "first_decode_ms", "handoff_timeline", "rounds", "draft_ms", "verify_ms", "handoffs", "draft_only_handoffs", "mean_accept_len")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    BRIDGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    BRIDGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TIMELINE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ONLY_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    bridge_bytes: int
    drafted: int
    accepted: int
    acceptance_rate: float
    migrations: int
    bridge_seconds: float
    decode_tokens_per_s: float
    request_id: str
    seed: int
    handoff_ms: float
    first_decode_ms: float
    handoff_timeline: _common_pb2.HandoffTimeline
    rounds: int
    draft_ms: float
    verify_ms: float
    handoffs: int
    draft_only_handoffs: int
    mean_accept_len: float
    def __init__(self, ttft_ms: _Optional[float] = ..., bridge_bytes: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., migrations: _Optional[int] = ..., bridge_seconds: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., request_id: _Optional[str] = ..., seed: _Optional[int] = ..., handoff_ms: _Optional[float] = ..., first_decode_ms: _Optional[float] = ..., handoff_timeline: _Optional[_Union[_common_pb2.HandoffTimeline, _Mapping]] = ..., rounds: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., handoffs: _Optional[int] = ..., draft_only_handoffs: _Optional[int] = ..., mean_accept_len: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "stats", "logprobs", "prompt_logprobs", "stop_string")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    stats: Stats
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    stop_string: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., stop_string: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "fingerprint", "max_context", "engines", "vocab_size", "eos_token_ids", "max_new_tokens_limit", "default_draft_block", "max_draft_block")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFT_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_BLOCK_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    fingerprint: str
    max_context: int
    engines: _containers.RepeatedScalarFieldContainer[_common_pb2.Engine]
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens_limit: int
    default_draft_block: int
    max_draft_block: int
    def __init__(self, model_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[_common_pb2.Engine, str]]] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens_limit: _Optional[int] = ..., default_draft_block: _Optional[int] = ..., max_draft_block: _Optional[int] = ...) -> None: ...
