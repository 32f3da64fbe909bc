from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SwapPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWAP_POLICY_UNSPECIFIED: _ClassVar[SwapPolicy]
    SWAP_POLICY_MIGRATE: _ClassVar[SwapPolicy]
    SWAP_POLICY_DRAIN: _ClassVar[SwapPolicy]
    SWAP_POLICY_RESTART: _ClassVar[SwapPolicy]

class VersionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_STATE_UNSPECIFIED: _ClassVar[VersionState]
    VERSION_STATE_STAGED: _ClassVar[VersionState]
    VERSION_STATE_VALIDATED: _ClassVar[VersionState]
    VERSION_STATE_ACTIVE: _ClassVar[VersionState]
    VERSION_STATE_RETIRED: _ClassVar[VersionState]
    VERSION_STATE_REJECTED: _ClassVar[VersionState]

class DaemonState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DAEMON_STATE_UNSPECIFIED: _ClassVar[DaemonState]
    DAEMON_STATE_LOADING: _ClassVar[DaemonState]
    DAEMON_STATE_SERVING: _ClassVar[DaemonState]
    DAEMON_STATE_DRAINING: _ClassVar[DaemonState]
SWAP_POLICY_UNSPECIFIED: SwapPolicy
SWAP_POLICY_MIGRATE: SwapPolicy
SWAP_POLICY_DRAIN: SwapPolicy
SWAP_POLICY_RESTART: SwapPolicy
VERSION_STATE_UNSPECIFIED: VersionState
VERSION_STATE_STAGED: VersionState
VERSION_STATE_VALIDATED: VersionState
VERSION_STATE_ACTIVE: VersionState
VERSION_STATE_RETIRED: VersionState
VERSION_STATE_REJECTED: VersionState
DAEMON_STATE_UNSPECIFIED: DaemonState
DAEMON_STATE_LOADING: DaemonState
DAEMON_STATE_SERVING: DaemonState
DAEMON_STATE_DRAINING: DaemonState

class DeployRequest(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: str
    def __init__(self, path: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class SwapRequest(_message.Message):
    __slots__ = ("version", "policy")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    version: str
    policy: SwapPolicy
    def __init__(self, version: _Optional[str] = ..., policy: _Optional[_Union[SwapPolicy, str]] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: SwapPolicy
    def __init__(self, policy: _Optional[_Union[SwapPolicy, str]] = ...) -> None: ...

class SwapProgress(_message.Message):
    __slots__ = ("stage", "version", "bytes_done", "bytes_total", "message", "policy", "num_migrating", "num_caught_up", "num_restarted", "num_draining", "pause_ms", "flip_ms", "canary_kl", "canary_ppl_ratio")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATING_FIELD_NUMBER: _ClassVar[int]
    NUM_CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTARTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAINING_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    FLIP_MS_FIELD_NUMBER: _ClassVar[int]
    CANARY_KL_FIELD_NUMBER: _ClassVar[int]
    CANARY_PPL_RATIO_FIELD_NUMBER: _ClassVar[int]
    stage: str
    version: str
    bytes_done: int
    bytes_total: int
    message: str
    policy: str
    num_migrating: int
    num_caught_up: int
    num_restarted: int
    num_draining: int
    pause_ms: float
    flip_ms: float
    canary_kl: float
    canary_ppl_ratio: float
    def __init__(self, stage: _Optional[str] = ..., version: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., message: _Optional[str] = ..., policy: _Optional[str] = ..., num_migrating: _Optional[int] = ..., num_caught_up: _Optional[int] = ..., num_restarted: _Optional[int] = ..., num_draining: _Optional[int] = ..., pause_ms: _Optional[float] = ..., flip_ms: _Optional[float] = ..., canary_kl: _Optional[float] = ..., canary_ppl_ratio: _Optional[float] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("version", "policy", "partial", "stage_only", "origin", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    STAGE_ONLY_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: str
    policy: SwapPolicy
    partial: bool
    stage_only: bool
    origin: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, version: _Optional[str] = ..., policy: _Optional[_Union[SwapPolicy, str]] = ..., partial: _Optional[bool] = ..., stage_only: _Optional[bool] = ..., origin: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class IpcTensor(_message.Message):
    __slots__ = ("name", "stride", "storage_offset", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    name: str
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, name: _Optional[str] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class UpdateWeightsIpcRequest(_message.Message):
    __slots__ = ("header", "tensors", "device_uuid")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    tensors: _containers.RepeatedCompositeFieldContainer[IpcTensor]
    device_uuid: str
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[IpcTensor, _Mapping]]] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class JoinWeightGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "world_size", "rank", "backend", "group_name", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    world_size: int
    rank: int
    backend: str
    group_name: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., backend: _Optional[str] = ..., group_name: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class JoinWeightGroupResponse(_message.Message):
    __slots__ = ("backend", "device")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    device: str
    def __init__(self, backend: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class TensorPlacement(_message.Message):
    __slots__ = ("bucket", "offset")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    offset: int
    def __init__(self, bucket: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class UpdateWeightsFromGroupRequest(_message.Message):
    __slots__ = ("header", "bucket_bytes", "placements", "src_rank")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    bucket_bytes: _containers.RepeatedScalarFieldContainer[int]
    placements: _containers.RepeatedCompositeFieldContainer[TensorPlacement]
    src_rank: int
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., bucket_bytes: _Optional[_Iterable[int]] = ..., placements: _Optional[_Iterable[_Union[TensorPlacement, _Mapping]]] = ..., src_rank: _Optional[int] = ...) -> None: ...

class WeightUpdate(_message.Message):
    __slots__ = ("version", "transport", "outcome", "message", "num_tensors", "num_bytes", "receive_s", "validate_s", "canary_s", "commit_s", "total_s", "pause_ms", "policy", "finished_at")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_S_FIELD_NUMBER: _ClassVar[int]
    CANARY_S_FIELD_NUMBER: _ClassVar[int]
    COMMIT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    version: str
    transport: str
    outcome: str
    message: str
    num_tensors: int
    num_bytes: int
    receive_s: float
    validate_s: float
    canary_s: float
    commit_s: float
    total_s: float
    pause_ms: float
    policy: str
    finished_at: float
    def __init__(self, version: _Optional[str] = ..., transport: _Optional[str] = ..., outcome: _Optional[str] = ..., message: _Optional[str] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., receive_s: _Optional[float] = ..., validate_s: _Optional[float] = ..., canary_s: _Optional[float] = ..., commit_s: _Optional[float] = ..., total_s: _Optional[float] = ..., pause_ms: _Optional[float] = ..., policy: _Optional[str] = ..., finished_at: _Optional[float] = ...) -> None: ...

class PushEvent(_message.Message):
    __slots__ = ("progress", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: SwapProgress
    done: WeightUpdate
    def __init__(self, progress: _Optional[_Union[SwapProgress, _Mapping]] = ..., done: _Optional[_Union[WeightUpdate, _Mapping]] = ...) -> None: ...

class WeightPushStatus(_message.Message):
    __slots__ = ("device", "device_uuid", "weight_group", "last_update")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_GROUP_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_FIELD_NUMBER: _ClassVar[int]
    device: str
    device_uuid: str
    weight_group: str
    last_update: WeightUpdate
    def __init__(self, device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., weight_group: _Optional[str] = ..., last_update: _Optional[_Union[WeightUpdate, _Mapping]] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("version", "path", "state", "reason", "manifest_sha256", "source", "created_at", "updated_at", "active", "slot", "precision", "weight_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    path: str
    state: VersionState
    reason: str
    manifest_sha256: str
    source: str
    created_at: float
    updated_at: float
    active: bool
    slot: str
    precision: str
    weight_bytes: int
    def __init__(self, version: _Optional[str] = ..., path: _Optional[str] = ..., state: _Optional[_Union[VersionState, str]] = ..., reason: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., source: _Optional[str] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., active: _Optional[bool] = ..., slot: _Optional[str] = ..., precision: _Optional[str] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("model", "versions", "active_version", "previous_version", "num_weight_slots", "operation_in_progress")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_WEIGHT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    OPERATION_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    model: str
    versions: _containers.RepeatedCompositeFieldContainer[WeightVersion]
    active_version: str
    previous_version: str
    num_weight_slots: int
    operation_in_progress: str
    def __init__(self, model: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[WeightVersion, _Mapping]]] = ..., active_version: _Optional[str] = ..., previous_version: _Optional[str] = ..., num_weight_slots: _Optional[int] = ..., operation_in_progress: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("state", "model", "weights_version", "num_running", "num_waiting", "num_blocks_used", "num_blocks_total", "block_size", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps", "uptime_s", "version", "scheduling_policy", "tiers", "weight_push", "weights_precision", "weight_bytes")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_PUSH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PRECISION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    state: DaemonState
    model: str
    weights_version: str
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    uptime_s: float
    version: str
    scheduling_policy: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    weight_push: WeightPushStatus
    weights_precision: str
    weight_bytes: int
    def __init__(self, state: _Optional[_Union[DaemonState, str]] = ..., model: _Optional[str] = ..., weights_version: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., uptime_s: _Optional[float] = ..., version: _Optional[str] = ..., scheduling_policy: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ..., weight_push: _Optional[_Union[WeightPushStatus, _Mapping]] = ..., weights_precision: _Optional[str] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("tier", "ttft_p99_target_s", "itl_p99_target_s", "max_queue_wait_s", "batch_cap", "num_running", "num_waiting", "ttft_p99_s", "itl_p99_s", "num_samples", "num_refused", "num_shed", "num_preempted")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_CAP_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_S_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_SHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    ttft_p99_target_s: float
    itl_p99_target_s: float
    max_queue_wait_s: float
    batch_cap: int
    num_running: int
    num_waiting: int
    ttft_p99_s: float
    itl_p99_s: float
    num_samples: int
    num_refused: int
    num_shed: int
    num_preempted: int
    def __init__(self, tier: _Optional[str] = ..., ttft_p99_target_s: _Optional[float] = ..., itl_p99_target_s: _Optional[float] = ..., max_queue_wait_s: _Optional[float] = ..., batch_cap: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., ttft_p99_s: _Optional[float] = ..., itl_p99_s: _Optional[float] = ..., num_samples: _Optional[int] = ..., num_refused: _Optional[int] = ..., num_shed: _Optional[int] = ..., num_preempted: _Optional[int] = ...) -> None: ...
