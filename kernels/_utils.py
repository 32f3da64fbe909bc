"""Argument checks and small helpers shared by the Triton kernel wrappers.

Every public wrapper in this folder validates its inputs here before it launches anything, so a
wrong dtype, shape, device or stride fails with a message that names the argument instead of a
crash or a silent wrong answer inside a kernel. Nothing here reads tensor *values* (that would
sync the host and break CUDA-graph capture), and nothing here imports triton: the import-free
helpers keep `sitsd.kernels` importable where triton is missing. Launch configuration lives with
each kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_dtype(name: str, tensor: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    """Raise `TypeError` unless `tensor.dtype` is one of `allowed`."""
    allowed = tuple(allowed)
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {tensor.dtype}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Raise `TypeError` unless all keyword tensors share one dtype."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"dtypes must match: {dtypes}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    """Raise `ValueError` unless `tensor` has `ndim` dimensions; `layout` documents them."""
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    """Raise `ValueError` unless `tensor.shape == shape`; `layout` names the dimensions."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(tensor.shape)}"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise `ValueError` unless all keyword tensors live on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device: {devices}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Raise `ValueError` unless the last dimension has stride 1 (vector loads need it)."""
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}"
        )


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Raise `ValueError` unless `tensor` is contiguous."""
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def check_out(
    name: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """Validate a caller-provided output buffer (CUDA graphs preallocate them)."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {tuple(shape)} on {device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    check_contiguous(name, out)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= `n` (1 for n <= 1); Triton tiles must be powers of two."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of positive ints."""
    return -(-a // b)


def runs_in_interpreter(tensor: torch.Tensor) -> bool:
    """True when `tensor` lives on the CPU, where Triton only runs under TRITON_INTERPRET=1."""
    return tensor.device.type == "cpu"


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132 on an H200); 1 for the CPU interpreter.

    torch caches the device properties itself, so this is cheap enough to call per launch.
    """
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
