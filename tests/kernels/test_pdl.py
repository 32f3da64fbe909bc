"""Programmatic dependent launch (`kernels/_pdl.py`): the decode kernels give the same bits with
and without it, alone and chained inside a CUDA graph (where a kernel's launch overlaps the tail
of the one before: a missing wait would read stale inputs); asked for off an sm_90+ GPU it is
refused with a message."""

from __future__ import annotations

import pytest
import torch

from sitsd.kernels import (
    decode_attention,
    fused_add_rms_norm,
    gemv,
    rms_norm,
    rotary_and_cache,
    silu_and_mul,
)
from sitsd.kernels._utils import supports_pdl
from sitsd.kernels.reference import compute_cos_sin_cache

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 256, 8, 2, 64, 16, 128
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def layer_weights(device, dtype=torch.bfloat16):
    def w(n, k):
        return (torch.randn(n, k, device=device) / k**0.5).to(dtype)

    return {
        "qkv": w(Q + 2 * KV, HIDDEN), "o": w(HIDDEN, Q), "gate_up": w(1024, HIDDEN),
        "down": w(HIDDEN, 512), "norm": (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(dtype),
    }  # fmt: skip


def decode_layer(x, residual, layers, cache, seq_lens, block_tables, positions, slots, *, pdl):
    """A few Llama layers' decode kernels in the model's order, all launched with `pdl` (gemv for
    every projection, so that each kernel follows another PDL kernel; decode attention merges
    its splits itself, through the counters)."""
    cos_sin, key_cache, value_cache, counters = cache
    for w in layers:
        x, residual = fused_add_rms_norm(x, residual, w["norm"], 1e-5, pdl=pdl)
        qkv = gemv(x, w["qkv"], pdl=pdl)
        q, k, v = qkv.split([Q, KV, KV], dim=-1)
        q, k = rotary_and_cache(
            positions, q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM),
            v.view(-1, KV_HEADS, HEAD_DIM), cos_sin, key_cache, value_cache, slots, pdl=pdl,
        )  # fmt: skip
        attn = decode_attention(
            q, key_cache, value_cache, block_tables, seq_lens, HEAD_DIM**-0.5, num_splits=4,
            pdl=pdl, split_counters=counters,
        )  # fmt: skip
        x = gemv(attn.view(-1, Q), w["o"], pdl=pdl)
        x, residual = fused_add_rms_norm(x, residual, w["norm"], 1e-5, pdl=pdl)
        gate_up = gemv(x, w["gate_up"], pdl=pdl)
        x = gemv(silu_and_mul(gate_up, pdl=pdl), w["down"], pdl=pdl)
    return rms_norm(x + residual, layers[0]["norm"], 1e-5, pdl=pdl)


def decode_inputs(num_seqs: int):
    torch.manual_seed(1234)
    dev = "cuda"
    layers = [layer_weights(dev) for _ in range(4)]
    key_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, device=dev).bfloat16()
    value_cache = torch.randn_like(key_cache)
    cos_sin = compute_cos_sin_cache(HEAD_DIM, 512, 10000.0, None).to(dev)
    seq_lens = torch.randint(1, 200, (num_seqs,), dtype=torch.int32, device=dev)
    # 13 blocks of 16 hold up to 208 tokens; no block is shared (each slot written once)
    block_tables = torch.randperm(NUM_BLOCKS, device=dev)[: num_seqs * 13].view(num_seqs, 13).int()
    positions = (seq_lens - 1).long()
    rows = torch.arange(num_seqs, device=dev)
    slots = (block_tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK).long()
    x = torch.randn(num_seqs, HIDDEN, device=dev).bfloat16()
    residual = torch.randn_like(x)
    counters = torch.zeros(num_seqs * KV_HEADS, dtype=torch.int32, device=dev)
    cache = (cos_sin, key_cache, value_cache, counters)
    return x, residual, layers, cache, seq_lens, block_tables, positions, slots


def run(num_seqs: int, *, pdl: bool, graph: bool) -> torch.Tensor:
    x, residual, layers, cache, *rest = decode_inputs(num_seqs)
    if not graph:
        return decode_layer(x.clone(), residual.clone(), layers, cache, *rest, pdl=pdl)
    static_x, static_res = x.clone(), residual.clone()
    _, key_cache, value_cache, _ = cache
    saved = key_cache.clone(), value_cache.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile outside the capture
        decode_layer(static_x.clone(), static_res.clone(), layers, cache, *rest, pdl=pdl)
    torch.cuda.current_stream().wait_stream(stream)
    graph_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_):
        out = decode_layer(static_x, static_res, layers, cache, *rest, pdl=pdl)
    key_cache.copy_(saved[0])
    value_cache.copy_(saved[1])
    static_x.copy_(x)
    static_res.copy_(residual)
    graph_.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.gpu
@pytest.mark.skipif(not supports_pdl(), reason="programmatic dependent launch needs sm_90+")
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_pdl_launches_give_the_same_bits_eagerly_and_in_a_cuda_graph(num_seqs):
    want = run(num_seqs, pdl=False, graph=False)
    assert torch.isfinite(want.float()).all()
    assert torch.equal(run(num_seqs, pdl=True, graph=False), want)
    assert torch.equal(run(num_seqs, pdl=True, graph=True), want)
    assert torch.equal(run(num_seqs, pdl=False, graph=True), want)


@pytest.mark.skipif(supports_pdl(), reason="checks the refusal off an sm_90+ GPU")
def test_pdl_off_a_cuda_device_is_refused_with_a_message():
    x = torch.randn(2, 32)
    w = torch.randn(16, 32)
    calls = [
        lambda: rms_norm(x, torch.ones(32), 1e-5, pdl=True),
        lambda: fused_add_rms_norm(x.clone(), x.clone(), torch.ones(32), 1e-5, pdl=True),
        lambda: silu_and_mul(x, pdl=True),
        lambda: gemv(x, w, pdl=True),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="pdl needs a CUDA device of compute capability"):
            call()
    assert not supports_pdl("cpu")
