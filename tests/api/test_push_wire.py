"""`Admin.UpdateWeights` messages read off the wire: a chunk as the client frames it is read in
place, and every message means what protobuf would parse it as, whichever path read it."""

from __future__ import annotations

import random

import pytest
import torch
from google.protobuf.message import DecodeError

from sitsd.api.push_wire import WireChunk, read_update_request
from sitsd.api.v1 import admin_pb2
from sitsd.client.tensors import chunk_messages


def test_the_clients_chunks_are_read_in_place_as_protobuf_parses_them(rng):
    tensor = torch.randn(rng.randrange(1, 200), rng.randrange(1, 200))
    name = f"model.layers.{rng.randrange(100)}.self_attn.ö_proj.weight"  # a name in UTF-8
    # Sizes around the varint boundaries of the length fields (127, 16383 bytes).
    chunk_bytes = rng.choice((4, 124, 128, 16380, 16388, rng.randrange(4, 2**20)))
    for message, carried in chunk_messages(name, tensor, chunk_bytes):
        read = read_update_request(message)
        assert isinstance(read, WireChunk)
        parsed = admin_pb2.UpdateWeightsRequest.FromString(message)
        assert read.name == parsed.chunk.name == name
        assert bytes(read.data) == parsed.chunk.data
        assert len(read.data) == carried
        assert read.data.obj is message  # a view of the received bytes, no copy


def _encodings(rng: random.Random) -> list[bytes]:
    """Valid messages other than the client's layout, and bytes that do not parse."""
    data = random.randbytes(rng.randrange(1, 3000))
    chunk = admin_pb2.TensorChunk(name="model.norm.weight", data=data)
    name_field = b"\x0a" + bytes([len(chunk.name)]) + chunk.name.encode()
    data_field = admin_pb2.TensorChunk(data=data).SerializeToString()
    unknown = b"\x18\x07"  # field 3, a varint
    inner = [data_field + name_field, name_field + data_field + unknown, unknown + data_field]
    wrapped = [b"\x12" + _varint(len(i)) + i for i in inner]
    header = admin_pb2.UpdateWeightsRequest(header=admin_pb2.PushHeader(version="v"))
    return [
        *wrapped,
        admin_pb2.UpdateWeightsRequest(chunk=admin_pb2.TensorChunk(name="x")).SerializeToString(),
        header.SerializeToString(),
        wrapped[0] + header.SerializeToString(),  # two items: the last one wins
        b"\x12\x05\x0a\x03abc",  # truncated inside the chunk
        b"\x12\x85\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # a length varint too long
        b"\x12\x06\x0a\x02\xff\xfe\x12\x00",  # a name that is not UTF-8
    ]


@pytest.mark.parametrize("index", range(9))
def test_any_other_message_means_what_protobuf_parses_it_as(rng, index):
    message = _encodings(rng)[index]
    try:
        want = admin_pb2.UpdateWeightsRequest.FromString(message)
    except DecodeError:
        with pytest.raises((DecodeError, UnicodeDecodeError)):
            read_update_request(message)
        return
    read = read_update_request(message)
    if isinstance(read, WireChunk):
        assert want.WhichOneof("item") == "chunk"
        assert (read.name, bytes(read.data)) == (want.chunk.name, want.chunk.data)
    else:
        assert read == want


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
