"""A kernel set with one family of a decode step's kernels left out, for timing the rest.

`bench.profile_decode --without linears|others` recaptures the decode graphs with it: the
replay of what is left, beside the full step's, says what the family costs in place (its
kernels and the launch boundaries around them), which the profiler's per-kernel times do not
under PDL (a kernel's time there includes its wait for the one before).

- "linears": the layers' projections (qkv, o, gate_up, down) write nothing: each returns an
  uninitialised tensor of its output's shape, allocated from the graph's pool (no kernel). The
  norms before qkv and gate_up and the SwiGLU activation still run; the lm_head runs.
- "others": the norms, the rotary + cache write, attention and the SwiGLU activation pass
  their input on (or an uninitialised tensor of their output's shape); the projections and the
  lm_head run on whatever arrives.
- "norms", "rotary", "attention", "swiglu": one of those four alone (the RMSNorms with their
  residual adds; the rotary + cache write; attention; the SwiGLU activation), so that what a
  fusion of it into a neighbour could save at most is measured before the fusion is written.

The values are garbage either way: timing only. A dense 16-bit model at one row runs its SwiGLU
inside the down projection's kernel (`swiglu_linear`), so "linears" leaves it out with down.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from sitsd.model.ops import KernelSet, norm_linear
from sitsd.quant.linear import LinearWeight

# The small kernels, each family alone; "others" is all four.
_SMALL = ("norms", "rotary", "attention", "swiglu")
FAMILIES = ("linears", "others", *_SMALL)


def without(kernels: KernelSet, family: str, lm_head: LinearWeight) -> KernelSet:
    """`kernels` with `family` (one of `FAMILIES`) left out (see the module docstring)."""
    if family == "linears":
        linear = partial(_no_linear, kernels, lm_head)
        return dataclasses.replace(
            kernels,
            linear=linear,
            swiglu_linear=partial(_no_swiglu_linear, kernels),
            norm_linear=partial(norm_linear, kernels.rms_norm, kernels.fused_add_rms_norm, linear),
        )
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    left_out = _SMALL if family == "others" else (family,)
    changes: dict[str, object] = {}
    if "norms" in left_out:
        changes.update(
            rms_norm=_first,
            fused_add_rms_norm=_no_add_norm,
            norm_linear=partial(norm_linear, _first, _no_add_norm, kernels.linear),
        )
    if "rotary" in left_out:
        changes.update(rotary_and_cache=_no_rotary)
    if "attention" in left_out:
        changes.update(decode_attention=_no_attention)
    if "swiglu" in left_out:
        changes.update(silu_and_mul=_no_silu, swiglu_linear=partial(_linear_only_swiglu, kernels))
    return dataclasses.replace(kernels, **changes)  # type: ignore[arg-type]


def _output(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:  # [T, N]
    return torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)


def _no_linear(
    kernels: KernelSet,
    lm_head: LinearWeight,
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    *,
    unsummed: bool = False,
) -> torch.Tensor:
    if weight is lm_head:
        return kernels.linear(x, weight, bias)
    return _output(x, weight)


def _no_swiglu_linear(
    kernels: KernelSet, gate_up: torch.Tensor, weight: LinearWeight, *, unsummed: bool = False
) -> torch.Tensor:
    if isinstance(weight, torch.Tensor) and weight.dtype == gate_up.dtype:
        return _output(gate_up, weight)  # a dense weight's SwiGLU may be down's own kernel
    return _output(kernels.silu_and_mul(gate_up), weight)


def _first(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return x


def _no_add_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x, residual)`; for a split layer's float32 partials `[parts, T, N]` a `[T, N]` stand-in."""
    return (torch.empty_like(residual) if x.dim() == residual.dim() + 1 else x), residual


def _no_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,  # [(parts,) T, heads, head_dim]
    key: torch.Tensor,
    *args: object,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if query.dim() == 4:  # a split layer's partials
        return torch.empty(query.shape[1:], dtype=dtype, device=query.device), key[0]
    return query, key


def _no_attention(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(query)


def _no_silu(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    return torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)


def _linear_only_swiglu(
    kernels: KernelSet, gate_up: torch.Tensor, weight: LinearWeight, *, unsummed: bool = False
) -> torch.Tensor:
    return kernels.linear(_no_silu(gate_up), weight, unsummed=unsummed)
