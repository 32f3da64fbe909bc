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
    __slots__ = ("state", "model", "weights_version", "num_running", "num_waiting", "num_blocks_used", "num_blocks_total", "block_size", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps", "uptime_s", "version", "scheduling_policy", "tiers", "weights_precision", "weight_bytes")
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
    weights_precision: str
    weight_bytes: int
    def __init__(self, state: _Optional[_Union[DaemonState, str]] = ..., model: _Optional[str] = ..., weights_version: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., uptime_s: _Optional[float] = ..., version: _Optional[str] = ..., scheduling_policy: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ..., weights_precision: _Optional[str] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

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
