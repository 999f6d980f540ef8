from . import common_pb2 as _common_pb2
from . import state_pb2 as _state_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadStateResponse(_message.Message):
    __slots__ = ("session_id", "position", "bridge")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    BRIDGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    bridge: _common_pb2.BridgeReport
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., bridge: _Optional[_Union[_common_pb2.BridgeReport, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "max_new_tokens", "stop_token_ids", "ignore_eos", "engine", "release_at_end", "sampling", "history")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_AT_END_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    engine: _common_pb2.Engine
    release_at_end: bool
    sampling: _common_pb2.SamplingParams
    history: _common_pb2.PenaltyHistory
    def __init__(self, session_id: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., engine: _Optional[_Union[_common_pb2.Engine, str]] = ..., release_at_end: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., history: _Optional[_Union[_common_pb2.PenaltyHistory, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "mean_accept_len", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    mean_accept_len: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., mean_accept_len: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "k", "has_verdict", "accepted", "next_token", "engine", "sampling", "history", "verdict_hidden")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    HAS_VERDICT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    VERDICT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    k: int
    has_verdict: bool
    accepted: int
    next_token: int
    engine: _common_pb2.Engine
    sampling: _common_pb2.SamplingParams
    history: _common_pb2.PenaltyHistory
    verdict_hidden: _common_pb2.HiddenRows
    def __init__(self, session_id: _Optional[str] = ..., k: _Optional[int] = ..., has_verdict: _Optional[bool] = ..., accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., engine: _Optional[_Union[_common_pb2.Engine, str]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., history: _Optional[_Union[_common_pb2.PenaltyHistory, _Mapping]] = ..., verdict_hidden: _Optional[_Union[_common_pb2.HiddenRows, _Mapping]] = ...) -> None: ...

class DraftManyRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[DraftRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[DraftRequest, _Mapping]]] = ...) -> None: ...

class DraftManyResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[DraftOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[DraftOutcome, _Mapping]]] = ...) -> None: ...

class DraftOutcome(_message.Message):
    __slots__ = ("status", "response")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.ItemStatus
    response: DraftResponse
    def __init__(self, status: _Optional[_Union[_common_pb2.ItemStatus, _Mapping]] = ..., response: _Optional[_Union[DraftResponse, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("draft_tokens", "position", "draft_probs", "round")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    position: int
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    round: _common_pb2.RoundTag
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., position: _Optional[int] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ..., round: _Optional[_Union[_common_pb2.RoundTag, _Mapping]] = ...) -> None: ...
