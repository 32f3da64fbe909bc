"""Build a ready-to-start engine from the configuration: load, size, allocate, warm up.

Order: resolve the model path -> load the checkpoint -> weights on the device (quantized
modules converted into their kernels' layouts, `--quantize` applied: `serving_format`) -> the
weight slots (a second, standby slot for hot-swap when it fits, room kept for the model in 16
bits when the serving weights are quantized, so a 16-bit version can be staged into it) -> KV
pool from the memory budget -> model runner -> one warm-up step -> scheduler and engine core.
Blocking (seconds to minutes): the daemon calls it off the event loop while health says
NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from sitsd.config import ConfigError, ModelConfig, SitsdConfig
from sitsd.engine.async_engine import AsyncEngine
from sitsd.engine.core import EngineCore
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.observer import EngineObserver
from sitsd.engine.pacing import PacingSettings
from sitsd.engine.scheduler import Scheduler
from sitsd.model.arch import LlamaArch
from sitsd.model.llama import LlamaModel, LlamaWeights, ServingFormat, build_weights
from sitsd.model.ops import KernelSet, cpu_kernels, triton_kernels
from sitsd.model.qlinear import int4_split_counters
from sitsd.outputs import CachedRequestData, ModelInfo, NewRequestData, SchedulerOutput
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Int4Weight
from sitsd.quant.precision import load_precision_map
from sitsd.quant.source import QuantSource
from sitsd.runtime.cuda_graphs import decode_buckets
from sitsd.runtime.grammar import GrammarCompiler
from sitsd.runtime.input_batch import StepInputBuilder
from sitsd.runtime.kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    cuda_used_outside_torch,
    gpu_kv_budget,
)
from sitsd.runtime.memory_plan import decide_weight_slots, profile_peak_memory, size_kv_pool
from sitsd.runtime.mixed_graphs import token_buckets
from sitsd.runtime.model_runner import ModelRunner
from sitsd.runtime.precompile import Int4Launches, precompile_int4
from sitsd.runtime.weight_slots import WeightSlots
from sitsd.types import SamplingParams, Tier
from sitsd.weights import Checkpoint, load_checkpoint, resolve_model_path
from sitsd.weights.canary import warm_compare
from sitsd.weights.versions import version_id_from

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(cfg: ModelConfig) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.float32 if cfg.device == "cpu" else torch.bfloat16
    if cfg.dtype not in _DTYPES:
        raise ConfigError(f"--dtype must be auto, {', '.join(_DTYPES)}; got {cfg.dtype!r}")
    return _DTYPES[cfg.dtype]


def check_device(name: str) -> torch.device:
    """The device `--device` names, if this machine has it; checked before anything loads.

    Raises:
        ConfigError: not a device sitsd runs on, or not one this machine (or torch build) has.
    """
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"--device {name!r}: sitsd runs on cpu or cuda")
    if not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
        raise ConfigError(f"--device {name}: this torch ({torch.__version__}) {why}; "
                          "use --device cpu")  # fmt: skip
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return device


def served_max_model_len(cfg: ModelConfig, arch: LlamaArch) -> int:
    """The context length served: the flag, capped by the model's own (and Mistral's window)."""
    limit = arch.max_position_embeddings
    if arch.sliding_window:
        limit = min(limit, arch.sliding_window)  # no sliding-window attention: stay inside it
    if cfg.max_model_len > limit:
        raise ConfigError(f"--max-model-len {cfg.max_model_len} exceeds the model's {limit}")
    return cfg.max_model_len or limit


def weights_version_of(ckpt: Checkpoint) -> str:
    """A short id of the checkpoint's files (names, sizes, mtimes): stable across restarts."""
    h = hashlib.blake2b(digest_size=4)
    for f in sorted(ckpt.files):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{version_id_from(ckpt.name)}@{h.hexdigest()}"


def serving_format(mcfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> ServingFormat:
    """How every version is held: device, dtype, the `--quantize` map, `--dequantize`.

    Raises:
        ConfigError: the precision map cannot be read.
    """
    try:
        precision = load_precision_map(mcfg.quantize) if mcfg.quantize else None
    except QuantFormatError as exc:
        raise ConfigError(f"--quantize: {exc}") from None
    return ServingFormat(device, dtype, precision, mcfg.dequantize)


def kernels_for(
    device: torch.device, mcfg: ModelConfig, arch: LlamaArch, max_num_seqs: int,
    int4_workspace: torch.Tensor | None = None,
) -> KernelSet:  # fmt: skip
    """The CPU kernels, or the Triton ones with the decode-attention split counters (zeros,
    one per sequence x kv head of the largest decode batch), the INT4 dequantize workspace and
    the INT4 split counters (`int4_split_counters`: for any linear of the architecture, since a
    version swapped in later may be INT4 where this one is not)."""
    if device.type == "cpu":
        return cpu_kernels()
    counters = torch.zeros(max_num_seqs * arch.num_kv_heads, dtype=torch.int32, device=device)
    return triton_kernels(pdl=mcfg.pdl, split_counters=counters, int4_workspace=int4_workspace,
                          int4_split_counters=int4_split_counters(arch, device))  # fmt: skip


def model_beside_serving(
    arch: LlamaArch,
    device: torch.device,
    mcfg: ModelConfig,
    max_num_seqs: int,
    max_position: int,
    int4_workspace: torch.Tensor | None,
) -> LlamaModel:
    """A model like the runner's whose kernels keep scratch of their own (`KernelSet.scratch`:
    new split counters, and a workspace as large as the runner's `int4_workspace`, made now):
    what the warm-ups of a capture beside serving compute with (`ModelRunner.recapture_graphs`).
    They run on another stream while the engine's steps do, so they must not write what the
    steps' kernels use between two launches."""
    workspace = torch.empty_like(int4_workspace) if int4_workspace is not None else None
    kernels = kernels_for(device, mcfg, arch, max_num_seqs, workspace)
    return LlamaModel(arch, kernels, max_position, device)


def int4_workspace_for(weights: LlamaWeights, dtype: torch.dtype) -> torch.Tensor | None:
    """A CUDA workspace as large as the largest INT4 linear (dequantize + cuBLAS for long
    prefill chunks, `sitsd.model.qlinear`); None without INT4 weights or off CUDA."""
    sizes = [w.shape[0] * w.shape[1] for w in weights.linears() if isinstance(w, Int4Weight)]
    if not sizes or weights.norm.device.type != "cuda":
        return None
    return torch.empty(max(sizes), dtype=dtype, device=weights.norm.device)


def standby_int4_workspace_numel(arch: LlamaArch) -> int:
    """Elements of the INT4 dequantize workspace a two-slot daemon serving dense weights keeps
    for a version staged later whose linears are INT4: the largest decoder linear (gate_up for
    Llama-3-8B, 235 MB in bf16). The lm_head is left out (a GiB for a 128k vocabulary): it
    takes as many rows as a step samples, which stays under the dequantize's threshold."""
    h = arch.hidden_size
    return max((arch.q_size + 2 * arch.kv_size) * h, h * arch.q_size,
               2 * arch.intermediate_size * h, h * arch.intermediate_size)  # fmt: skip


def standby_slot_bytes(weights: LlamaWeights, arch: LlamaArch, dtype: torch.dtype) -> int:
    """What the standby slot must be able to hold: the serving weights, or, when they are
    quantized, the model in the serving dtype (a 16-bit version of it can be staged)."""
    dense = arch.num_parameters * dtype.itemsize
    quantized = any(not isinstance(w, torch.Tensor) for w in weights.linears())
    return max(weights.nbytes, dense) if quantized else weights.nbytes


@dataclass(frozen=True)
class RuntimeInfo:
    """What `build_runner` decided, for the start-up log and `ModelInfo`."""

    num_blocks: int
    max_model_len: int
    graph_buckets: tuple[int, ...]  # empty: eager (CPU, or --enforce-eager)
    graph_capture_s: float
    num_weight_slots: int = 1  # 2: a standby slot for hot-swap; 1: swaps copy in place
    weight_slots_reason: str = ""  # why that many
    mixed_graph_buckets: tuple[int, ...] = ()  # token buckets of mixed-step graphs; empty: off
    mixed_graph_capture_s: float = 0.0


class BuildCancelled(Exception):
    """The build was cancelled (the daemon is stopping); it stopped between two of its steps."""


def _stop_if_cancelled(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise BuildCancelled("the engine build was cancelled")


def build_engine(
    config: SitsdConfig,
    checkpoint: Checkpoint | None = None,
    observer: EngineObserver | None = None,
    weights_version: str | None = None,
    cancel: threading.Event | None = None,
) -> AsyncEngine:
    """Load the model (or take `checkpoint`) and assemble the engine; then `start()` it.

    `observer` is told of every request and step (see `sitsd.engine.observer`);
    `weights_version` names the checkpoint's version (default: from its files' names, sizes
    and modification times). Once `cancel` is set the build stops at its next step, raising
    `BuildCancelled`: a signal during start-up need not wait for the whole load.
    """
    t0 = time.monotonic()
    mcfg = config.model
    check_device(mcfg.device)
    if checkpoint is None:
        path = resolve_model_path(mcfg.model)
        log.info("loading %s", path)
        _stop_if_cancelled(cancel)
        checkpoint = load_checkpoint(path)
    arch = checkpoint.arch
    version = weights_version or weights_version_of(checkpoint)
    _stop_if_cancelled(cancel)
    log.info("checkpoint read in %.1fs; weights to %s, KV pool, warm-up", time.monotonic() - t0,
             mcfg.device)  # fmt: skip
    runner, info = build_runner(config, arch, checkpoint.tensors, version, checkpoint.quant,
                                cancel)  # fmt: skip
    # Structured outputs: matchers over the serving vocabulary (built on first use).
    runner.logits_processors.grammars = GrammarCompiler.for_tokenizer(
        checkpoint.tokenizer, arch.vocab_size
    )
    name = mcfg.served_model_name or checkpoint.name
    block_size = config.cache.block_size
    kv_cache = KVCacheManager(info.num_blocks, block_size, config.cache.enable_prefix_caching)
    scfg = config.scheduler
    if scfg.async_scheduling is None:
        scfg = replace(scfg, async_scheduling=runner.overlaps_host_work)
    swap = config.swap
    pacing = PacingSettings(
        share=swap.step_share,
        fixed_tokens=swap.migration_tokens_per_step,
        migration_deadline_steps=swap.migration_deadline_steps,
        migration_deadline_s=swap.migration_deadline_s,
        drain_hold_s=swap.drain_hold_s,
    )
    scheduler = Scheduler(scfg, kv_cache, info.max_model_len, tiers=config.tiers, pacing=pacing)
    core = EngineCore(
        scheduler, runner, checkpoint.tokenizer, name,
        default_tier=Tier(config.tiers.default_tier), observer=observer,
    )  # fmt: skip
    dtype = runner.slots.dtype
    log.info(
        "model %s ready in %.1fs: %d layers, %.0fM params, %s on %s, weights %.0f MiB (%s); "
        "KV capacity %d blocks x %d = %d tokens (%.0f MiB), context %d; CUDA graphs: %s; "
        "asynchronous scheduling: %s; kernels: %s",
        name, time.monotonic() - t0, arch.num_layers, arch.num_parameters / 1e6,
        str(dtype).removeprefix("torch."), runner.device, runner.weights.nbytes / 2**20,
        runner.weights.precision,
        info.num_blocks, block_size, info.num_blocks * block_size,
        info.num_blocks * bytes_per_block(arch, block_size, dtype) / 2**20, info.max_model_len,
        graphs_summary(info), "on" if scfg.async_scheduling else "off", runner.model.kernels.name,
    )  # fmt: skip
    log_weight_slots(info, runner.slots.slot_nbytes)
    model_info = ModelInfo(
        name=name, max_model_len=info.max_model_len, vocab_size=arch.vocab_size,
        architecture=arch.architecture, dtype=str(dtype).removeprefix("torch."),
        device=str(runner.device), path=str(checkpoint.path.resolve()),
        max_token_bytes=checkpoint.tokenizer.max_token_bytes,
    )  # fmt: skip
    return AsyncEngine(core, model_info)


def graphs_summary(info: RuntimeInfo) -> str:
    """The start-up log's words on CUDA graphs: decode buckets, mixed-step token buckets."""
    if not info.graph_buckets:
        return "off (eager)"
    mixed = (
        f"token buckets {list(info.mixed_graph_buckets)} captured in "
        f"{info.mixed_graph_capture_s:.1f}s"
        if info.mixed_graph_buckets else "eager (--no-mixed-graphs)"
    )  # fmt: skip
    return (
        f"buckets {list(info.graph_buckets)} captured in {info.graph_capture_s:.1f}s; "
        f"steps with prompt tokens: {mixed}"
    )


def build_runner(
    config: SitsdConfig,
    arch: LlamaArch,
    tensors: Mapping[str, torch.Tensor],
    weights_version: str,
    source: QuantSource | None = None,
    cancel: threading.Event | None = None,
) -> tuple[ModelRunner, RuntimeInfo]:
    """Weights on the device, the KV pool sized and allocated, warmed up, graphs captured.

    `source` says which of the checkpoint's modules are stored quantized (`Checkpoint.quant`).

    Raises:
        BuildCancelled: `cancel` was set (checked between the steps).
    """
    mcfg, ccfg, scfg = config.model, config.cache, config.scheduler
    device = torch.device(mcfg.device)
    dtype = resolve_dtype(mcfg)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        baseline_outside_torch = cuda_used_outside_torch(device)
    elif mcfg.num_threads:
        torch.set_num_threads(mcfg.num_threads)
    max_model_len = served_max_model_len(mcfg, arch)
    fmt = serving_format(mcfg, device, dtype)
    weights = build_weights(arch, tensors, device, dtype, source=source, fmt=fmt)
    int4_workspace = int4_workspace_for(weights, dtype)
    max_num_tokens = max(scfg.max_num_batched_tokens, scfg.max_num_seqs)
    vocab_bytes = scfg.max_num_seqs * arch.vocab_size * 4
    mixed = device.type == "cuda" and mcfg.mixed_graphs is not False and not mcfg.enforce_eager
    mixed_buckets = token_buckets(max_num_tokens) if mixed else []
    # Per slot's graphs: their pool and logits (each mixed bucket keeps its own); then sampler
    # sort buffers and slack. The mixed graphs' activations are added once profiled.
    mixed_logits_bytes = sum(min(b, scfg.max_num_seqs) for b in mixed_buckets) * arch.vocab_size * 4
    graph_reserve = 256 * 2**20 + vocab_bytes + mixed_logits_bytes
    standby_bytes = standby_slot_bytes(weights, arch, dtype)
    # Dense weights on a GPU: a version staged into the standby slot may be INT4, and its
    # steps of INT4_DEQUANT_FROM_ROWS rows or more want the dequantize workspace (without it
    # they run `int4_matmul`, 1.5x slower at 512 rows on an H100).
    spare_numel = standby_int4_workspace_numel(arch) if (
        int4_workspace is None and device.type == "cuda") else 0  # fmt: skip
    num_slots, why = decide_weight_slots(
        config, device, standby_bytes + spare_numel * dtype.itemsize,
        kv_floor=-(-max_model_len // ccfg.block_size) * bytes_per_block(arch, ccfg.block_size,
                                                                      dtype),
        reserve=2 * graph_reserve + 2 * vocab_bytes,
    )  # fmt: skip
    if num_slots == 2 and spare_numel:
        int4_workspace = torch.empty(spare_numel, dtype=dtype, device=device)
    kernels = kernels_for(device, mcfg, arch, scfg.max_num_seqs, int4_workspace)
    model = LlamaModel(arch, kernels, max_model_len, device)
    # For a weight slot's graphs captured again while the engine serves (CUDA).
    model_beside = functools.partial(model_beside_serving, arch, device, mcfg, scfg.max_num_seqs,
                                     max_model_len, int4_workspace)  # fmt: skip
    # ...with the INT4 kernels of a version of another precision compiled in a child first.
    launches = Int4Launches(
        device.index or 0, str(dtype).removeprefix("torch."), mcfg.pdl,
        int4_workspace.numel() if int4_workspace is not None else 0,
        int4_split_counters(arch, torch.device("meta")).numel(),
    )  # fmt: skip
    _stop_if_cancelled(cancel)
    # Allocated before the profiling pass, so the KV budget accounts for the second slot.
    slots = WeightSlots(arch, weights, weights_version, num_slots, fmt)
    if device.type == "cuda":
        peak = profile_peak_memory(
            model, weights, arch, config, dtype, device, max_num_tokens, max_model_len
        )
        # A mixed graph pool holds the activations of its largest bucket (the profiled step).
        activations = peak - torch.cuda.memory_allocated(device) if mixed else 0
        reserve = num_slots * (graph_reserve + activations) + 2 * vocab_bytes
        if num_slots == 2:  # room for the standby slot to grow to a 16-bit version
            reserve += standby_bytes - weights.nbytes
        budget = gpu_kv_budget(device, ccfg.gpu_memory_utilization, ccfg.gpu_memory_limit,
                               peak, reserve, baseline_outside_torch)  # fmt: skip
        ccfg = replace(ccfg, kv_cache_memory=max(budget, 0))
    num_blocks, max_model_len = size_kv_pool(ccfg, mcfg, arch, dtype, max_model_len)
    kv_caches = allocate_kv_caches(arch, num_blocks, ccfg.block_size, dtype, device)
    builder = StepInputBuilder(
        max_num_tokens=max_num_tokens, max_num_seqs=scfg.max_num_seqs,
        max_blocks_per_seq=-(-max_model_len // ccfg.block_size), block_size=ccfg.block_size,
        device=device,
    )  # fmt: skip
    on_cuda = device.type == "cuda"
    runner = ModelRunner(model, slots, kv_caches, builder,
                         model_beside=model_beside if on_cuda else None,
                         precompile=functools.partial(precompile_int4, launches) if on_cuda
                         else None)  # fmt: skip
    _stop_if_cancelled(cancel)
    _warm_up(runner, min(16, max_model_len - 1))
    if device.type == "cuda":  # a canary's kernels, loaded before the first swap needs them
        runner.warm_probe_logprobs()
        warm_compare(device, arch.vocab_size)
    buckets: list[int] = []
    seconds = 0.0
    _stop_if_cancelled(cancel)
    if device.type == "cuda" and not mcfg.enforce_eager:
        buckets = decode_buckets(scfg.max_num_seqs)
        seconds = runner.capture_graphs(buckets)  # one set per slot
    mixed_seconds = runner.prepare_mixed_steps(mixed_buckets, capture=True) if mixed else 0.0
    info = RuntimeInfo(
        num_blocks, max_model_len, tuple(buckets), seconds, num_slots, why,
        tuple(mixed_buckets), mixed_seconds,
    )  # fmt: skip
    return runner, info


def log_weight_slots(info: RuntimeInfo, slot_bytes: int) -> None:
    """Say at start-up how hot-swap will commit, and why."""
    if info.num_weight_slots == 2:
        log.info(
            "weight slots: 2 (the standby slot costs %.0f MiB; a commit flips slots, no copy): %s",
            slot_bytes / 2**20, info.weight_slots_reason,
        )  # fmt: skip
    else:
        log.warning(
            "weight slots: 1 (%s): a hot-swap copies the new weights (%.0f MiB) in place "
            "between two steps, pausing serving for the copy, and recomputes requests in flight",
            info.weight_slots_reason, slot_bytes / 2**20,
        )  # fmt: skip


async def launch_engine(
    config: SitsdConfig,
    observer: EngineObserver | None = None,
    weights_version: str | None = None,
    cancel: threading.Event | None = None,
) -> AsyncEngine:
    """Build the engine on a new thread that then runs its step loop; returns once it serves.

    Every torch operation of the daemon thus happens on one thread: on the CPU, a model built
    on one thread and run on another ran each step ~1.5x slower (OpenMP thread teams are per
    calling thread and compete for the cores). Setting `cancel` stops the build at its next
    step (`BuildCancelled`); an engine built by then is dropped, its loop never run, so the
    thread always ends once this returns or raises.

    Raises:
        Whatever `build_engine` raises (bad model path, too little memory, ...).
    """
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[AsyncEngine] = loop.create_future()

    def settle(engine: AsyncEngine | None, exc: BaseException | None) -> None:
        if ready.done():  # cancelled: the daemon stopped while the model was loading
            return
        if exc is None:
            ready.set_result(engine)  # type: ignore[arg-type]
        else:
            ready.set_exception(exc)

    def build_and_run() -> None:
        try:
            engine = build_engine(
                config, observer=observer, weights_version=weights_version, cancel=cancel
            )
            _stop_if_cancelled(cancel)  # built just as the daemon stopped: nobody serves it
        except BaseException as exc:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                loop.call_soon_threadsafe(settle, None, exc)
            return
        engine.bind(loop)
        try:
            loop.call_soon_threadsafe(settle, engine, None)
        except RuntimeError:
            return
        engine.run_core()

    threading.Thread(target=build_and_run, name="sitsd-engine", daemon=True).start()
    return await ready


def _warm_up(runner: ModelRunner, num_tokens: int) -> None:
    """One prefill and one decode through the real path (first-touch memory, lazy inits)."""
    num_blocks = -(-(num_tokens + 1) // runner.block_size)
    warm = NewRequestData(
        req_id="warm-up",
        token_ids=list(range(1, num_tokens + 1)),
        num_prompt_tokens=num_tokens,
        params=SamplingParams(max_tokens=2, temperature=0.0),
        seed=0,
        block_ids=list(range(num_blocks)),
        num_computed_tokens=0,
        weights_version=runner.weights_version,
    )
    runner.execute(
        SchedulerOutput(
            new_reqs=[warm],
            num_scheduled_tokens={"warm-up": num_tokens},
            total_num_scheduled_tokens=num_tokens,
        )
    )
    runner.execute(
        SchedulerOutput(
            cached_reqs=[CachedRequestData("warm-up", [], num_tokens)],
            num_scheduled_tokens={"warm-up": 1},
            total_num_scheduled_tokens=1,
        )
    )
    runner.execute(SchedulerOutput(finished_req_ids={"warm-up"}))
