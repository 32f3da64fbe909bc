"""Random INT4 weights in `sitsd.kernels.quant_layout` for the INT4 kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sitsd.kernels.quant_layout import num_groups, pack_int4

# (N, K) of the linear layers, GQA included: Llama-3-8B (32 q / 8 kv heads of 128) and
# SmolLM2-135M (9 q / 3 kv heads of 64; K = 576 is not a multiple of 128: its last group is short).
LLAMA3_8B_SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
SMOLLM2_SHAPES = {
    "qkv": (960, 576),
    "kv": (192, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
}


@dataclass
class Int4Case:
    """An INT4 weight's tensors, in the order the kernels take them."""

    qweight: torch.Tensor  # [N, K // 8] int32
    scales: torch.Tensor  # [G, N]
    offsets: torch.Tensor | None  # [G, N]
    group_size: int
    perm: torch.Tensor | None  # [K] int32

    @property
    def args(self) -> tuple:
        return (self.qweight, self.scales, self.offsets, self.group_size, self.perm)


def random_int4(
    n: int,
    k: int,
    group_size: int,
    *,
    offsets: bool,
    perm: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> Int4Case:
    """Uniform codes, scales giving W a standard deviation of about 1/sqrt(K) (outputs of order
    1), offsets `-z * scale` for random zero points z, a random act-order permutation."""
    codes = torch.randint(0, 16, (n, k), device=device)
    groups = num_groups(k, group_size)
    scales = ((torch.rand(groups, n, device=device) + 0.5) / (4.6 * k**0.5)).to(scale_dtype)
    offs = None
    if offsets:
        zeros = torch.randint(0, 16, (groups, n), device=device).float()
        offs = -(zeros * scales.float())
    order = torch.randperm(k, device=device).to(torch.int32) if perm else None
    return Int4Case(pack_int4(codes), scales, offs, group_size, order)
