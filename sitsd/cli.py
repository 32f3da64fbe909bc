"""The `sitsd` command: flags and environment -> `SitsdConfig`, then hand over to the daemon.

`build_parser()` declares every flag (each help text states its default) and
`config_from_args()` turns the parsed flags plus the environment into one frozen `SitsdConfig`.
This is the only module of the daemon that reads the environment (it hands the standard
`OTEL_*` variables to `sitsd.cli_observability`; flag value types are `sitsd.flag_types`).
Running the daemon is `sitsd.daemon`'s business, imported only when `serve` runs so `--help`
stays fast.

    sitsd serve --model default --port 50051 --kv-cache-memory 512MiB
    sitsd --version
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence

from sitsd import __version__
from sitsd.cli_observability import add_observability_flags, observability_config
from sitsd.cli_quantize import add_quantize_command, run_quantize
from sitsd.config import (
    ADMIN_TOKEN_FILE_NAME,
    CPU_TIME_SCALE,
    STATE_DIR_ENV,
    SWAP_POLICIES,
    WATCH_COMMIT_MODES,
    WEIGHT_SLOT_MODES,
    CacheConfig,
    ConfigError,
    HttpConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SitsdConfig,
    SwapConfig,
    TiersConfig,
    WeightsConfig,
    default_state_dir,
    default_tiers,
)
from sitsd.flag_types import (
    fraction,
    int_at_least,
    positive_float,
    seconds,
    size,
    tiers_file,
)

SCHEDULING_POLICIES = ("tiers", "fcfs")
TIER_NAMES = ("gold", "silver", "bronze")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


# ---------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The `sitsd` argument parser: `--version` and the `serve` command with every flag."""
    parser = argparse.ArgumentParser(prog="sitsd", description="sitsd: LLM inference daemon.")
    parser.add_argument("--version", action="version", version=f"sitsd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="load a model and serve it over gRPC and HTTP",
        description="Load a model and serve it over gRPC and the OpenAI-compatible HTTP API "
        "until SIGTERM or SIGINT.",
    )
    _add_model_flags(serve.add_argument_group("model"))
    _add_cache_flags(serve.add_argument_group("KV cache"))
    _add_scheduler_flags(serve.add_argument_group("scheduler"))
    _add_tier_flags(serve.add_argument_group("SLA tiers"))
    _add_weights_flags(serve.add_argument_group("weights and hot-swap"))
    _add_server_flags(serve.add_argument_group("server"))
    _add_http_flags(serve.add_argument_group("OpenAI-compatible HTTP API"))
    add_quantize_command(commands)
    add_observability_flags(serve.add_argument_group("observability"))
    return parser


def _add_model_flags(group: argparse._ArgumentGroup) -> None:
    d = ModelConfig()
    group.add_argument(
        "--model",
        default=d.model,
        help="Hugging Face model directory, .gguf file, or 'default' (the bundled "
        "SmolLM2-135M-Instruct) (default: %(default)s)",
    )
    group.add_argument(
        "--served-model-name",
        default=d.served_model_name,
        metavar="NAME",
        help="name clients use for the model (default: derived from --model)",
    )
    group.add_argument(
        "--device", default=d.device, help="cpu, cuda or cuda:N (default: %(default)s)"
    )
    group.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="weights and activations dtype; auto = float32 on CPU, bfloat16 on CUDA "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-model-len",
        type=int_at_least(0),
        default=d.max_model_len,
        metavar="N",
        help="context length served in tokens; 0 = the model's own (default: %(default)s)",
    )
    group.add_argument(
        "--num-threads",
        type=int_at_least(0),
        default=d.num_threads,
        metavar="N",
        help="torch threads on CPU; 0 = torch's default (default: %(default)s)",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (default: graphs on)",
    )
    group.add_argument(
        "--mixed-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA: also replay steps that carry prompt tokens as CUDA graphs, one per token "
        "bucket (16, 32, 64, ... up to --max-num-batched-tokens); --no-mixed-graphs runs them "
        "eagerly (default: on with CUDA graphs, off with --enforce-eager)",
    )
    group.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA: launch the Triton decode kernels with programmatic dependent launch, so "
        "each kernel's launch overlaps the tail of the one before it (default: on with "
        "compute capability 9.0 or newer, where it exists)",
    )
    group.add_argument(
        "--quantize",
        default=d.quantize,
        metavar="MAP",
        help="quantize 16-bit linear weights at load (round to nearest): a precision map (YAML "
        "file of glob patterns over tensor names -> int4, int4-g64, int8, fp8, bf16, fp16) or "
        "one precision for every linear layer (default: weights as the checkpoint has them)",
    )
    group.add_argument(
        "--dequantize",
        action="store_true",
        help="serve quantized checkpoints (GGUF Q4/Q8, AWQ, GPTQ, compressed-tensors, FP8) "
        "dequantized to --dtype instead of in their own bits (default: their own bits)",
    )


def _add_cache_flags(group: argparse._ArgumentGroup) -> None:
    d = CacheConfig()
    group.add_argument(
        "--block-size",
        type=int_at_least(1),
        default=d.block_size,
        metavar="N",
        help="tokens per KV cache block (default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-memory",
        type=size,
        default=d.kv_cache_memory,
        metavar="SIZE",
        help="memory for the KV cache on CPU, e.g. 512MiB or 2GiB; on CUDA the pool is "
        "sized from the free memory instead (default: 512MiB)",
    )
    group.add_argument(
        "--num-kv-blocks",
        type=int_at_least(0),
        default=d.num_blocks,
        metavar="N",
        help="force the number of KV blocks; 0 = from the memory budget (default: %(default)s)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=d.gpu_memory_utilization,
        metavar="FRACTION",
        help="fraction of the GPU's memory sitsd may use (default: %(default)s)",
    )
    group.add_argument(
        "--gpu-memory-limit",
        type=size,
        default=d.gpu_memory_limit,
        metavar="SIZE",
        help="treat the GPU as this large, e.g. 20GiB, to share it; the KV pool and "
        "--gpu-memory-utilization size from it (default: the whole visible device)",
    )
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV cache of identical prompt prefixes (default: prefix caching on)",
    )


def _add_scheduler_flags(group: argparse._ArgumentGroup) -> None:
    d = SchedulerConfig()
    group.add_argument(
        "--max-num-seqs",
        type=int_at_least(1),
        default=d.max_num_seqs,
        metavar="N",
        help="requests in one batch at most (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int_at_least(1),
        default=d.max_num_batched_tokens,
        metavar="N",
        help="tokens computed in one step at most (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-waiting",
        type=int_at_least(0),
        default=d.max_num_waiting,
        metavar="N",
        help="queued requests beyond which new ones are refused with RESOURCE_EXHAUSTED "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-tokens-default",
        type=int_at_least(1),
        default=d.max_tokens_default,
        metavar="N",
        help="completion length of requests that set no max_tokens (default: %(default)s)",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch each step before the last one's tokens reach the host, so "
        "the GPU never waits for the host between steps; a request that stops computes one "
        "token more, which is dropped; --no-async-scheduling runs one step at a time "
        "(default: on with CUDA, off on a CPU, whose steps do not overlap the host's work)",
    )


def _add_tier_flags(group: argparse._ArgumentGroup) -> None:
    d = TiersConfig()
    group.add_argument(
        "--scheduling-policy",
        default=SchedulerConfig().policy,
        choices=SCHEDULING_POLICIES,
        help="tiers: SLA tiers (tier order with aging, gold preempts lower tiers, P99-driven "
        "batch caps, admission control); fcfs: arrival order (default: %(default)s)",
    )
    group.add_argument(
        "--tiers",
        type=tiers_file,
        default=None,
        metavar="FILE",
        help="YAML file with the tiers' TTFT/inter-token P99 targets, queue waits and batch "
        "shares, and the controller's settings (default: the SITS table: gold 80 ms / 120 ms "
        f"queue, silver 200 ms / 250 ms, bronze 1 s / 500 ms; on a CPU {CPU_TIME_SCALE:g} times "
        "as long)",
    )
    group.add_argument(
        "--default-tier",
        default=None,
        choices=TIER_NAMES,
        help=f"tier of requests that name none (default: the tiers file's, else {d.default_tier})",
    )
    group.add_argument(
        "--batch-controller",
        default=None,
        metavar="NAME",
        help=f"batch-cap controller plugin (default: the tiers file's, else {d.controller})",
    )
    group.add_argument(
        "--plugin-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="directory of plugin files (*.py); repeatable (default: none)",
    )


def _tiers_from_args(args: argparse.Namespace) -> TiersConfig:
    tiers = args.tiers or default_tiers(args.device)
    changes: dict[str, object] = {}
    if args.default_tier:
        changes["default_tier"] = args.default_tier
    if args.batch_controller:
        changes["controller"] = args.batch_controller
    if args.plugin_dir:
        changes["plugin_dirs"] = (*tiers.plugin_dirs, *args.plugin_dir)
    return dataclasses.replace(tiers, **changes) if changes else tiers


def _add_weights_flags(group: argparse._ArgumentGroup) -> None:
    w, sw = WeightsConfig(), SwapConfig()
    group.add_argument(
        "--watch-dir",
        default=w.watch_dir,
        metavar="DIR",
        help="pick up new weight versions dropped into DIR/<model>/<version>/ once their "
        "manifest.json is present and every file matches it (default: no watched directory)",
    )
    group.add_argument(
        "--watch-commit",
        default=w.watch_commit,
        choices=WATCH_COMMIT_MODES,
        help="auto: commit a new valid version from the watched directory; stage-only: stage "
        "it and wait for `sitsctl swap` (default: %(default)s)",
    )
    group.add_argument(
        "--weight-slots",
        default=w.weight_slots,
        choices=WEIGHT_SLOT_MODES,
        help="2: a standby weight slot (a commit flips slots, no pause); 1: a commit copies the "
        "new weights in place between two steps (a pause); auto: 2 when it fits in memory "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--swap-policy",
        default=sw.policy,
        choices=SWAP_POLICIES,
        help="what a commit does with requests in flight: migrate (recompute their KV under "
        "the new weights while they decode, then flip), drain (finish on the old weights), "
        "restart (take them back a few a step and recompute them on the new ones) "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--swap-step-share",
        type=fraction,
        default=sw.step_share,
        metavar="FRACTION",
        help="the most a swap's work inside an engine step (canary prompts, migration "
        "recompute) may add to the step, of its measured steady time (default: %(default)s)",
    )
    group.add_argument(
        "--migration-tokens-per-step",
        type=int_at_least(1),
        default=sw.migration_tokens_per_step or None,
        metavar="N",
        help="a fixed allowance of swap work per engine step, in KV tokens, instead of the "
        "one measured from --swap-step-share (default: measured)",
    )
    group.add_argument(
        "--migration-deadline-steps",
        type=int_at_least(1),
        default=sw.migration_deadline_steps,
        metavar="N",
        help="a migration ends within this many steady engine steps of its commit, the "
        "device's own pace: 10 s at 5 ms a step, minutes on a CPU (its recompute grows past "
        "--swap-step-share near the end if it must) (default: %(default)s)",
    )
    group.add_argument(
        "--migration-deadline",
        type=positive_float,
        default=sw.migration_deadline_s or None,
        metavar="SECONDS",
        help="the migration's deadline in seconds instead, whatever the device (default: "
        "--migration-deadline-steps)",
    )
    group.add_argument(
        "--drain-hold",
        type=seconds,
        default=sw.drain_hold_s,
        metavar="SECONDS",
        help="after a drain commit, new requests wait up to this long for the requests left "
        "on the old version to finish, so that no step reads both versions' weights; 0: no "
        "wait (default: %(default)s)",
    )
    group.add_argument(
        "--staging-share",
        "--staging-cpu-share",
        dest="staging_share",
        type=fraction,
        default=None,
        metavar="FRACTION",
        help="the most of what it shares with serving staging a new version may use (it "
        "sleeps between chunks): on a CPU device, one core; on a GPU, the host-to-device "
        "link; 1 = as fast as it can (default: 0.1 on a CPU device, 0.25 on a GPU)",
    )
    group.add_argument(
        "--ipc-keep-mapped",
        action="store_true",
        help="keep a trainer's CUDA memory mapped from one IPC push to the next, so that a "
        "trainer pushing from the same buffers is mapped once; its buffers stay allocated "
        "until a push from other buffers or the daemon stops (default: let go after each push)",
    )
    group.add_argument(
        "--keep-pushed-versions",
        type=int_at_least(1),
        default=w.keep_pushed_versions,
        metavar="N",
        help="weight versions pushed by trainers that are remembered, the newest (older ones "
        "are forgotten unless active, the rollback target or in a slot) (default: %(default)s)",
    )
    group.add_argument(
        "--canary-file",
        default=w.canary_file,
        metavar="FILE",
        help='prompts (one per line, or JSON lines {"prompt": ...}) whose next-token '
        "distributions under a new version must stay within --canary-max-kl of the active "
        "one's before it commits (default: no canary)",
    )
    group.add_argument(
        "--canary-max-kl",
        type=positive_float,
        default=w.canary_max_kl,
        metavar="NATS",
        help="mean KL(active || new) per prompt token above which a version is rejected "
        "(default: %(default)s)",
    )


def _add_server_flags(group: argparse._ArgumentGroup) -> None:
    d = ServerConfig()
    group.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s)")
    group.add_argument(
        "--port",
        type=int_at_least(0, 65535),
        default=d.port,
        help="gRPC port; 0 = a free one, logged at start-up (default: %(default)s)",
    )
    group.add_argument(
        "--admin-token-file",
        default=d.admin_token_file,
        metavar="PATH",
        help="file holding the bearer token Admin RPCs need (default: "
        f"<state dir>/{ADMIN_TOKEN_FILE_NAME}, created if missing)",
    )
    group.add_argument(
        "--state-dir",
        default="",
        metavar="DIR",
        help=f"directory for daemon state (default: ${STATE_DIR_ENV}, else ~/.local/state/sitsd)",
    )
    group.add_argument(
        "--shutdown-grace",
        type=seconds,
        default=d.shutdown_grace_s,
        metavar="SECONDS",
        help="how long SIGTERM waits for in-flight requests (default: %(default)s)",
    )
    group.add_argument(
        "--gil-switch-interval",
        type=positive_float,
        default=d.gil_switch_interval_s,
        metavar="SECONDS",
        help="the longest a thread running Python keeps the GIL from the engine's thread "
        "when it asks for it (Python's own default is 0.005) (default: %(default)s)",
    )


def _add_http_flags(group: argparse._ArgumentGroup) -> None:
    d = HttpConfig()
    group.add_argument(
        "--http-port",
        type=int_at_least(0, 65535),
        default=d.port,
        metavar="PORT",
        help="port of the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health); 0 = a free one, logged at start-up (default: %(default)s)",
    )
    group.add_argument(
        "--http-host",
        default=d.host,
        metavar="HOST",
        help="address of the HTTP API (default: the --host address)",
    )
    group.add_argument(
        "--no-http", action="store_true", help="do not serve the HTTP API (default: served)"
    )
    group.add_argument(
        "--api-key-file",
        default=d.api_key_file,
        metavar="PATH",
        help="file of API keys, one a line: every /v1/* call then needs "
        "'Authorization: Bearer <key>' (default: no key needed)",
    )


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str], *, stdout_is_tty: bool = False
) -> SitsdConfig:
    """The daemon's configuration from parsed `serve` flags and the environment."""
    return SitsdConfig(
        model=ModelConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            num_threads=args.num_threads,
            enforce_eager=args.enforce_eager,
            mixed_graphs=args.mixed_graphs,
            pdl=args.pdl,
            quantize=args.quantize,
            dequantize=args.dequantize,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            gpu_memory_limit=args.gpu_memory_limit,
            num_blocks=args.num_kv_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_waiting=args.max_num_waiting,
            max_tokens_default=args.max_tokens_default,
            policy=args.scheduling_policy,
            async_scheduling=args.async_scheduling,
        ),
        tiers=_tiers_from_args(args),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            shutdown_grace_s=args.shutdown_grace,
            gil_switch_interval_s=args.gil_switch_interval,
            admin_token_file=args.admin_token_file,
            state_dir=args.state_dir or default_state_dir(environ),
        ),
        http=HttpConfig(
            enabled=not args.no_http,
            host=args.http_host,
            port=args.http_port,
            api_key_file=args.api_key_file,
        ),
        observability=observability_config(args, environ, stdout_is_tty=stdout_is_tty),
        weights=WeightsConfig(
            watch_dir=args.watch_dir,
            watch_commit=args.watch_commit,
            weight_slots=args.weight_slots,
            canary_file=args.canary_file,
            canary_max_kl=args.canary_max_kl,
            staging_share=args.staging_share or 0.0,
            keep_pushed_versions=args.keep_pushed_versions,
            ipc_keep_mapped=args.ipc_keep_mapped,
        ),
        swap=SwapConfig(
            policy=args.swap_policy,
            step_share=args.swap_step_share,
            migration_tokens_per_step=args.migration_tokens_per_step or 0,
            migration_deadline_steps=args.migration_deadline_steps,
            migration_deadline_s=args.migration_deadline or 0.0,
            drain_hold_s=args.drain_hold,
        ),
    )


def check_flags(config: SitsdConfig) -> None:
    """Raise `ConfigError` for settings that cannot work together, whatever the machine.

    What needs the file system or the model is checked by the daemon before it loads anything
    (`sitsd.preflight`, then the builder).
    """
    if config.swap.policy == "drain" and config.weights.weight_slots == "1":
        raise ConfigError(
            "--swap-policy drain needs two weight slots (requests finish on the old weights "
            "while new ones start on the new): drop --weight-slots 1, or choose --swap-policy "
            "migrate or restart"
        )
    if not DEVICE_PATTERN.fullmatch(config.model.device):
        raise ConfigError(f"--device {config.model.device!r}: use cpu, cuda or cuda:N")


def _stop_before_serving(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT before the daemon's own handlers are in place: a clean exit (status 0),
    since nothing has been started or written yet."""
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sitsd` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "quantize":
        return run_quantize(args)
    if args.command != "serve":
        parser.print_help(sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_before_serving)
    try:
        config = config_from_args(args, os.environ, stdout_is_tty=sys.stdout.isatty())
        check_flags(config)
    except (argparse.ArgumentTypeError, ConfigError) as exc:  # a bad OTEL_* value, a combination
        parser.error(str(exc))
    from sitsd import daemon  # heavy (grpc, and torch through the engine): only to serve

    return daemon.run(config)
