from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDType]
    KV_DTYPE_INT8: _ClassVar[KVDType]
    KV_DTYPE_FLOAT32: _ClassVar[KVDType]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDType]
    KV_DTYPE_FLOAT16: _ClassVar[KVDType]
    KV_DTYPE_FP8_E4M3: _ClassVar[KVDType]
KV_DTYPE_UNSPECIFIED: KVDType
KV_DTYPE_INT8: KVDType
KV_DTYPE_FLOAT32: KVDType
KV_DTYPE_BFLOAT16: KVDType
KV_DTYPE_FLOAT16: KVDType
KV_DTYPE_FP8_E4M3: KVDType

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

class KVBatchHeader(_message.Message):
    __slots__ = ("request_id", "model_fingerprint", "layout", "first_seq_no", "page_indexes", "num_tokens", "nbytes", "has_checksum", "checksum", "layer_start", "layer_count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEXES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    HAS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_fingerprint: str
    layout: KVLayout
    first_seq_no: int
    page_indexes: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    has_checksum: bool
    checksum: int
    layer_start: int
    layer_count: int
    def __init__(self, request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., first_seq_no: _Optional[int] = ..., page_indexes: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., has_checksum: _Optional[bool] = ..., checksum: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_count: _Optional[int] = ...) -> None: ...

class KVPageBatch(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: KVBatchHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[KVBatchHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class KVIpcBatch(_message.Message):
    __slots__ = ("header", "offset", "buffer_id")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    header: KVBatchHeader
    offset: int
    buffer_id: str
    def __init__(self, header: _Optional[_Union[KVBatchHeader, _Mapping]] = ..., offset: _Optional[int] = ..., buffer_id: _Optional[str] = ...) -> None: ...

class KVShardLayout(_message.Message):
    __slots__ = ("tensor_parallel_size", "kv_heads_per_rank")
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel_size: int
    kv_heads_per_rank: int
    def __init__(self, tensor_parallel_size: _Optional[int] = ..., kv_heads_per_rank: _Optional[int] = ...) -> None: ...

class KVTransportOffer(_message.Message):
    __slots__ = ("transports", "host_id", "device_kind", "gpu_uuid", "device_index", "forced", "shards", "shipper_address", "transfer_key", "more_shipper_addresses")
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHIPPER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    MORE_SHIPPER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    device_kind: str
    gpu_uuid: str
    device_index: int
    forced: bool
    shards: KVShardLayout
    shipper_address: str
    transfer_key: bytes
    more_shipper_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., device_kind: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., forced: _Optional[bool] = ..., shards: _Optional[_Union[KVShardLayout, _Mapping]] = ..., shipper_address: _Optional[str] = ..., transfer_key: _Optional[bytes] = ..., more_shipper_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class KVIpcBuffer(_message.Message):
    __slots__ = ("buffer_id", "kind", "nbytes", "device_index", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "path")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    kind: str
    nbytes: int
    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    path: str
    def __init__(self, buffer_id: _Optional[str] = ..., kind: _Optional[str] = ..., nbytes: _Optional[int] = ..., device_index: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., path: _Optional[str] = ...) -> None: ...

class KVTransportChoice(_message.Message):
    __slots__ = ("transport", "reason", "ipc_buffer", "shards")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    IPC_BUFFER_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    reason: str
    ipc_buffer: KVIpcBuffer
    shards: KVShardLayout
    def __init__(self, transport: _Optional[str] = ..., reason: _Optional[str] = ..., ipc_buffer: _Optional[_Union[KVIpcBuffer, _Mapping]] = ..., shards: _Optional[_Union[KVShardLayout, _Mapping]] = ...) -> None: ...

class KVTransportReady(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class KVShippedBatch(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: KVBatchHeader
    def __init__(self, header: _Optional[_Union[KVBatchHeader, _Mapping]] = ...) -> None: ...

class KVShipment(_message.Message):
    __slots__ = ("transfer_key", "seq_no", "payload")
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    transfer_key: bytes
    seq_no: int
    payload: bytes
    def __init__(self, transfer_key: _Optional[bytes] = ..., seq_no: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class KVShipReceipt(_message.Message):
    __slots__ = ("shipments",)
    SHIPMENTS_FIELD_NUMBER: _ClassVar[int]
    shipments: int
    def __init__(self, shipments: _Optional[int] = ...) -> None: ...

class ShipperCommand(_message.Message):
    __slots__ = ("push", "release")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    push: ShipOut
    release: ArenaRegion
    def __init__(self, push: _Optional[_Union[ShipOut, _Mapping]] = ..., release: _Optional[_Union[ArenaRegion, _Mapping]] = ...) -> None: ...

class ShipperEvent(_message.Message):
    __slots__ = ("arrived", "failed", "ready")
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    arrived: ShipIn
    failed: ShipFailed
    ready: ShipperReady
    def __init__(self, arrived: _Optional[_Union[ShipIn, _Mapping]] = ..., failed: _Optional[_Union[ShipFailed, _Mapping]] = ..., ready: _Optional[_Union[ShipperReady, _Mapping]] = ...) -> None: ...

class ShipOut(_message.Message):
    __slots__ = ("address", "transfer_key", "seq_no", "offset", "nbytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    address: str
    transfer_key: bytes
    seq_no: int
    offset: int
    nbytes: int
    def __init__(self, address: _Optional[str] = ..., transfer_key: _Optional[bytes] = ..., seq_no: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ShipIn(_message.Message):
    __slots__ = ("transfer_key", "seq_no", "offset", "nbytes")
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_key: bytes
    seq_no: int
    offset: int
    nbytes: int
    def __init__(self, transfer_key: _Optional[bytes] = ..., seq_no: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ArenaRegion(_message.Message):
    __slots__ = ("offset", "nbytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ShipFailed(_message.Message):
    __slots__ = ("transfer_key", "reason")
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_key: bytes
    reason: str
    def __init__(self, transfer_key: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class ShipperReady(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class KVTransportStats(_message.Message):
    __slots__ = ("transport", "requests", "pages", "bytes", "transfer_seconds", "fallbacks", "batches")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    requests: int
    pages: int
    bytes: int
    transfer_seconds: float
    fallbacks: int
    batches: int
    def __init__(self, transport: _Optional[str] = ..., requests: _Optional[int] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., fallbacks: _Optional[int] = ..., batches: _Optional[int] = ...) -> None: ...
