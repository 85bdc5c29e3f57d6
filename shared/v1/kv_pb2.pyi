from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDType]
    KV_DTYPE_INT8: _ClassVar[KVDType]
    KV_DTYPE_FLOAT32: _ClassVar[KVDType]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDType]
    KV_DTYPE_FLOAT16: _ClassVar[KVDType]
KV_DTYPE_UNSPECIFIED: KVDType
KV_DTYPE_INT8: KVDType
KV_DTYPE_FLOAT32: KVDType
KV_DTYPE_BFLOAT16: KVDType
KV_DTYPE_FLOAT16: KVDType

class KVLayout(_message.Message):
    __slots__ = ("format_version", "dtype", "page_size", "num_layers", "num_kv_heads", "head_dim", "group_size", "asymmetric")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ASYMMETRIC_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    dtype: KVDType
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    asymmetric: bool
    def __init__(self, format_version: _Optional[int] = ..., dtype: _Optional[_Union[KVDType, str]] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., group_size: _Optional[int] = ..., asymmetric: _Optional[bool] = ...) -> None: ...

class KVPage(_message.Message):
    __slots__ = ("request_id", "seq_no", "page_index", "layer_start", "layer_count", "num_tokens", "layout", "model_fingerprint", "data", "scales", "zero_points", "checksum")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    ZERO_POINTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_no: int
    page_index: int
    layer_start: int
    layer_count: int
    num_tokens: int
    layout: KVLayout
    model_fingerprint: str
    data: bytes
    scales: bytes
    zero_points: bytes
    checksum: int
    def __init__(self, request_id: _Optional[str] = ..., seq_no: _Optional[int] = ..., page_index: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_count: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., model_fingerprint: _Optional[str] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., zero_points: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...
