"""Mixed steps (prompt chunks, with or without decodes) in fixed shapes, one per token bucket,
captured as CUDA graphs.

An eager step that carries a prompt chunk is host-bound on a GPU: ~7 Triton launches per layer
cost 15-35 ms of host time for a few ms of GPU work. Here such a step is padded to the next
token bucket (16, 32, 64, ... up to the step's token budget) and to `max_num_seqs` sequences
(`StepInputBuilder.build(pad_tokens_to=...)`), and attention runs as one unified prefill-kernel
call over the whole batch (a decode is a sequence with one query token) whose grid and scalar
arguments depend on the bucket alone; every per-step value (tokens, positions, slots, sequence
lengths, query starts, block tables, which rows to sample) is read from the builder's
persistent device buffers. So each bucket's forward pass, the gather of the rows to sample and
their logits included, can be captured once and replayed for any batch that fits it.

`MixedGraphs.run` replays the bucket's graph once `capture` has run, and otherwise runs the
very same fixed-shape forward eagerly: that is what the CPU tests compare with the dynamic
eager path, since capture needs a GPU. Decode-only steps keep their own graphs
(`cuda_graphs.py`); whether a step runs here is the model runner's decision.

Graphs belong to one weight slot (`LlamaWeights`), like the decode graphs.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import torch

from sitsd.model.llama import LlamaModel, LlamaWeights
from sitsd.runtime.cuda_graphs import BesideServing, capture_graph
from sitsd.runtime.input_batch import StepInputBuilder

if TYPE_CHECKING:
    from sitsd.runtime.cuda_graphs import GraphPool

SMALLEST_TOKEN_BUCKET = 16


def token_buckets(max_num_tokens: int, smallest: int = SMALLEST_TOKEN_BUCKET) -> list[int]:
    """Powers of two from `smallest` below `max_num_tokens`, then `max_num_tokens` itself."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be positive, got {max_num_tokens}")
    buckets = []
    bucket = smallest
    while bucket < max_num_tokens:
        buckets.append(bucket)
        bucket *= 2
    return [*buckets, max_num_tokens]


class MixedGraphs:
    """Fixed-shape mixed steps of one weight slot: captured CUDA graphs, or eager (CPU)."""

    def __init__(
        self,
        model: LlamaModel,
        builder: StepInputBuilder,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        weights: LlamaWeights,
        buckets: list[int],
    ) -> None:
        if max(buckets) > builder.max_num_tokens:
            raise ValueError(
                f"bucket {max(buckets)} exceeds the input buffers' {builder.max_num_tokens} tokens"
            )
        self.model = model
        self.builder = builder
        self.kv_caches = kv_caches
        self.weights = weights
        self.buckets = sorted(buckets)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # bucket -> [rows, vocab] float32
        # bucket -> [bucket, hidden]: every token's final hidden state, from the last run (a
        # captured graph's own output buffer once captured); canary probes' logits read it.
        self._hidden: dict[int, torch.Tensor] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a step of this size can run here (else it runs eagerly)."""
        return 0 < num_tokens <= self.max_tokens and num_seqs <= self.builder.max_num_seqs

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def forward(
        self, bucket: int, beside: BesideServing | None = None
    ) -> torch.Tensor:  # [rows, vocab] float32
        """The bucket's fixed-shape forward pass over the builder's buffers (`beside`: over its
        buffers and with its model, a warm-up beside serving), eagerly.

        Rows past the step's sampled ones are padding (they gather token 0).
        """
        builder, model = (self.builder, self.model) if beside is None else (
            beside.builder, beside.model)  # fmt: skip
        d = builder.dev
        rows = builder.mixed_logits_rows(bucket)
        meta = builder.mixed_meta(bucket)
        hidden = model.forward(
            self.weights, d.input_ids[:bucket], d.positions[:bucket], meta, self.kv_caches
        )  # [bucket, hidden]
        self._hidden[bucket] = hidden  # kept alive, so a capture never reuses its memory
        sampled = torch.index_select(hidden, 0, d.logits_indices[:rows])  # [rows, hidden]
        return model.compute_logits(self.weights, sampled)

    def hidden(self, bucket: int) -> torch.Tensor:  # [bucket, hidden]
        """Every token's final hidden state in the bucket's last run (valid until the next
        run of any graph sharing its pool: read it right after `run`)."""
        return self._hidden[bucket]

    def run(self, bucket: int) -> torch.Tensor:  # [rows, vocab] float32
        """Replay the bucket's graph if captured, else run the same forward eagerly."""
        graph = self._graphs.get(bucket)
        if graph is None:
            return self.forward(bucket)
        graph.replay()
        return self._logits[bucket]

    @torch.inference_mode()
    def capture(
        self,
        pool: GraphPool | None = None,
        stream: torch.cuda.Stream | None = None,
        beside: BesideServing | None = None,
    ) -> float:
        """Capture every bucket, largest first, in `pool` (shared with the slot's decode
        graphs: they never run at the same time) and on `stream` (the runner's, see
        `capture_graph`); returns the seconds it took. `beside`: capture beside serving, the
        warm-ups on its buffers and model (`DecodeGraphs.capture`)."""
        t0 = time.monotonic()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = stream if stream is not None else torch.cuda.Stream()
        d = (beside.builder if beside is not None else self.builder).dev
        # Warm-up inputs must be harmless: no KV written, every sequence empty.
        d.slot_mapping.fill_(-1)
        d.seq_lens.zero_()
        d.query_start_loc.zero_()
        d.logits_indices.zero_()
        for bucket in reversed(self.buckets):
            warm_up = None if beside is None else functools.partial(self.forward, bucket, beside)
            self._graphs[bucket], self._logits[bucket] = capture_graph(
                functools.partial(self.forward, bucket), pool, stream, warm_up
            )
        torch.cuda.synchronize()
        return time.monotonic() - t0
