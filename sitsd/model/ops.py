"""The set of kernels a model runs with, chosen once per runner and passed in explicitly.

On the CPU the model runs `sitsd.model.cpu_kernels` (the plain-PyTorch references of
`sitsd.kernels.reference`, with fewer torch ops where dispatch cost shows); on CUDA, the Triton
kernels of `sitsd.kernels`. All take and return the same tensors, so the model code is one
code path. The three linears take a weight in any form (`sitsd.model.qlinear`: dense tensors
to the set's own 16-bit path, quantized layouts to their kernels). No module-level switch: a
`KernelSet` belongs to the object that uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
import torch.nn.functional as F

from sitsd.kernels import reference
from sitsd.model.qlinear import QuantizedLinears, any_linear, any_norm_linear, any_swiglu_linear
from sitsd.model.routing import pdl_pays

T = TypeVar("T")


@dataclass(frozen=True)
class KernelSet:
    """Callables with the signatures of the functions in `sitsd.kernels.reference`."""

    name: str
    decode_attention: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    # (x, residual, weight, eps) -> (normed, residual); on CUDA x may also be a split layer's
    # float32 partials (`qlinear.split_partials`), which the Triton kernel sums
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # RoPE on Q and K, then the K/V cache write (`reference.rotary_and_cache_ref`): one Triton
    # launch, which on CUDA also takes a split QKV layer's float32 partials and the `dtype` to
    # sum them into; the CPU runs the two halves (`cpu_kernels.rotary_embedding`,
    # `.reshape_and_cache`)
    rotary_and_cache: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    # The linears take a dense or quantized weight (`sitsd.quant.linear.LinearWeight`), and
    # `unsummed=True` where the next kernel sums split partials (`qlinear.any_linear`):
    linear: Callable[..., torch.Tensor]  # F.linear(x, weight, bias=None)
    swiglu_linear: Callable[..., torch.Tensor]  # F.linear(silu_and_mul(gate_up), weight)
    # (hidden, residual | None, norm_weight, eps, weight, bias=None, *, unsummed=False) ->
    # (out, residual): the pre-norm projection, `norm_linear` below or a fused kernel
    norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # What the kernels keep between launches (split counters they leave zero, the INT4
    # dequantize workspace): two sets whose forwards run at the same time, on two streams,
    # must not share one (`triton_kernels` makes them for each set).
    scratch: tuple[torch.Tensor, ...] = ()


def _linears(
    dense_linear: Callable[..., torch.Tensor],
    dense_swiglu: Callable[..., torch.Tensor],
    dense_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    silu: Callable[[torch.Tensor], torch.Tensor],
    rms_norm: Callable[..., torch.Tensor],
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    quantized: QuantizedLinears,
) -> dict[str, Callable[..., torch.Tensor] | Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """The set's three linears over weights in any form (`sitsd.model.qlinear`)."""
    linear = partial(any_linear, dense_linear, quantized)
    return {
        "linear": linear,
        "swiglu_linear": partial(any_swiglu_linear, dense_swiglu, silu, linear),
        "norm_linear": partial(
            any_norm_linear, dense_norm_linear, partial(norm_linear, rms_norm, add_rms_norm, linear)
        ),
    }


def swiglu_linear(
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    gate_up: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """The MLP's down projection of the SwiGLU activation, unfused."""
    return F.linear(silu_and_mul(gate_up), weight)


def norm_linear(
    rms_norm: Callable[..., torch.Tensor],
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    linear: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    unsummed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm projection, unfused: `residual = hidden + residual` (no add without a
    residual: `hidden` becomes it), RMSNorm, then `linear`; returns `(out, residual)`.
    `unsummed` goes to a linear that takes it (`qlinear.any_linear`), and only when set."""
    if residual is None:
        x, residual = rms_norm(hidden, norm_weight, eps), hidden
    else:
        x, residual = fused_add_rms_norm(hidden, residual, norm_weight, eps)
    if unsummed:
        return linear(x, weight, bias, unsummed=True), residual
    return linear(x, weight, bias), residual


def with_pdl(
    kernel: Callable[..., T], pdl: bool, rows: torch.Tensor, *args: object, **kwargs: object
) -> T:
    """`kernel(rows, *args, pdl=..., **kwargs)`: programmatic dependent launch when `pdl` is on
    and it measured faster for the call's first dimension (tokens, or sequences for decode
    attention: `pdl_pays`)."""
    return kernel(rows, *args, pdl=pdl and pdl_pays(rows.shape[0]), **kwargs)


def add_norm_with_pdl(
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    pdl: bool,
    x: torch.Tensor,
    residual: torch.Tensor,
    *args: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`with_pdl` for the add + RMSNorm, by the residual's rows: x may be split partials
    `[parts, tokens, hidden]`, whose first dimension is not the tokens."""
    return kernel(x, residual, *args, pdl=pdl and pdl_pays(residual.shape[0]))


def reference_kernels() -> KernelSet:
    """The plain-PyTorch kernels (CPU, and the correctness baseline anywhere)."""
    return KernelSet(
        name="reference",
        decode_attention=reference.decode_attention_ref,
        prefill_attention=reference.prefill_attention_ref,
        rms_norm=reference.rms_norm_ref,
        fused_add_rms_norm=reference.fused_add_rms_norm_ref,
        rotary_and_cache=reference.rotary_and_cache_ref,
        silu_and_mul=reference.silu_and_mul_ref,
        **_linears(
            F.linear, partial(swiglu_linear, reference.silu_and_mul_ref),
            partial(norm_linear, reference.rms_norm_ref, reference.fused_add_rms_norm_ref,
                    F.linear),
            reference.silu_and_mul_ref, reference.rms_norm_ref, reference.fused_add_rms_norm_ref,
            QuantizedLinears(),
        ),  # type: ignore[arg-type]
    )  # fmt: skip


def cpu_kernels() -> KernelSet:
    """The kernels the CPU runner uses: the references' results, fewer torch ops."""
    from sitsd.model import cpu_kernels as k

    return KernelSet(
        name="cpu",
        decode_attention=k.decode_attention,
        prefill_attention=k.prefill_attention,
        rms_norm=k.rms_norm,
        fused_add_rms_norm=k.fused_add_rms_norm,
        rotary_and_cache=k.rotary_and_cache,
        silu_and_mul=k.silu_and_mul,
        **_linears(
            F.linear, partial(swiglu_linear, k.silu_and_mul),
            partial(norm_linear, k.rms_norm, k.fused_add_rms_norm, F.linear),
            k.silu_and_mul, k.rms_norm, k.fused_add_rms_norm, QuantizedLinears(),
        ),  # type: ignore[arg-type]
    )  # fmt: skip


def triton_kernels(
    use_gemv: bool | None = None,
    pdl: bool | None = None,
    split_counters: torch.Tensor | None = None,
    int4_workspace: torch.Tensor | None = None,
    int4_split_counters: torch.Tensor | None = None,
) -> KernelSet:
    """The Triton kernels of `sitsd.kernels` (CUDA; the CPU interpreter runs them in tests).

    Linear layers go to cuBLAS, or to the Triton `gemv` and `skinny_gemm` for the shapes and
    row counts where they measured faster (`sitsd.model.linear`); `use_gemv` None: where those
    tables were measured (an sm_90 device), False: never, True: wherever the tables say
    (tests).

    `pdl`: the decode kernels (norms, gemv, skinny_gemm, rotary + cache write, decode
    attention, SwiGLU) are launched with programmatic dependent launch (`kernels/_pdl.py`) at
    the row counts where it measured faster (`pdl_pays`); None: where the CUDA device
    supports it (sm_90+).

    `split_counters` (int32 zeros on the device, one per decode sequence x kv head, owned by
    the model runner): decode attention's splits merge their partials themselves, one launch
    instead of two per layer (`decode_attention`); None: a reduce kernel merges them.

    `int4_workspace` (the runner's, in the activations' dtype, as large as its largest INT4
    linear): long prefill chunks run INT4 layers as dequantize + cuBLAS in it
    (`qlinear.QuantizedLinears`); None: `int4_matmul` at every row count.

    `int4_split_counters` (int32 zeros on the device, the runner's): `int4_matmul`'s split-K
    partials summed by each tile's last program instead of a second kernel, for the calls
    whose tiles they cover (`qlinear.QuantizedLinears`). INT4 layers take PDL as the others.
    """
    from sitsd.kernels._utils import supports_pdl
    from sitsd.kernels.activation import silu_and_mul
    from sitsd.kernels.decode_attention import decode_attention
    from sitsd.kernels.prefill_attention import prefill_attention
    from sitsd.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    from sitsd.kernels.rotary_cache import rotary_and_cache
    from sitsd.model.linear import TunedLinear, measured_device

    pdl = supports_pdl() if pdl is None else pdl
    norm = partial(with_pdl, rms_norm, pdl)
    add_norm = partial(add_norm_with_pdl, fused_add_rms_norm, pdl)
    swiglu = partial(with_pdl, silu_and_mul, pdl)
    tuned = TunedLinear(
        measured_device() if use_gemv is None else use_gemv,
        swiglu,
        partial(norm_linear, norm, add_norm),
        pdl=pdl,
    )
    return KernelSet(
        name="triton-pdl" if pdl else "triton",
        decode_attention=partial(
            with_pdl, partial(decode_attention, split_counters=split_counters), pdl
        ),
        prefill_attention=prefill_attention,
        rms_norm=norm,
        fused_add_rms_norm=add_norm,
        rotary_and_cache=partial(with_pdl, rotary_and_cache, pdl),
        silu_and_mul=swiglu,
        **_linears(
            tuned.linear, tuned.swiglu_linear, tuned.norm_linear, swiglu, norm,
            add_norm, QuantizedLinears(int4_workspace, pdl, int4_split_counters),
        ),  # type: ignore[arg-type]
        scratch=tuple(t for t in (split_counters, int4_workspace, int4_split_counters)
                      if t is not None),
    )  # fmt: skip
