"""Decode steps as CUDA graphs, one per batch-size bucket.

A decode step of a Llama-8B is ~300 kernel launches; at small batch their launch cost exceeds
the GPU time. Each bucket's forward pass (embedding to logits) is captured once, reading its
inputs from `StepInputBuilder`'s persistent device buffers and writing logits to a static
output; a step pads its decode batch to the next bucket (padding rows have seq_len 0 and slot
-1: they write no KV and read none) and replays the graph. All graphs share one memory pool,
captured largest first so the smaller ones reuse its memory.

Graphs are captured for one `LlamaWeights` object (a weight slot): replaying them with other
weights means capturing again for those (hot-swap keeps one set of graphs per slot). A slot
restaged with a version of another structure (another precision) is captured again beside
serving: on another thread while the engine goes on with the other slot (`capture_graph`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sitsd.model.attention import AttentionMetadata
from sitsd.model.llama import LlamaModel, LlamaWeights
from sitsd.runtime.input_batch import StepInputBuilder

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as GraphPool  # graph_pool_handle()'s type

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (which is always included)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 8))
    return sorted(set(buckets) | {max_num_seqs})


@dataclass(frozen=True)
class BesideServing:
    """What the warm-ups of a capture beside serving run on (`capture_graph`): input buffers
    of their own, every sequence empty (the serving builder's hold a live step's slots), and
    a model whose kernels keep scratch of their own (`KernelSet.scratch`: split counters that
    each launch counts in and leaves zero, the INT4 dequantize workspace), since they run on
    another stream while the engine's steps do."""

    builder: StepInputBuilder
    model: LlamaModel


def capture_graph(
    forward: Callable[[], torch.Tensor],
    pool: GraphPool,
    stream: torch.cuda.Stream,
    warm_up: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm up on `stream` (Triton compiles, cuBLAS picks algorithms), then capture `forward`
    there; returns the graph and its static output.

    `warm_up` None: `forward` itself runs twice first, and the capture owns the process
    (torch's `graph`: the device synchronized and the cache emptied first, any other thread's
    CUDA call an error meanwhile): at start-up, or on the engine's thread between two steps.
    Else the capture runs beside serving, on a thread of its own while the engine's goes on:
    `warm_up` is the same forward over inputs of its own in which every sequence is empty
    (the buffers `forward` reads hold a live step's slots, and a warm-up runs), run once; the
    capture is thread-local (only this thread is bound by capture's rules) and neither
    synchronizes the device nor frees cached memory, and nothing the engine queues waits for
    the warm-up.

    One stream per weight slot of a model runner, for all that slot's graphs, and never torch's
    process-wide default capture stream: cuBLAS keeps a workspace per (handle, stream) whose
    address captured GEMMs bake in, and destroying a graph drops the workspace of the stream it
    was captured on (pytorch/pytorch#193402). On a shared stream, one set of graphs going away
    (another runner's, or the other slot's when a version of another precision replaces them)
    would pull the workspace from under the rest. The eager warm-up allocates the stream's
    workspace outside any graph's pool, before the first capture.
    """
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    if warm_up is not None:
        with torch.cuda.stream(stream):
            warm_up()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = forward()
            finally:
                graph.capture_end()
        return graph, out
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = forward()
    return graph, out


class DecodeGraphs:
    """Captured decode graphs of one weight slot, and their replay."""

    def __init__(
        self,
        model: LlamaModel,
        builder: StepInputBuilder,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        buckets: list[int],
    ) -> None:
        self.model = model
        self.builder = builder
        self.kv_caches = kv_caches
        self.buckets = sorted(buckets)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # bucket -> [bucket, vocab] float32

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    @torch.inference_mode()
    def capture(
        self,
        weights: LlamaWeights,
        pool: GraphPool | None = None,
        stream: torch.cuda.Stream | None = None,
        beside: BesideServing | None = None,
    ) -> float:
        """Capture every bucket for `weights` (in `pool`, default a new one; on `stream`,
        default a new one: see `capture_graph`); returns the seconds it took.

        `beside`: capture beside serving (`capture_graph`), the warm-ups running on its
        buffers and model; the serving builder's buffers are then left as they are (a step is
        reading them).
        """
        t0 = time.monotonic()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = stream if stream is not None else torch.cuda.Stream()
        warmed = (beside.builder if beside is not None else self.builder).dev
        warmed.slot_mapping.fill_(-1)  # warm-up garbage must not write into the KV pool
        warmed.seq_lens.zero_()
        for bucket in reversed(self.buckets):
            self._capture_one(bucket, weights, pool, stream, beside)
        torch.cuda.synchronize()
        return time.monotonic() - t0

    def _capture_one(
        self,
        bucket: int,
        weights: LlamaWeights,
        pool: GraphPool,
        stream: torch.cuda.Stream,
        beside: BesideServing | None,
    ) -> None:
        forward = functools.partial(self._forward, bucket, weights, self.builder, self.model)
        warm_up = None if beside is None else functools.partial(
            self._forward, bucket, weights, beside.builder, beside.model)  # fmt: skip
        self._graphs[bucket], self._logits[bucket] = capture_graph(forward, pool, stream, warm_up)

    def _forward(
        self, bucket: int, weights: LlamaWeights, builder: StepInputBuilder, model: LlamaModel
    ) -> torch.Tensor:  # [bucket, vocab] float32
        d = builder.dev
        meta = self._static_meta(bucket, builder)
        hidden = model.forward(
            weights, d.input_ids[:bucket], d.positions[:bucket], meta, self.kv_caches
        )  # [bucket, hidden]
        return model.compute_logits(weights, hidden)

    def _static_meta(self, bucket: int, builder: StepInputBuilder) -> AttentionMetadata:
        d = builder.dev
        return AttentionMetadata(
            slot_mapping=d.slot_mapping[:bucket],
            block_tables=d.block_tables[:bucket],  # full width: any context up to the maximum
            seq_lens=d.seq_lens[:bucket],
            query_start_loc=d.query_start_loc[: bucket + 1],
            prefill_query_start_loc=d.prefill_query_start_loc[:1],
            num_decodes=bucket,
            num_decode_tokens=bucket,
            max_seq_len=builder.max_blocks_per_seq * builder.block_size,
        )

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the bucket's graph on the inputs already in the builder's buffers."""
        self._graphs[bucket].replay()
        return self._logits[bucket]  # [bucket, vocab]; rows past the real batch are padding
