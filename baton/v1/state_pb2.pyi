from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_KIND_UNSPECIFIED: _ClassVar[TensorKind]
    GDN_CONV: _ClassVar[TensorKind]
    GDN_RECURRENT: _ClassVar[TensorKind]
    ATTN_KEY: _ClassVar[TensorKind]
    ATTN_VALUE: _ClassVar[TensorKind]
    HIDDEN: _ClassVar[TensorKind]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
TENSOR_KIND_UNSPECIFIED: TensorKind
GDN_CONV: TensorKind
GDN_RECURRENT: TensorKind
ATTN_KEY: TensorKind
ATTN_VALUE: TensorKind
HIDDEN: TensorKind
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType

class TensorSpec(_message.Message):
    __slots__ = ("name", "kind", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: TensorKind
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[TensorKind, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("format_version", "session_id", "model_fingerprint", "position", "tensors", "total_bytes", "mode", "engine", "chunk_bytes", "tail_from", "tail_chunk_bytes", "draft_only")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAIL_FROM_FIELD_NUMBER: _ClassVar[int]
    TAIL_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ONLY_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    session_id: str
    model_fingerprint: str
    position: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    mode: _common_pb2.Mode
    engine: _common_pb2.Engine
    chunk_bytes: int
    tail_from: int
    tail_chunk_bytes: int
    draft_only: bool
    def __init__(self, format_version: _Optional[int] = ..., session_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., position: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.Mode, str]] = ..., engine: _Optional[_Union[_common_pb2.Engine, str]] = ..., chunk_bytes: _Optional[int] = ..., tail_from: _Optional[int] = ..., tail_chunk_bytes: _Optional[int] = ..., draft_only: _Optional[bool] = ...) -> None: ...

class StateTrailer(_message.Message):
    __slots__ = ("total_bytes", "data_chunks", "manifest_sha256", "next_token")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    data_chunks: int
    manifest_sha256: bytes
    next_token: int
    def __init__(self, total_bytes: _Optional[int] = ..., data_chunks: _Optional[int] = ..., manifest_sha256: _Optional[bytes] = ..., next_token: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("header", "data", "trailer", "chunk_index", "chunk_sha256")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHA256_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    data: bytes
    trailer: StateTrailer
    chunk_index: int
    chunk_sha256: bytes
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[StateTrailer, _Mapping]] = ..., chunk_index: _Optional[int] = ..., chunk_sha256: _Optional[bytes] = ...) -> None: ...
