"""The set of kernels a model runs with, chosen once per runner and passed in explicitly.

On the CPU the model runs the plain-PyTorch references of `sitsd.kernels.reference`; on CUDA,
the Triton kernels of `sitsd.kernels`. Both take and return the same tensors, so the model code
is one code path. No module-level switch: a `KernelSet` belongs to the object that uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sitsd.kernels import reference


@dataclass(frozen=True)
class KernelSet:
    """Callables with the signatures of the functions in `sitsd.kernels.reference`."""

    name: str
    reshape_and_cache: Callable[..., None]
    decode_attention: Callable[..., object]
    prefill_attention: Callable[..., object]
    rms_norm: Callable[..., object]
    fused_add_rms_norm: Callable[..., object]
    rotary_embedding: Callable[..., object]
    silu_and_mul: Callable[..., object]


def reference_kernels() -> KernelSet:
    """The plain-PyTorch kernels (CPU, and the correctness baseline anywhere)."""
    return KernelSet(
        name="reference",
        reshape_and_cache=reference.reshape_and_cache_ref,
        decode_attention=reference.decode_attention_ref,
        prefill_attention=reference.prefill_attention_ref,
        rms_norm=reference.rms_norm_ref,
        fused_add_rms_norm=reference.fused_add_rms_norm_ref,
        rotary_embedding=reference.rotary_embedding_ref,
        silu_and_mul=reference.silu_and_mul_ref,
    )
