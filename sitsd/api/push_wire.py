"""`Admin.UpdateWeights` messages read off the wire: a chunk's bytes as a view, not a copy.

A push streams its tensors' bytes in chunks of up to `MAX_CHUNK_BYTES` (16 GB of an 8B model
is a thousand 16 MiB messages). Parsed by protobuf, each chunk's bytes were copied twice on the
event loop, with the interpreter held: into the parsed message, then out of it into a `bytes`
object (`chunk.data`). `read_update_request` reads a chunk laid out as the trainer's client
writes it (`sitsd.client.tensors.chunk_messages`: the request's `chunk` field around the chunk's
`name` and then its `data`) in place: a `WireChunk` whose `data` is a view of the received
bytes. Any other message (the header, or a chunk encoded another valid way) is parsed by
protobuf, so what a message means never depends on which path read it. What the daemon does
with the chunks is `sitsd.weights.push_stream`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from sitsd.api.v1 import admin_pb2

MAX_CHUNK_BYTES = 64 * 2**20  # the most tensor bytes one UpdateWeights message may carry
# The server's limit on a received message: the largest chunk, its tensor's name and framing.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + 2**20

# Wire tags (field number << 3 | 2, length-delimited): UpdateWeightsRequest.chunk (2),
# TensorChunk.name (1) and TensorChunk.data (2).
_CHUNK_TAG = _DATA_TAG = 2 << 3 | 2
_NAME_TAG = 1 << 3 | 2


@dataclass(frozen=True, slots=True)
class WireChunk:
    """A `TensorChunk` read in place: its data is a view of the message's bytes."""

    name: str
    data: memoryview


UpdateRequest = admin_pb2.UpdateWeightsRequest | WireChunk


def read_update_request(message: bytes) -> UpdateRequest:
    """One `UpdateWeightsRequest`: a chunk in the client's layout as a view, else parsed.

    Raises:
        google.protobuf.message.DecodeError, UnicodeDecodeError: the bytes do not parse.
    """
    chunk = _chunk_in_place(message)
    return chunk if chunk is not None else admin_pb2.UpdateWeightsRequest.FromString(message)


def update_weights_handler(
    behavior: Callable[..., object],
) -> grpc.RpcMethodHandler:
    """The method handler of `Admin.UpdateWeights` reading its requests with
    `read_update_request` (the generated one parses every chunk)."""
    handler: grpc.RpcMethodHandler = grpc.stream_unary_rpc_method_handler(
        behavior,
        request_deserializer=read_update_request,
        response_serializer=admin_pb2.WeightUpdate.SerializeToString,
    )
    return handler


def _chunk_in_place(message: bytes) -> WireChunk | None:
    """The chunk of a message that is exactly `chunk { name, data }`, or None."""
    if not message or message[0] != _CHUNK_TAG:
        return None
    size, at = _varint(message, 1)
    if at + size != len(message):
        return None
    name = b""
    if at < len(message) and message[at] == _NAME_TAG:
        length, at = _varint(message, at + 1)
        name, at = message[at : at + length], at + length
    if at >= len(message) or message[at] != _DATA_TAG:
        return None  # no data, or another field: protobuf's to read
    length, at = _varint(message, at + 1)
    if at + length != len(message):
        return None
    return WireChunk(name.decode("utf-8"), memoryview(message)[at:])


def _varint(message: bytes, at: int) -> tuple[int, int]:
    """The base-128 varint at `at` and where it ends (past the end: an impossible size)."""
    value = shift = 0
    while at < len(message) and shift < 64:
        byte = message[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
    return len(message) + 1, at  # truncated or too long: no layout check passes
