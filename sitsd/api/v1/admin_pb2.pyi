from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DaemonState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DAEMON_STATE_UNSPECIFIED: _ClassVar[DaemonState]
    DAEMON_STATE_LOADING: _ClassVar[DaemonState]
    DAEMON_STATE_SERVING: _ClassVar[DaemonState]
    DAEMON_STATE_DRAINING: _ClassVar[DaemonState]
DAEMON_STATE_UNSPECIFIED: DaemonState
DAEMON_STATE_LOADING: DaemonState
DAEMON_STATE_SERVING: DaemonState
DAEMON_STATE_DRAINING: DaemonState

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("state", "model", "weights_version", "num_running", "num_waiting", "num_blocks_used", "num_blocks_total", "block_size", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps", "uptime_s", "version", "scheduling_policy", "tiers")
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
    def __init__(self, state: _Optional[_Union[DaemonState, str]] = ..., model: _Optional[str] = ..., weights_version: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., uptime_s: _Optional[float] = ..., version: _Optional[str] = ..., scheduling_policy: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ...) -> None: ...

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
