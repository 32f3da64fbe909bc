"""The hardware floors every ratio in `bench/` is taken against, and a model's floors from them.

Measured on the GPU the benchmark runs on, in the same run, on random data, timed with
`bench.timing.median_ms` (CUDA events, 3 warm-up calls, median of 20):

- `copy_bandwidth()`: a device-to-device copy of a 4 GiB float32 tensor, bytes read + written
  over time, in bytes/s;
- `matmul_rate()`: an 8192^3 bf16 matmul, 2 x 8192^3 FLOPs over time, in FLOP/s;
- `fp8_matmul_rate()`: the same in FP8 e4m3 (`torch._scaled_mm`, row-wise float32 scales,
  bf16 out), the compute floor of W8A8.

Each frees its tensors on return (to the caching allocator; `torch.cuda.empty_cache()` is the
caller's when the memory must go back). From the two:

- `decode_step_floor_s`: a decode step's floor = max(bytes it must read / copy bandwidth,
  2 x non-embedding parameters x batch / matmul rate);
- `prefill_flops`: a prefill's FLOPs (linears and causal attention), for its floor.
"""

from __future__ import annotations

import functools

import torch

from bench.timing import median_ms
from sitsd.model.arch import LlamaArch

COPY_ELEMENTS = 2**30  # float32: a 4 GiB source, far past any L2
MATMUL_SIZE = 8192


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write), 4 GiB source."""
    src = torch.randn(COPY_ELEMENTS, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(functools.partial(dst.copy_, src), clock="cuda")
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def matmul_rate() -> float:
    """FLOP/s of an 8192^3 bf16 matmul on random data."""
    n = MATMUL_SIZE
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(functools.partial(torch.matmul, a, b), clock="cuda")
    return 2 * n**3 / (ms / 1e3)


def fp8_matmul_rate() -> float:
    """FLOP/s of an 8192^3 e4m3 matmul with row-wise scales (bf16 out) on random data."""
    n = MATMUL_SIZE
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).T  # column-major (cuBLASLt)
    scale_a = torch.ones(n, 1, device="cuda")
    scale_b = torch.ones(1, n, device="cuda")
    call = functools.partial(torch._scaled_mm, a, b, scale_a=scale_a, scale_b=scale_b,
                             out_dtype=torch.bfloat16)  # fmt: skip
    ms = median_ms(call, clock="cuda")
    return 2 * n**3 / (ms / 1e3)


def non_embedding_params(arch: LlamaArch) -> int:
    """Parameters a decode step reads whole: all but an untied embedding table (of which it
    reads one row per sequence; a tied table is read whole as the lm_head)."""
    untied_table = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return arch.num_parameters - untied_table


def kv_read_bytes(arch: LlamaArch, batch: int, context: float) -> float:
    """Bytes of bf16 KV one decode step reads: every context of `batch` at a mean `context`."""
    return batch * context * arch.kv_bytes_per_token(2)


def decode_step_floor_s(
    arch: LlamaArch, batch: int, context: float, bw: float, mm: float
) -> tuple[float, float, float]:
    """(floor, memory floor, compute floor) in seconds of one bf16 decode step of `batch`
    sequences at a mean `context`, for copy bandwidth `bw` (bytes/s) and matmul rate `mm`."""
    weight_bytes = 2 * non_embedding_params(arch)
    kv_bytes = kv_read_bytes(arch, batch, context)
    memory = (weight_bytes + kv_bytes) / bw
    compute = 2 * non_embedding_params(arch) * batch / mm
    return max(memory, compute), memory, compute


def prefill_flops(arch: LlamaArch, num_seqs: int, prompt: int) -> float:
    """FLOPs of prefilling `num_seqs` prompts of `prompt` tokens (no cached prefix)."""
    linear = 2 * non_embedding_params(arch) * num_seqs * prompt
    # causal attention: QK^T and PV over half the square, per layer and head
    attention = 2 * 2 * arch.num_layers * arch.num_heads * arch.head_dim * prompt**2 / 2
    return linear + attention * num_seqs
