"""A trainer's tensors as each transport sends them: the table, chunks, IPC fields, buckets.

Pure functions of the tensors (no channel): `tensor_table` is the header every push starts with
(name, dtype, shape, in order); `chunk_messages` cuts a tensor's bytes into the serialized
messages of a gRPC stream; `ipc_tensors` takes torch's own CUDA IPC reduction apart into proto
fields (no pickle on the wire; each storage reduced once), and `flat_copy` makes the tensors
views of one allocation first; `bucket_layout` packs tensors into broadcasts for a weight
group. What the daemon does with them is `sitsd.weights.push`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from sitsd.api.v1 import admin_pb2

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ALIGN = 16  # bytes: where a tensor may start in a bucket (the daemon checks it)
# Wire tags (field number << 3 | 2, length-delimited): UpdateWeightsRequest.chunk (2) and
# TensorChunk.data (2).
_CHUNK_TAG = _DATA_TAG = bytes([2 << 3 | 2])

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_list(
    tensors: NamedTensors, dtype: torch.dtype | None = None
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, detached, in the caller's order; cast to `dtype` if given."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out = []
    for name, tensor in items:
        t = tensor.detach()
        out.append((name, t.to(dtype) if dtype is not None and t.dtype != dtype else t))
    return out


def tensor_table(tensors: list[tuple[str, torch.Tensor]]) -> list[admin_pb2.TensorSpec]:
    """Each tensor's name, dtype and shape (an unsupported dtype is sent as is: the daemon
    refuses it by name)."""
    return [
        admin_pb2.TensorSpec(
            name=name, dtype=DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch.")),
            shape=list(t.shape),
        )
        for name, t in tensors
    ]  # fmt: skip


def nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def chunk_messages(
    name: str, tensor: torch.Tensor, chunk_bytes: int
) -> Iterator[tuple[bytes, int]]:
    """The tensor as serialized `UpdateWeightsRequest` chunks of whole elements, at most
    `chunk_bytes` of data each (row-major, this machine's byte order), each with the number of
    the tensor's bytes it carries; a device tensor is copied to the host one piece at a time.

    Each message is written as its wire bytes, the ones protobuf would serialize: the request's
    `chunk` field around the chunk's `name` (serialized by protobuf) and `data` (its tag, its
    length, the bytes). The tensor's bytes are copied once, into the message; built as protobuf
    messages they were copied four times (out of the tensor, into the chunk, into the request,
    into its serialization), which held a push over loopback to 0.5 GB/s on two CPU cores.
    """
    flat = tensor.detach().contiguous().view(-1)
    per_chunk = max(1, chunk_bytes // tensor.element_size())
    named = admin_pb2.TensorChunk(name=name).SerializeToString()
    for start in range(0, flat.numel(), per_chunk):
        piece = flat[start : start + per_chunk].cpu().view(torch.uint8).numpy()
        data = b"".join((_DATA_TAG, _varint(piece.nbytes)))
        size = len(named) + len(data) + piece.nbytes
        yield b"".join((_CHUNK_TAG, _varint(size), named, data, piece.data)), piece.nbytes


def _varint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def ipc_tensor(name: str, tensor: torch.Tensor) -> admin_pb2.IpcTensor:
    """A CUDA tensor's IPC description, from torch's own reduction (`reduce_tensor`)."""
    return ipc_tensors([(name, tensor)])[0]


def ipc_tensors(tensors: list[tuple[str, torch.Tensor]]) -> list[admin_pb2.IpcTensor]:
    """The tensors' IPC descriptions, each storage reduced once for all the tensors it holds.

    A reduction (`reduce_tensor`) takes a reference count in shared memory and records and
    exports an event, per call: 291 of them for views of one flat buffer were most of the
    client's 46 ms of an IPC push. A tensor's own fields are its strides and offset; the rest
    is its storage's, the same for every view of it (the daemon releases each count once).
    """
    storages: dict[int, admin_pb2.IpcTensor] = {}  # storage address -> its fields
    out = []
    for name, tensor in tensors:
        shared = storages.get(tensor.untyped_storage().data_ptr())
        if shared is None:
            shared = storages[tensor.untyped_storage().data_ptr()] = _storage_fields(tensor)
        described = admin_pb2.IpcTensor(
            name=name, stride=list(tensor.stride()), storage_offset=int(tensor.storage_offset())
        )
        described.MergeFrom(shared)
        out.append(described)
    return out


def _storage_fields(tensor: torch.Tensor) -> admin_pb2.IpcTensor:
    """The fields of `tensor`'s storage, from torch's own reduction."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    # (cls, size, stride, offset, storage cls, dtype, device, handle, size bytes,
    #  offset bytes, requires_grad, ref counter handle, ref counter offset, event, sync)
    _, _, _, _, _, _, _, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset, event, \
        sync = args  # fmt: skip
    return admin_pb2.IpcTensor(
        storage_handle=handle, storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
        ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event or b"",
        event_sync_required=bool(sync),
    )  # fmt: skip


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor goes in a weight group's broadcasts."""

    bucket_bytes: list[int]  # the size of each broadcast
    placements: list[tuple[int, int]]  # per tensor: (bucket, byte offset), in table order


def bucket_layout(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> BucketLayout:
    """Pack tensors in order into buckets of at most `bucket_bytes` (a larger tensor gets a
    bucket of its own), each tensor at a multiple of `ALIGN` bytes."""
    sizes: list[int] = []
    placements = []
    for _, t in tensors:
        size = t.numel() * t.element_size()
        start = -(-sizes[-1] // ALIGN) * ALIGN if sizes else 0
        if not sizes or start + size > bucket_bytes:
            sizes.append(0)
            start = 0
        placements.append((len(sizes) - 1, start))
        sizes[-1] = start + size
    return BucketLayout(sizes, placements)


def flat_copy(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors copied into one new flat buffer on their device, each at a multiple of
    `ALIGN` bytes, as (name, view of the buffer) pairs in the same order.

    For an IPC push: the daemon opens each allocation the tensors live in once (CUDA maps it
    into its address space), and a trainer's tensors are often one allocation each; views of
    one buffer are one allocation. The buffer costs the tensors' size again while it lives.
    """
    if not tensors:
        return []
    views = flat_views(tensors, tensors[0][1].device)
    torch._foreach_copy_([v for _, v in views], [t for _, t in tensors])  # one call, not 291
    return views


def flat_views(
    tensors: list[tuple[str, torch.Tensor]], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Views of one new flat buffer on `device` with the shapes and dtypes of `tensors` (which
    may be meta tensors: nothing is read from them), each at a multiple of `ALIGN` bytes, as
    (name, view) pairs in the same order; what they hold is undefined until written."""
    if not tensors:
        return []
    padded = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, t in tensors)
    layout = bucket_layout(tensors, padded)  # one bucket: every tensor fits at its offset
    buffer = torch.empty(layout.bucket_bytes[0], dtype=torch.uint8, device=device)
    views = []
    for (name, t), (_, offset) in zip(tensors, layout.placements, strict=True):
        size = t.numel() * t.element_size()
        views.append((name, buffer[offset : offset + size].view(t.dtype).view(t.shape)))
    return views


def fill_bucket(
    bucket: torch.Tensor,
    tensors: list[tuple[str, torch.Tensor]],
    layout: BucketLayout,
    index: int,
) -> None:
    """Copy the tensors of bucket `index` into `bucket` (uint8, on the broadcast's device)."""
    for (_, t), (where, offset) in zip(tensors, layout.placements, strict=True):
        if where == index:
            size = t.numel() * t.element_size()
            raw = t.contiguous().view(-1).view(torch.uint8)
            bucket[offset : offset + size].copy_(raw)
