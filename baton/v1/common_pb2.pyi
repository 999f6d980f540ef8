from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    FAST: _ClassVar[Mode]
    EXACT: _ClassVar[Mode]

class Engine(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_UNSPECIFIED: _ClassVar[Engine]
    BF16: _ClassVar[Engine]
    FP8: _ClassVar[Engine]
    MTP: _ClassVar[Engine]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    EOS: _ClassVar[FinishReason]

class ExactPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXACT_POLICY_UNSPECIFIED: _ClassVar[ExactPolicy]
    COUPLING: _ClassVar[ExactPolicy]
    REJECTION: _ClassVar[ExactPolicy]
MODE_UNSPECIFIED: Mode
FAST: Mode
EXACT: Mode
ENGINE_UNSPECIFIED: Engine
BF16: Engine
FP8: Engine
MTP: Engine
FINISH_REASON_UNSPECIFIED: FinishReason
LENGTH: FinishReason
STOP: FinishReason
EOS: FinishReason
EXACT_POLICY_UNSPECIFIED: ExactPolicy
COUPLING: ExactPolicy
REJECTION: ExactPolicy

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "stop", "exact_policy", "logit_bias", "min_tokens", "min_tokens_end", "min_tokens_ids", "structured", "thinking_budget")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    EXACT_POLICY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_END_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    THINKING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    exact_policy: ExactPolicy
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    min_tokens_end: int
    min_tokens_ids: _containers.RepeatedScalarFieldContainer[int]
    structured: StructuredOutput
    thinking_budget: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., exact_policy: _Optional[_Union[ExactPolicy, str]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., min_tokens_end: _Optional[int] = ..., min_tokens_ids: _Optional[_Iterable[int]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., thinking_budget: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag", "any_text", "compact_whitespace", "after_token", "after_budget")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    ANY_TEXT_FIELD_NUMBER: _ClassVar[int]
    COMPACT_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    AFTER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    structural_tag: str
    any_text: bool
    compact_whitespace: bool
    after_token: int
    after_budget: int
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., structural_tag: _Optional[str] = ..., any_text: _Optional[bool] = ..., compact_whitespace: _Optional[bool] = ..., after_token: _Optional[int] = ..., after_budget: _Optional[int] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class PenaltyHistory(_message.Message):
    __slots__ = ("token_ids", "generated_from")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FROM_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_from: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., generated_from: _Optional[int] = ...) -> None: ...

class TokenDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class HiddenRows(_message.Message):
    __slots__ = ("rows", "width", "dtype", "data")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rows: int
    width: int
    dtype: str
    data: bytes
    def __init__(self, rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ItemStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RoundTag(_message.Message):
    __slots__ = ("id", "size")
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    id: int
    size: int
    def __init__(self, id: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class WorkerStatsRequest(_message.Message):
    __slots__ = ("reset_steps",)
    RESET_STEPS_FIELD_NUMBER: _ClassVar[int]
    reset_steps: bool
    def __init__(self, reset_steps: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("sessions", "session_bytes", "outstanding", "engine", "model_fingerprint", "max_len", "requests_total", "steps", "step_rows", "max_step_rows", "step_s_p50", "step_s_p99", "gathered_batches", "gathered_items", "prefill_passes", "prefill_pieces", "prefill_tokens", "prefill_pass_s", "step_interval_s_p50", "step_interval_s_p99", "step_device_s_p50", "step_device_s_p99", "stall_s_p99", "stall_s_max", "stall_share", "step_phase_s", "step_phase_window_s", "step_held_rows", "thread_cpu_s", "engines", "slots", "kv_pools", "kv_pages", "kv_pages_free", "kv_page_tokens", "gathered_s", "gathered_gave_way", "draft_only_states", "batched_rpcs", "batched_items", "mtp_rounds_by_k", "mtp_round_s_by_k", "prefix_cache_entries", "prefix_cache_pages", "prefix_cache_hits", "prefix_cache_tokens", "prefix_cache_evicted", "prefix_cache_reclaimed", "first_tokens_s_p50", "first_tokens_s_p99", "decode_called_s_p50", "decode_called_s_p99", "decode_first_message_s_p50", "decode_first_message_s_p99", "mtp_spec_rounds", "prefill_piece", "decode_setup_s_p50", "decode_setup_s_p99")
    class StepPhaseSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ThreadCpuSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class GatheredSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MtpRoundsByKEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class MtpRoundSByKEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_P50_FIELD_NUMBER: _ClassVar[int]
    STEP_S_P99_FIELD_NUMBER: _ClassVar[int]
    GATHERED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    GATHERED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PASSES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PIECES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PASS_S_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_S_P50_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_S_P99_FIELD_NUMBER: _ClassVar[int]
    STEP_DEVICE_S_P50_FIELD_NUMBER: _ClassVar[int]
    STEP_DEVICE_S_P99_FIELD_NUMBER: _ClassVar[int]
    STALL_S_P99_FIELD_NUMBER: _ClassVar[int]
    STALL_S_MAX_FIELD_NUMBER: _ClassVar[int]
    STALL_SHARE_FIELD_NUMBER: _ClassVar[int]
    STEP_PHASE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_PHASE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    STEP_HELD_ROWS_FIELD_NUMBER: _ClassVar[int]
    THREAD_CPU_S_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_POOLS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GATHERED_S_FIELD_NUMBER: _ClassVar[int]
    GATHERED_GAVE_WAY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ONLY_STATES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_RPCS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MTP_ROUNDS_BY_K_FIELD_NUMBER: _ClassVar[int]
    MTP_ROUND_S_BY_K_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_S_P50_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_S_P99_FIELD_NUMBER: _ClassVar[int]
    DECODE_CALLED_S_P50_FIELD_NUMBER: _ClassVar[int]
    DECODE_CALLED_S_P99_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIRST_MESSAGE_S_P50_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIRST_MESSAGE_S_P99_FIELD_NUMBER: _ClassVar[int]
    MTP_SPEC_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PIECE_FIELD_NUMBER: _ClassVar[int]
    DECODE_SETUP_S_P50_FIELD_NUMBER: _ClassVar[int]
    DECODE_SETUP_S_P99_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    session_bytes: int
    outstanding: int
    engine: str
    model_fingerprint: str
    max_len: int
    requests_total: int
    steps: int
    step_rows: int
    max_step_rows: int
    step_s_p50: float
    step_s_p99: float
    gathered_batches: int
    gathered_items: int
    prefill_passes: int
    prefill_pieces: int
    prefill_tokens: int
    prefill_pass_s: float
    step_interval_s_p50: float
    step_interval_s_p99: float
    step_device_s_p50: float
    step_device_s_p99: float
    stall_s_p99: float
    stall_s_max: float
    stall_share: float
    step_phase_s: _containers.ScalarMap[str, float]
    step_phase_window_s: float
    step_held_rows: int
    thread_cpu_s: _containers.ScalarMap[str, float]
    engines: _containers.RepeatedScalarFieldContainer[str]
    slots: int
    kv_pools: int
    kv_pages: int
    kv_pages_free: int
    kv_page_tokens: int
    gathered_s: _containers.ScalarMap[str, float]
    gathered_gave_way: int
    draft_only_states: bool
    batched_rpcs: int
    batched_items: int
    mtp_rounds_by_k: _containers.ScalarMap[int, int]
    mtp_round_s_by_k: _containers.ScalarMap[int, float]
    prefix_cache_entries: int
    prefix_cache_pages: int
    prefix_cache_hits: int
    prefix_cache_tokens: int
    prefix_cache_evicted: int
    prefix_cache_reclaimed: int
    first_tokens_s_p50: float
    first_tokens_s_p99: float
    decode_called_s_p50: float
    decode_called_s_p99: float
    decode_first_message_s_p50: float
    decode_first_message_s_p99: float
    mtp_spec_rounds: _containers.RepeatedCompositeFieldContainer[MtpRound]
    prefill_piece: int
    decode_setup_s_p50: float
    decode_setup_s_p99: float
    def __init__(self, sessions: _Optional[int] = ..., session_bytes: _Optional[int] = ..., outstanding: _Optional[int] = ..., engine: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., max_len: _Optional[int] = ..., requests_total: _Optional[int] = ..., steps: _Optional[int] = ..., step_rows: _Optional[int] = ..., max_step_rows: _Optional[int] = ..., step_s_p50: _Optional[float] = ..., step_s_p99: _Optional[float] = ..., gathered_batches: _Optional[int] = ..., gathered_items: _Optional[int] = ..., prefill_passes: _Optional[int] = ..., prefill_pieces: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., prefill_pass_s: _Optional[float] = ..., step_interval_s_p50: _Optional[float] = ..., step_interval_s_p99: _Optional[float] = ..., step_device_s_p50: _Optional[float] = ..., step_device_s_p99: _Optional[float] = ..., stall_s_p99: _Optional[float] = ..., stall_s_max: _Optional[float] = ..., stall_share: _Optional[float] = ..., step_phase_s: _Optional[_Mapping[str, float]] = ..., step_phase_window_s: _Optional[float] = ..., step_held_rows: _Optional[int] = ..., thread_cpu_s: _Optional[_Mapping[str, float]] = ..., engines: _Optional[_Iterable[str]] = ..., slots: _Optional[int] = ..., kv_pools: _Optional[int] = ..., kv_pages: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., kv_page_tokens: _Optional[int] = ..., gathered_s: _Optional[_Mapping[str, float]] = ..., gathered_gave_way: _Optional[int] = ..., draft_only_states: _Optional[bool] = ..., batched_rpcs: _Optional[int] = ..., batched_items: _Optional[int] = ..., mtp_rounds_by_k: _Optional[_Mapping[int, int]] = ..., mtp_round_s_by_k: _Optional[_Mapping[int, float]] = ..., prefix_cache_entries: _Optional[int] = ..., prefix_cache_pages: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_tokens: _Optional[int] = ..., prefix_cache_evicted: _Optional[int] = ..., prefix_cache_reclaimed: _Optional[int] = ..., first_tokens_s_p50: _Optional[float] = ..., first_tokens_s_p99: _Optional[float] = ..., decode_called_s_p50: _Optional[float] = ..., decode_called_s_p99: _Optional[float] = ..., decode_first_message_s_p50: _Optional[float] = ..., decode_first_message_s_p99: _Optional[float] = ..., mtp_spec_rounds: _Optional[_Iterable[_Union[MtpRound, _Mapping]]] = ..., prefill_piece: _Optional[int] = ..., decode_setup_s_p50: _Optional[float] = ..., decode_setup_s_p99: _Optional[float] = ...) -> None: ...

class MtpRound(_message.Message):
    __slots__ = ("round", "k", "batch", "seconds", "probe")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    round: int
    k: int
    batch: int
    seconds: float
    probe: bool
    def __init__(self, round: _Optional[int] = ..., k: _Optional[int] = ..., batch: _Optional[int] = ..., seconds: _Optional[float] = ..., probe: _Optional[bool] = ...) -> None: ...

class BridgeReport(_message.Message):
    __slots__ = ("seconds", "total_bytes", "bytes_by_kind", "tokens", "chunks", "timeline", "draft_only")
    class BytesByKindEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_BY_KIND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ONLY_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    total_bytes: int
    bytes_by_kind: _containers.ScalarMap[str, int]
    tokens: int
    chunks: int
    timeline: HandoffTimeline
    draft_only: bool
    def __init__(self, seconds: _Optional[float] = ..., total_bytes: _Optional[int] = ..., bytes_by_kind: _Optional[_Mapping[str, int]] = ..., tokens: _Optional[int] = ..., chunks: _Optional[int] = ..., timeline: _Optional[_Union[HandoffTimeline, _Mapping]] = ..., draft_only: _Optional[bool] = ...) -> None: ...

class HandoffTimeline(_message.Message):
    __slots__ = ("marks_ns", "clocks", "series_ns")
    class MarksNsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ClocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class SeriesNsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: MarkSeries
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[MarkSeries, _Mapping]] = ...) -> None: ...
    MARKS_NS_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    SERIES_NS_FIELD_NUMBER: _ClassVar[int]
    marks_ns: _containers.ScalarMap[str, int]
    clocks: _containers.ScalarMap[str, str]
    series_ns: _containers.MessageMap[str, MarkSeries]
    def __init__(self, marks_ns: _Optional[_Mapping[str, int]] = ..., clocks: _Optional[_Mapping[str, str]] = ..., series_ns: _Optional[_Mapping[str, MarkSeries]] = ...) -> None: ...

class MarkSeries(_message.Message):
    __slots__ = ("ns",)
    NS_FIELD_NUMBER: _ClassVar[int]
    ns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ns: _Optional[_Iterable[int]] = ...) -> None: ...
