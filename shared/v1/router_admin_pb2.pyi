from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_ROLE_UNSPECIFIED: _ClassVar[InstanceRole]
    INSTANCE_ROLE_PREFILL: _ClassVar[InstanceRole]
    INSTANCE_ROLE_DECODE: _ClassVar[InstanceRole]
    INSTANCE_ROLE_COLOCATED: _ClassVar[InstanceRole]
INSTANCE_ROLE_UNSPECIFIED: InstanceRole
INSTANCE_ROLE_PREFILL: InstanceRole
INSTANCE_ROLE_DECODE: InstanceRole
INSTANCE_ROLE_COLOCATED: InstanceRole

class RegisterRequest(_message.Message):
    __slots__ = ("role", "address", "capacity_pcs", "model_name", "model_path")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PCS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    role: InstanceRole
    address: str
    capacity_pcs: float
    model_name: str
    model_path: str
    def __init__(self, role: _Optional[_Union[InstanceRole, str]] = ..., address: _Optional[str] = ..., capacity_pcs: _Optional[float] = ..., model_name: _Optional[str] = ..., model_path: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "lease_s")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    lease_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., lease_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("role", "address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: InstanceRole
    address: str
    def __init__(self, role: _Optional[_Union[InstanceRole, str]] = ..., address: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("role", "address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: InstanceRole
    address: str
    def __init__(self, role: _Optional[_Union[InstanceRole, str]] = ..., address: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("role", "address", "state", "registered", "capacity_pcs", "load_pcs", "in_flight", "assigned", "affinity_hits", "failures", "kv_pages_free", "kv_pages_total", "active_requests", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PCS_FIELD_NUMBER: _ClassVar[int]
    LOAD_PCS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_HITS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: InstanceRole
    address: str
    state: str
    registered: bool
    capacity_pcs: float
    load_pcs: float
    in_flight: int
    assigned: int
    affinity_hits: int
    failures: int
    kv_pages_free: int
    kv_pages_total: int
    active_requests: int
    model: str
    def __init__(self, role: _Optional[_Union[InstanceRole, str]] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., registered: _Optional[bool] = ..., capacity_pcs: _Optional[float] = ..., load_pcs: _Optional[float] = ..., in_flight: _Optional[int] = ..., assigned: _Optional[int] = ..., affinity_hits: _Optional[int] = ..., failures: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., active_requests: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "queued", "rejected", "retries", "estimator_samples", "estimator_error", "estimator_mode")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_ERROR_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_MODE_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    queued: int
    rejected: int
    retries: int
    estimator_samples: int
    estimator_error: float
    estimator_mode: str
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., queued: _Optional[int] = ..., rejected: _Optional[int] = ..., retries: _Optional[int] = ..., estimator_samples: _Optional[int] = ..., estimator_error: _Optional[float] = ..., estimator_mode: _Optional[str] = ...) -> None: ...
