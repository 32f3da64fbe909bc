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


def check_paged_attention(
    query: torch.Tensor,
    query_layout: str,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    **index_tensors: torch.Tensor,
) -> None:
    """The checks every paged-attention wrapper makes: `query` [rows, num_heads, head_dim]
    (`query_layout` names its rows), the caches [num_blocks, block_size, num_kv_heads,
    head_dim] in query's float dtype, one int32 `block_tables` row and `seq_lens` entry for
    each of `num_seqs` sequences, and further int32 `index_tensors`, all on one device with
    unit last strides. Shapes of the `index_tensors` are the caller's to check."""
    check_ndim("query", query, 3, query_layout)
    check_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    _, num_heads, head_dim = query.shape
    num_kv_heads, cache_head_dim = key_cache.shape[2:]
    check_shape("value_cache", value_cache, tuple(key_cache.shape), "key_cache's shape")
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim differs: query {head_dim}, key_cache {cache_head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} seqs")
    check_shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    check_dtype("query", query, FLOAT_DTYPES)
    check_same_dtype(query=query, key_cache=key_cache, value_cache=value_cache)
    indices = {"block_tables": block_tables, "seq_lens": seq_lens, **index_tensors}
    for name, t in indices.items():
        check_dtype(name, t, (torch.int32,))
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache, **indices)
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables)):  # fmt: skip
        check_last_dim_contiguous(name, t)
    for name, t in indices.items():
        if name != "block_tables":
            check_contiguous(name, t)


def check_pdl(pdl: bool, tensor: torch.Tensor) -> None:
    """Raise `ValueError` when `pdl` (programmatic dependent launch, `kernels/_pdl.py`) is asked
    for off a CUDA device of compute capability 9.0 or newer."""
    if pdl and not supports_pdl(tensor.device):
        raise ValueError(
            f"pdl needs a CUDA device of compute capability >= 9.0, got {tensor.device}"
        )


def supports_pdl(device: torch.device | str | None = None) -> bool:
    """Whether kernels on `device` may be launched with programmatic dependent launch."""
    device = torch.device("cuda" if device is None else device)
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def check_small_linear(
    kernel: str, x: torch.Tensor, weight: torch.Tensor, max_rows: int, *, swiglu: bool = False
) -> None:
    """Raise unless `x @ weight.T` fits a small-batch linear kernel (`gemv`, `skinny_gemm`):
    2-D float tensors of one dtype and device, `x` `[M, K]` (with `swiglu` the fused
    `[M, 2 * K]`) contiguous in its last dimension, `weight` `[N, K]` contiguous, M <= max_rows.
    """
    layout = "[M, 2 * K] (fused gate | up)" if swiglu else "[M, K]"
    check_ndim("x", x, 2, layout)
    check_ndim("weight", weight, 2, "[N, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_same_dtype(x=x, weight=weight)
    check_same_device(x=x, weight=weight)
    check_last_dim_contiguous("x", x)
    check_contiguous("weight", weight)
    k = weight.shape[1]
    if x.shape[1] != (2 * k if swiglu else k):
        raise ValueError(
            f"x must have shape {layout} for weight [N, K] = {tuple(weight.shape)}, "
            f"got {tuple(x.shape)}"
        )
    if x.shape[0] > max_rows:
        raise ValueError(
            f"{kernel} is a small-batch kernel: x has {x.shape[0]} rows, at most {max_rows}"
        )
