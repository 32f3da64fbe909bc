"""What every format converter needs: checks that name the checkpoint tensor, nibble unpacking,
and act-order permutations from `g_idx`.

All of it is torch arithmetic on the tensors' own device (a converter runs where the weights will
be served), and the value checks read values once (host syncs: load and staging only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sitsd.quant.errors import QuantFormatError

__all__ = [
    "HALF_DTYPES",
    "act_order_perm",
    "check_scales",
    "check_tensor",
    "unpack_nibbles",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    tensor: torch.Tensor | None,
    shape: tuple[int, ...],
    dtypes: Sequence[torch.dtype],
    layout: str,
) -> torch.Tensor:
    """Raise `QuantFormatError` unless `tensor` exists with `shape` (`layout` names its
    dimensions) and one of `dtypes`; return it."""
    if tensor is None:
        raise QuantFormatError(f"{name} is missing")
    if tuple(tensor.shape) != tuple(shape):
        raise QuantFormatError(
            f"{name} has shape {tuple(tensor.shape)}, expected {layout} = {tuple(shape)}"
        )
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise QuantFormatError(f"{name} has dtype {tensor.dtype}, expected one of ({names})")
    return tensor


def check_scales(name: str, scales: torch.Tensor, *, allow_zero: bool = False) -> None:
    """Raise `QuantFormatError` when `scales` holds NaN or Inf, or (unless `allow_zero`) zeros."""
    if not bool(torch.isfinite(scales).all()):
        raise QuantFormatError(f"{name} holds NaN or Inf values")
    if not allow_zero:
        zeros = int((scales == 0).sum())
        if zeros:
            raise QuantFormatError(f"{name} holds {zeros} zero scales")


def unpack_nibbles(words: torch.Tensor, order: Sequence[int] | None = None) -> torch.Tensor:
    """`[..., W]` int32 words -> `[..., 8 W]` uint8 codes, eight per word along the last axis.

    Without `order`, code i of a word is bits 4i..4i+3; with it, code c is the nibble at
    position `order[c]` (AWQ interleaves its columns).
    """
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., W, 8] by position
    if order is not None:
        nibbles = nibbles[..., list(order)]
    return nibbles.reshape(*words.shape[:-1], -1).to(torch.uint8)


def act_order_perm(
    g_idx: torch.Tensor | None, k: int, group_size: int, name: str
) -> torch.Tensor | None:
    """The layout's permutation for `g_idx` (the group of each input channel), or None when the
    groups are already consecutive runs of `group_size` channels.

    Sorting the channels by group (stably) makes the groups contiguous; that works when each
    group has exactly `group_size` channels (the last one what is left), as GPTQ's act-order
    writes them. Raises `QuantFormatError` otherwise.
    """
    if g_idx is None:
        return None
    check_tensor(name, g_idx, (k,), (torch.int32, torch.int64), "[K]")
    expected = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), expected):
        return None
    perm = torch.sort(g_idx.long(), stable=True).indices
    if not torch.equal(g_idx.long()[perm], expected):
        raise QuantFormatError(
            f"{name} does not put {group_size} input channels in each group (group_size): "
            "sitsd cannot make its groups contiguous"
        )
    return perm.to(torch.int32)
