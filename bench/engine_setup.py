"""How the GPU benchmarks build what they measure: random weights in memory, the engine's config,
and the GPU time of a decode graph replay.

- `random_checkpoint(arch, name)`: a `Checkpoint` of random bf16 weights on the GPU in
  `arch`'s shapes (norms at one), with a word-level tokenizer over the whole vocabulary;
- `engine_config(...)`: the daemon's CUDA defaults (decode and mixed-step graphs, asynchronous
  scheduling) under FCFS;
- `fill_decode_inputs(runner, context)`: the decode graphs' inputs set for a step at a context;
- `graph_gpu_ms(runner, batches, context)`: one decode graph replay per batch, timed with CUDA
  events (`bench.timing`): what a step costs the GPU without the host's share.

Which model shapes to use is `bench.shapes`'s; writing a model to disk is
`bench.make_random_model`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.timing import median_ms
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig
from sitsd.model.arch import LlamaArch
from sitsd.model.llama import expected_shapes
from sitsd.weights.formats import Checkpoint

if TYPE_CHECKING:
    import tokenizers


class SyntheticTokenizer:
    """A word-level tokenizer over the whole vocabulary: real (Rust) decode cost, no files."""

    eos_token_ids = ()

    def __init__(self, vocab_size: int) -> None:
        from tokenizers import Tokenizer, models

        vocab = {f"w{i}": i for i in range(vocab_size)}
        self._tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
        # The longest word and the space decode puts before it: no token stands for more text.
        self.max_token_bytes = len(f"w{vocab_size - 1}") + 1

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object (what structured outputs compile their grammars over)."""
        return self._tok

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def random_checkpoint(arch: LlamaArch, name: str) -> Checkpoint:
    """Random bf16 weights (std 0.02, seed 0) on the GPU in `arch`'s shapes, norms at one."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for key, shape in expected_shapes(arch).items():
        if key.endswith("norm.weight"):
            tensors[key] = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            tensors[key] = t.normal_(0.0, 0.02, generator=gen)
    return Checkpoint(arch=arch, tensors=tensors, tokenizer=SyntheticTokenizer(arch.vocab_size),
                      name=name, path=Path(name), format="random", files=[])  # fmt: skip


def engine_config(
    max_num_seqs: int, eager: bool = False, util: float = 0.8, ahead: bool | None = None
) -> SitsdConfig:
    """The daemon's CUDA config under FCFS; `ahead`: asynchronous scheduling (None: default)."""
    return SitsdConfig(
        model=ModelConfig(device="cuda", dtype="bfloat16", max_model_len=2048,
                          enforce_eager=eager),
        cache=CacheConfig(gpu_memory_utilization=util),
        # FCFS: the engine's raw speed. The tiers policy would shed requests that queue past
        # their tier's wait (all 256 of the throughput run arrive at once).
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                                  max_num_waiting=4096, policy="fcfs", async_scheduling=ahead),
    )  # fmt: skip


def quantized_at_load(config: SitsdConfig, map_body: str | None, directory: Path) -> SitsdConfig:
    """`config` serving its checkpoint quantized at load by a precision map (`sitsd serve
    --quantize`), the map's YAML `map_body` written into `directory`; None: as it is."""
    if map_body is None:
        return config
    map_file = directory / "precision.yaml"
    map_file.write_text(map_body, encoding="utf-8")
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, quantize=str(map_file))
    )


def fill_decode_inputs(runner, context: int) -> None:
    """Point the decode graphs' static inputs at a `context`-token context for every row (block
    tables over the first blocks, no KV written): replays then run a decode step's kernels.
    No engine may be running on `runner`: its buffers are overwritten."""
    d = runner.builder.dev
    d.slot_mapping.fill_(-1)  # write no KV
    d.seq_lens.fill_(context)
    blocks = torch.arange(runner.builder.max_blocks_per_seq, dtype=torch.int32, device="cuda")
    d.block_tables.copy_(blocks.expand_as(d.block_tables))


def graph_gpu_ms(runner, batches: list[int], context: int) -> dict[int, float]:
    """GPU time of one decode graph replay per batch (CUDA events), at a given context: what a
    step costs the GPU, without the host's share (`fill_decode_inputs` first)."""
    fill_decode_inputs(runner, context)
    return {
        b: median_ms(functools.partial(runner.graphs.replay, runner.graphs.bucket_for(b)))
        for b in batches
    }
