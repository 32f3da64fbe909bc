"""Memory planning at start-up: the profiling pass (the peak a largest step allocates), whether
a second weight slot fits beside the KV pool, and how many KV blocks the pool gets (shortening
the served context when the pool is too small and no length was asked for).
"""

from __future__ import annotations

import logging

import torch

from sitsd.config import CacheConfig, ConfigError, ModelConfig, SitsdConfig
from sitsd.model.arch import LlamaArch
from sitsd.model.llama import LlamaModel, LlamaWeights
from sitsd.runtime.input_batch import CachedRequestState, build_step_inputs
from sitsd.runtime.kv_cache import allocate_kv_caches, bytes_per_block, num_blocks_for_budget
from sitsd.types import SamplingParams

log = logging.getLogger(__name__)


def decide_weight_slots(
    config: SitsdConfig, device: torch.device, slot_bytes: int, kv_floor: int, reserve: int
) -> tuple[int, str]:
    """(1 or 2 weight slots, why): 2 when a second copy of the weights fits next to the KV pool.

    CUDA: the memory sitsd may still use (`--gpu-memory-utilization` of the visible device,
    less what is allocated) must hold the second slot, one full-length request's KV
    (`kv_floor`) and `reserve`. CPU: the machine's available memory must hold the second slot
    and the KV pool. `--weight-slots 1|2` decides instead of measuring.

    Raises:
        ValueError: `--weight-slots 2` and two slots do not fit.
    """
    mode = config.weights.weight_slots
    ccfg = config.cache
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        visible = min(ccfg.gpu_memory_limit, total) if ccfg.gpu_memory_limit else total
        room = min(int(visible * ccfg.gpu_memory_utilization)
                   - torch.cuda.memory_allocated(device), free)  # fmt: skip
        need = slot_bytes + kv_floor + reserve
    else:
        room = mem_available_bytes()
        need = slot_bytes + ccfg.kv_cache_memory
    fits = room >= need
    measured = f"{need / 2**20:.0f} MiB needed, {room / 2**20:.0f} MiB available"
    if mode == "1":
        return 1, "--weight-slots 1"
    if mode == "2":
        if not fits and device.type == "cuda":
            raise ConfigError(f"--weight-slots 2: two weight slots do not fit ({measured})")
        return 2, "--weight-slots 2"
    return (
        (2, f"a second slot fits ({measured})")
        if fits
        else (1, f"not enough memory for a second slot ({measured})")
    )


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo; very large where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2**62


def profile_requests(
    num_tokens: int, max_model_len: int, block_size: int, vocab_size: int
) -> tuple[list[CachedRequestState], int]:
    """(prompts, blocks they use) for the profiling step: `num_tokens` tokens in prompts of at
    most `max_model_len`, each on blocks of its own."""
    states, next_block = [], 0
    for i, start in enumerate(range(0, num_tokens, max_model_len)):
        length = min(max_model_len, num_tokens - start)
        blocks = -(-length // block_size)
        states.append(CachedRequestState(
            f"profile-{i}", [(start + t) % vocab_size for t in range(length)], length,
            SamplingParams(), 0, list(range(next_block, next_block + blocks)), 0,
        ))  # fmt: skip
        next_block += blocks
    return states, next_block


def profile_peak_memory(
    model: LlamaModel,
    weights: LlamaWeights,
    arch: LlamaArch,
    config: SitsdConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_tokens: int,
    max_model_len: int,
) -> int:
    """Peak bytes torch allocates for the largest step: `num_tokens` prompt tokens, split into
    prompts of at most `max_model_len` (no position past the served context: the rotary table
    has `max_model_len` rows)."""
    block_size = config.cache.block_size
    states, num_blocks = profile_requests(num_tokens, max_model_len, block_size, arch.vocab_size)
    kv = allocate_kv_caches(arch, num_blocks, block_size, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    inputs = build_step_inputs(
        states, {s.req_id: s.num_prompt_tokens for s in states}, block_size, device
    )
    with torch.inference_mode():
        hidden = model.forward(weights, inputs.input_ids, inputs.positions, inputs.meta, kv)
        rows = min(num_tokens, config.scheduler.max_num_seqs)
        model.compute_logits(weights, hidden[:rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del kv, hidden, inputs
    torch.cuda.empty_cache()
    return peak


def size_kv_pool(
    cfg: CacheConfig, mcfg: ModelConfig, arch: LlamaArch, dtype: torch.dtype, max_model_len: int
) -> tuple[int, int]:
    """(num_blocks, max_model_len): a pool too small for one full-length request shortens the
    served context when the user did not ask for a length, and is an error when they did."""
    num_blocks = cfg.num_blocks or num_blocks_for_budget(
        arch, cfg.block_size, dtype, cfg.kv_cache_memory
    )
    capacity = num_blocks * cfg.block_size
    if capacity >= max_model_len:
        return num_blocks, max_model_len
    if mcfg.max_model_len or capacity < 2 * cfg.block_size:
        per_block = bytes_per_block(arch, cfg.block_size, dtype)
        needed = -(-max_model_len // cfg.block_size)
        raise ConfigError(
            f"the KV pool holds {num_blocks} blocks ({capacity} tokens) but one "
            f"{max_model_len}-token request needs {needed}; raise --kv-cache-memory to at least "
            f"{needed * per_block / 2**20:.0f}MiB or lower --max-model-len"
        )
    log.warning(
        "the KV pool holds %d tokens: serving a context of %d instead of the model's %d "
        "(raise --kv-cache-memory for more)",
        capacity,
        capacity,
        max_model_len,
    )
    return num_blocks, capacity
