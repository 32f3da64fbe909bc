"""The client's hand-framed stream messages are what protobuf itself would have built."""

from __future__ import annotations

import itertools

import torch

from sitsd.api.v1 import admin_pb2
from sitsd.client.tensors import ALIGN, chunk_messages, flat_copy, flat_views


def test_chunk_messages_parse_as_update_weights_requests_carrying_the_tensor_whole(rng):
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


def test_a_flat_copy_holds_every_tensor_as_an_aligned_view_of_one_buffer(rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    tensors = [
        (f"t{i}", torch.randn(rng.randrange(1, 40), rng.randrange(1, 40), generator=gen).to(
            rng.choice((torch.float32, torch.bfloat16, torch.float16))))
        for i in range(rng.randrange(2, 12))
    ]  # fmt: skip
    flat = flat_copy(tensors)
    assert [n for n, _ in flat] == [n for n, _ in tensors]
    storages = {v.untyped_storage().data_ptr() for _, v in flat}
    assert len(storages) == 1
    base = storages.pop()
    for (_, t), (_, v) in zip(tensors, flat, strict=True):
        assert (v.dtype, v.shape) == (t.dtype, t.shape)
        assert torch.equal(v, t)
        assert (v.data_ptr() - base) % ALIGN == 0
        assert v.data_ptr() != t.data_ptr()  # a copy: the trainer may change its own


def test_flat_views_of_meta_tensors_lay_out_one_buffer_without_reading_them(rng):
    shapes = [(rng.randrange(1, 40), rng.randrange(1, 40)) for _ in range(rng.randrange(2, 12))]
    dtypes = [rng.choice((torch.float32, torch.bfloat16, torch.float16)) for _ in shapes]
    metas = [(f"t{i}", torch.empty(s, dtype=d, device="meta"))
             for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]  # fmt: skip
    views = flat_views(metas, torch.device("cpu"))
    assert [(n, v.shape, v.dtype, v.device.type) for n, v in views] == [
        (n, m.shape, m.dtype, "cpu") for n, m in metas
    ]
    assert len({v.untyped_storage().data_ptr() for _, v in views}) == 1
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for _, v in views)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # no overlap
    base = views[0][1].untyped_storage().data_ptr()
    assert all((v.data_ptr() - base) % ALIGN == 0 for _, v in views)
