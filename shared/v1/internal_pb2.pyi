from pdserve.v1 import generate_pb2 as _generate_pb2
from pdserve.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_layout", "model_fingerprint", "sampled_before", "cache_scope", "first_token_early", "kv_layer_groups", "kv_transport", "start_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_EARLY_FIELD_NUMBER: _ClassVar[int]
    KV_LAYER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    START_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    kv_layout: _kv_pb2.KVLayout
    model_fingerprint: str
    sampled_before: int
    cache_scope: str
    first_token_early: bool
    kv_layer_groups: bool
    kv_transport: _kv_pb2.KVTransportOffer
    start_key: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., kv_layout: _Optional[_Union[_kv_pb2.KVLayout, _Mapping]] = ..., model_fingerprint: _Optional[str] = ..., sampled_before: _Optional[int] = ..., cache_scope: _Optional[str] = ..., first_token_early: _Optional[bool] = ..., kv_layer_groups: _Optional[bool] = ..., kv_transport: _Optional[_Union[_kv_pb2.KVTransportOffer, _Mapping]] = ..., start_key: _Optional[bytes] = ...) -> None: ...

class PrefillStart(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_scope", "start_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    START_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    cache_scope: str
    start_key: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., cache_scope: _Optional[str] = ..., start_key: _Optional[bytes] = ...) -> None: ...

class PrefillStarted(_message.Message):
    __slots__ = ("started", "reason")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    started: bool
    reason: str
    def __init__(self, started: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class KVAck(_message.Message):
    __slots__ = ("seq_no",)
    SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    seq_no: int
    def __init__(self, seq_no: _Optional[int] = ...) -> None: ...

class PrefillClientMessage(_message.Message):
    __slots__ = ("request", "ack", "transport_ready")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_READY_FIELD_NUMBER: _ClassVar[int]
    request: PrefillRequest
    ack: KVAck
    transport_ready: _kv_pb2.KVTransportReady
    def __init__(self, request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., ack: _Optional[_Union[KVAck, _Mapping]] = ..., transport_ready: _Optional[_Union[_kv_pb2.KVTransportReady, _Mapping]] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token_id", "num_pages", "cached_tokens", "prefill_ms", "first_token_logprob", "prompt_logprobs", "prompt_top_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    num_pages: int
    cached_tokens: int
    prefill_ms: float
    first_token_logprob: _generate_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TopLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., num_pages: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., first_token_logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class PrefillFirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "cached_tokens")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _generate_pb2.TokenLogprob
    cached_tokens: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillServerMessage(_message.Message):
    __slots__ = ("done", "batch", "ipc_batch", "transport", "first_token", "shipped_batch")
    DONE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    IPC_BATCH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHIPPED_BATCH_FIELD_NUMBER: _ClassVar[int]
    done: PrefillDone
    batch: _kv_pb2.KVPageBatch
    ipc_batch: _kv_pb2.KVIpcBatch
    transport: _kv_pb2.KVTransportChoice
    first_token: PrefillFirstToken
    shipped_batch: _kv_pb2.KVShippedBatch
    def __init__(self, done: _Optional[_Union[PrefillDone, _Mapping]] = ..., batch: _Optional[_Union[_kv_pb2.KVPageBatch, _Mapping]] = ..., ipc_batch: _Optional[_Union[_kv_pb2.KVIpcBatch, _Mapping]] = ..., transport: _Optional[_Union[_kv_pb2.KVTransportChoice, _Mapping]] = ..., first_token: _Optional[_Union[PrefillFirstToken, _Mapping]] = ..., shipped_batch: _Optional[_Union[_kv_pb2.KVShippedBatch, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_target", "resumed_tokens", "resumed_text_chars", "cache_scope", "n", "best_of", "prefill_start_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TARGET_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    PREFILL_START_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    prefill_target: str
    resumed_tokens: int
    resumed_text_chars: int
    cache_scope: str
    n: int
    best_of: int
    prefill_start_key: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., prefill_target: _Optional[str] = ..., resumed_tokens: _Optional[int] = ..., resumed_text_chars: _Optional[int] = ..., cache_scope: _Optional[str] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., prefill_start_key: _Optional[bytes] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stop_reason", "usage", "logprobs", "prompt_logprobs", "prompt_top_logprobs", "index", "unreturned_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UNRETURNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _generate_pb2.FinishReason
    stop_reason: str
    usage: _generate_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TopLogprobs]
    index: int
    unreturned_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[_generate_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TopLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., unreturned_tokens: _Optional[int] = ...) -> None: ...

class InstanceStats(_message.Message):
    __slots__ = ("kv_pages_total", "kv_pages_free", "active_requests", "model_fingerprint", "kv_dtype", "page_size", "prefill_tokens_per_s", "tensor_parallel_size", "kv_transports")
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    kv_pages_total: int
    kv_pages_free: int
    active_requests: int
    model_fingerprint: str
    kv_dtype: str
    page_size: int
    prefill_tokens_per_s: float
    tensor_parallel_size: int
    kv_transports: _containers.RepeatedCompositeFieldContainer[_kv_pb2.KVTransportStats]
    def __init__(self, kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., active_requests: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., tensor_parallel_size: _Optional[int] = ..., kv_transports: _Optional[_Iterable[_Union[_kv_pb2.KVTransportStats, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
