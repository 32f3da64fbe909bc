"""KV pool sizing and allocation: one tensor for every layer's K and V blocks."""

from __future__ import annotations

import torch

from sitsd.model.arch import LlamaArch


def bytes_per_block(arch: LlamaArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers, K and V."""
    return block_size * arch.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def num_blocks_for_budget(
    arch: LlamaArch, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many blocks fit in `budget_bytes`."""
    return budget_bytes // bytes_per_block(arch, block_size, dtype)


def allocate_kv_caches(
    arch: LlamaArch,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim].

    One allocation backs all of them, so the pool is contiguous and its size is exact.
    """
    pool = torch.zeros(
        arch.num_layers,
        2,
        num_blocks,
        block_size,
        arch.num_kv_heads,
        arch.head_dim,
        dtype=dtype,
        device=device,
    )  # zeros, not empty: a kernel reading an unwritten slot sees 0, never NaN from old memory
    return [(pool[i, 0], pool[i, 1]) for i in range(arch.num_layers)]


def cuda_used_outside_torch(device: torch.device) -> int:
    """Device memory in use that torch's allocator in this process does not hold: this
    process's CUDA context and library workspaces, and every other process on the device."""
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) - torch.cuda.memory_reserved(device)


def gpu_kv_budget(
    device: torch.device,
    gpu_memory_utilization: float,
    gpu_memory_limit: int,
    peak_torch_bytes: int,
    reserve_bytes: int,
    baseline_outside_torch: int,
) -> int:
    """Bytes the KV pool may take on the GPU, after the profiling pass measured the peak.

    The budget is `utilization x visible memory` (the whole device, a MIG slice as the driver
    reports it, or `--gpu-memory-limit`) minus what the runner holds anyway: the peak of torch's
    allocations in the profiling forward pass (weights + activations), what memory outside
    torch's allocator grew by since `baseline_outside_torch` was measured (at the start of the
    build: cuBLAS workspaces, Triton modules), and `reserve_bytes` for the CUDA graphs. Memory
    held at the baseline (the CUDA context, other processes) is not counted against the budget,
    as vLLM does; it can still make the device too full, which the `free` bound below catches.
    """
    free, total = torch.cuda.mem_get_info(device)
    visible = min(gpu_memory_limit, total) if gpu_memory_limit else total
    grown = max(0, cuda_used_outside_torch(device) - baseline_outside_torch)
    budget = int(visible * gpu_memory_utilization) - peak_torch_bytes - grown - reserve_bytes
    # Never plan on memory another process holds right now.
    return min(budget, free - reserve_bytes)
