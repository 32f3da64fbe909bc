"""The client's hand-framed stream messages are what protobuf itself would have built."""

from __future__ import annotations

import random

import torch

from sitsd.api.v1 import admin_pb2
from sitsd.client.tensors import chunk_messages


def test_chunk_messages_parse_as_update_weights_requests_carrying_the_tensor_whole():
    rng = random.Random()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        shape = (rng.randrange(1, 300), rng.randrange(1, 300))
        tensor = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        tensor = tensor.to(dtype)
        name = f"model.layers.{rng.randrange(100)}.mlp.up_proj.weight"
        # Sizes around the varint boundaries of the length fields (127, 16383 bytes).
        chunk_bytes = rng.choice((2, 126, 128, 16382, 16386, rng.randrange(2, 2**20)))
        data = b""
        for message, carried in chunk_messages(name, tensor.t(), chunk_bytes):
            parsed = admin_pb2.UpdateWeightsRequest.FromString(message)
            assert parsed.WhichOneof("item") == "chunk"
            assert parsed.chunk.name == name
            assert len(parsed.chunk.data) == carried <= max(chunk_bytes, tensor.element_size())
            assert carried % tensor.element_size() == 0
            built = admin_pb2.UpdateWeightsRequest(
                chunk=admin_pb2.TensorChunk(name=name, data=parsed.chunk.data)
            )
            assert parsed == built
            data += parsed.chunk.data
        got = torch.frombuffer(bytearray(data), dtype=dtype).view(tensor.t().shape)
        assert torch.equal(got, tensor.t())  # row-major bytes of the (transposed) view
