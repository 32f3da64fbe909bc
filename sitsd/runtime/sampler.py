"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Random draws use the exponential race (argmax of p / q with q ~ Exp(1), equivalent to sampling
from p). The noise is a counter-based hash of (request seed, output index, token id): splitmix64
computed for every row at once in int64 tensor arithmetic, the same on the CPU and the GPU, with
no generator object and no launch per row. A request's tokens therefore depend only on its own
seed and logits: the same seed gives the same output whatever else shares the batch, and a
request recomputed after preemption draws the same tokens again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sitsd.types import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# float32 holds bits + 0.5 exactly at 23 bits, so u = (bits + 0.5) / 2**23 lies in (0, 1), never
# 1: at 24 bits the top value rounded to u = 1, a noise of 0, and that token won the race
# whatever its probability (one row in ~340 at a 49k vocabulary).
_UNIFORM_BITS = 23


def mix_seed(seed: int, index: int) -> int:
    """A well-spread 64-bit seed for draw number `index` of a request (splitmix64)."""
    z = (seed + (index + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _signed(value: int) -> int:
    """A uint64 as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniform_bits(seeds: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seeds), vocab] int64: entry (i, j) is the top 23 bits of splitmix64 of `seeds[i]`
    advanced `j + 1` times. int64 multiplication wraps on both devices, so the bits are the
    same on the CPU and the GPU."""
    rows = _to_device([_signed(s) for s in seeds], torch.int64, device)
    steps = torch.arange(1, vocab + 1, dtype=torch.int64, device=device)
    z = steps.mul_(_signed(_GOLDEN))[None, :] + rows[:, None]  # [rows, vocab]
    scratch = torch.empty_like(z)  # in place from here: two [rows, vocab] int64 at most
    for bits, mult in ((30, _MIX1), (27, _MIX2), (31, 1)):
        torch.bitwise_right_shift(z, bits, out=scratch)
        z.bitwise_xor_(scratch.bitwise_and_((1 << (64 - bits)) - 1))  # logical shift
        if mult != 1:
            z.mul_(_signed(mult))
    return _shr(z, 64 - _UNIFORM_BITS)


def exponential_noise(seeds: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seeds), vocab] float32 Exp(1) draws, -log(u) of the uniforms u in (0, 1) that
    `uniform_bits` gives; row i is a function of seeds[i] alone."""
    bits = uniform_bits(seeds, vocab, device)
    return -torch.log((bits.to(torch.float32) + 0.5) * 2.0**-_UNIFORM_BITS)


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    draw_indices: Sequence[int],  # per row: how many tokens the request has sampled before
) -> list[int]:
    """One token id per row, as Python ints (a host sync)."""
    return sample_on_device(logits, params, seeds, draw_indices).tolist()


def sample_on_device(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    draw_indices: Sequence[int],
) -> torch.Tensor:  # [num_seqs] int64, on the logits' device; no host sync
    """One token id per row, left on the device."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = _to_device(random_rows, torch.int64, logits.device)
        picked = _sample_random(
            logits[rows],
            [params[i] for i in random_rows],
            [mix_seed(seeds[i], draw_indices[i]) for i in random_rows],
        )
        tokens[rows] = picked
    return tokens


def _sample_random(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
) -> torch.Tensor:  # [num_rows] int64
    device = logits.device
    temps = _to_device([p.temperature for p in params], torch.float32, device)
    x = logits / temps[:, None]
    top_ks = [min(p.top_k, x.shape[-1]) for p in params]
    if any(top_ks):
        x = _apply_top_k(x, top_ks)
    if any(p.top_p < 1.0 for p in params):
        top_ps = _to_device([p.top_p for p in params], torch.float32, device)
        x = _apply_top_p(x, top_ps)
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_ps = _to_device([p.min_p for p in params], torch.float32, device)
        # Drop what is less likely than min_p times the most likely token (which always stays).
        floor = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    return (probs / exponential_noise(seeds, probs.shape[-1], device)).argmax(dim=-1)


def _apply_top_k(x: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    values = torch.topk(x, max(top_ks), dim=-1).values  # [rows, max_k], descending
    k_index = _to_device([max(k, 1) - 1 for k in top_ks], torch.int64, x.device)
    threshold = values.gather(1, k_index[:, None])  # [rows, 1]
    off = _to_device([k == 0 for k in top_ks], torch.bool, x.device)
    threshold = threshold.masked_fill(off[:, None], float("-inf"))
    return x.masked_fill(x < threshold, float("-inf"))


def _apply_top_p(x: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    before = probs.cumsum(dim=-1) - probs
    drop_sorted = before >= top_ps[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def _to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a host sync (pinned source, async copy)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
