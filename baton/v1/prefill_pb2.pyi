from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "mode", "decode_target", "engine", "timeline", "sampling", "generated_tokens", "heartbeat_ms", "prompt_logprobs", "draft_only", "equal_prompts", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGET_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ONLY_FIELD_NUMBER: _ClassVar[int]
    EQUAL_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    mode: _common_pb2.Mode
    decode_target: str
    engine: _common_pb2.Engine
    timeline: bool
    sampling: _common_pb2.SamplingParams
    generated_tokens: int
    heartbeat_ms: int
    prompt_logprobs: int
    draft_only: bool
    equal_prompts: int
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., mode: _Optional[_Union[_common_pb2.Mode, str]] = ..., decode_target: _Optional[str] = ..., engine: _Optional[_Union[_common_pb2.Engine, str]] = ..., timeline: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., generated_tokens: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., draft_only: _Optional[bool] = ..., equal_prompts: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "bridge", "prompt_tokens", "prefill_seconds", "first_logprob", "heartbeat", "prompt_logprobs", "cached_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BRIDGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    bridge: _common_pb2.BridgeReport
    prompt_tokens: int
    prefill_seconds: float
    first_logprob: _common_pb2.TokenLogprob
    heartbeat: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    cached_tokens: int
    def __init__(self, first_token: _Optional[int] = ..., bridge: _Optional[_Union[_common_pb2.BridgeReport, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., heartbeat: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "draft_probs", "want_hidden", "round")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    WANT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    want_hidden: bool
    round: _common_pb2.RoundTag
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ..., want_hidden: _Optional[bool] = ..., round: _Optional[_Union[_common_pb2.RoundTag, _Mapping]] = ...) -> None: ...

class SessionCounters(_message.Message):
    __slots__ = ("drafted", "accepted", "rejected_blocks", "verify_blocks", "acceptance_rate")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    drafted: int
    accepted: int
    rejected_blocks: int
    verify_blocks: int
    acceptance_rate: float
    def __init__(self, drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected_blocks: _Optional[int] = ..., verify_blocks: _Optional[int] = ..., acceptance_rate: _Optional[float] = ...) -> None: ...

class VerifyManyRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyManyResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[VerifyOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[VerifyOutcome, _Mapping]]] = ...) -> None: ...

class VerifyOutcome(_message.Message):
    __slots__ = ("status", "response")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.ItemStatus
    response: VerifyResponse
    def __init__(self, status: _Optional[_Union[_common_pb2.ItemStatus, _Mapping]] = ..., response: _Optional[_Union[VerifyResponse, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "next_token", "position", "counters", "logprobs", "hidden")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    position: int
    counters: SessionCounters
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    hidden: _common_pb2.HiddenRows
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., position: _Optional[int] = ..., counters: _Optional[_Union[SessionCounters, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., hidden: _Optional[_Union[_common_pb2.HiddenRows, _Mapping]] = ...) -> None: ...

class ExportStateRequest(_message.Message):
    __slots__ = ("session_id", "decode_target", "target_session_id", "draft_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    decode_target: str
    target_session_id: str
    draft_only: bool
    def __init__(self, session_id: _Optional[str] = ..., decode_target: _Optional[str] = ..., target_session_id: _Optional[str] = ..., draft_only: _Optional[bool] = ...) -> None: ...

class ExportStateResponse(_message.Message):
    __slots__ = ("bridge", "position", "next_token")
    BRIDGE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    bridge: _common_pb2.BridgeReport
    position: int
    next_token: int
    def __init__(self, bridge: _Optional[_Union[_common_pb2.BridgeReport, _Mapping]] = ..., position: _Optional[int] = ..., next_token: _Optional[int] = ...) -> None: ...
