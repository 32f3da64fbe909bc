"""The model runner: owns the weight slots, the KV pool and per-request token rows; runs a step.

`launch(SchedulerOutput) -> PendingStep` updates the per-request state from what the scheduler
changed, lays out the ragged batch (`input_batch.py`), runs the model (a CUDA-graph replay for
decode-only batches on the GPU; with `--mixed-graphs` a replay per token bucket for batches that
carry prompt tokens too (`mixed_graphs.py`); eagerly otherwise) and samples the requests whose
chunk reached their last token; on the GPU all of that is queued and `launch` returns at once, and
`PendingStep.result()` waits for the sampled ids (the step's one host sync) and returns them as
plain lists. `execute` is the two in one. A step may be launched before the last one's
`result()` (asynchronous scheduling): a decode whose input token that step is still sampling
gets a placeholder in its token list, and the real id is copied into the inputs on the device
from that step's output (`_InputPatch`); `result()` then fills the placeholder. Two pinned
buffers take the sampled ids in turn. Which tokens to compute is the scheduler's decision;
this module never decides, it only computes.

Weights versions (hot-swap): every request runs on the slot holding its version
(`weight_slots.py`). A step whose requests use two versions runs one sub-batch per version, one
after the other, each on its own slot and with its own CUDA graphs: no forward pass mixes
versions. A migration shadow (`NewRequestData.shadow_of`) shares its request's token list and
never samples. A canary probe (`NewRequestData.probe`, a swap's canary prompt) never samples
either: it rides in its version's sub-batch like a prompt chunk, and the log-probabilities of
every position it computes are kept (on the device) until `take_prompt_logprobs` hands them
over; the probe's blocks are the scheduler's, like any request's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sitsd.model.llama import LlamaModel, LlamaWeights
from sitsd.outputs import ModelRunnerOutput, SchedulerOutput
from sitsd.runtime.cuda_graphs import BesideServing, DecodeGraphs
from sitsd.runtime.grammar import GrammarCompiler
from sitsd.runtime.input_batch import (
    HOST_SETS,
    CachedRequestState,
    StepInputBuilder,
    StepInputs,
)
from sitsd.runtime.logits_processors import LogitsProcessors, SampledLogprobs
from sitsd.runtime.mixed_graphs import MixedGraphs
from sitsd.runtime.sampler import sample_on_device
from sitsd.runtime.weight_slots import WeightSlots
from sitsd.types import TokenLogprob

if TYPE_CHECKING:
    from sitsd.runtime.cuda_graphs import GraphPool

log = logging.getLogger(__name__)

# The row counts a canary chunk's logits run at, each warmed at start-up: a step's probe rows
# are padded up to the next one, or go in pieces of the largest. They span each kind of launch
# the linear layer routes to by rows (a few rows, a skinny GEMM, cuBLAS) and each class Triton
# compiles a row count into (1, a multiple of 16, any other); and nothing else runs, so no
# serving step waits for a kernel loaded at its first launch (cuBLAS picks its kernel by rows,
# and CUDA loads each one's module lazily; a chunk's row count varies with the pacing: the GPU
# runs' canary steps of 15-22 ms spent 12-20 ms in the runner's launch, 1.5-2.6 ms since, on an
# H100 at 32 streams, `bench/results/swap-gpu.txt` run 14). Past 256 rows each piece reads the
# LM head again (~0.35 ms on an H100 for Llama-3-8B's).
PROBE_WARM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def probe_log_softmax(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [num_rows, hidden]
) -> torch.Tensor:
    """log_softmax of `compute_logits(hidden)` ([num_rows, vocab] float32), computed at the
    row counts of `PROBE_WARM_ROWS` only: in pieces of the largest, the last padded with zero
    rows (whose logits are dropped). Rows are independent, so the padding changes none."""
    pieces = []
    largest = PROBE_WARM_ROWS[-1]
    for piece in hidden.split(largest):
        n = piece.shape[0]
        rows = next(r for r in PROBE_WARM_ROWS if r >= n)
        if rows > n:
            piece = torch.nn.functional.pad(piece, (0, 0, 0, rows - n))  # zero rows at the end
        pieces.append(torch.log_softmax(compute_logits(piece), -1)[:n])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class ModelRunner:
    """Runs steps of one model over one KV pool, on the weight slot of each request's version."""

    def __init__(
        self,
        model: LlamaModel,
        slots: WeightSlots,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        builder: StepInputBuilder,
        grammars: GrammarCompiler | None = None,
        model_beside: Callable[[], LlamaModel] | None = None,
        precompile: Callable[[LlamaWeights, Sequence[int]], float] | None = None,
    ) -> None:
        """Args:
        model_beside: makes a model like `model` whose kernels keep scratch of their own
            (`KernelSet.scratch`), for the warm-ups of a capture beside serving
            (`recapture_graphs`); None: this runner captures between two steps only.
        precompile: compiles the kernels of a slot's weights at the given row counts where
            this process's interpreter is not held (`sitsd.runtime.precompile`), before a
            capture beside serving; returns its seconds. None: the capture compiles them.
        """
        self.model = model
        self._model_beside = model_beside
        self._precompile = precompile
        self.slots = slots
        self.kv_caches = kv_caches
        self.builder = builder
        self.block_size = builder.block_size
        self.device = builder.device
        self.slot_graphs: dict[int, DecodeGraphs] = {}  # slot index -> its captured graphs
        self.slot_mixed: dict[int, MixedGraphs] = {}  # slot index -> its mixed-step graphs
        self._graph_pools: dict[int, GraphPool] = {}  # slot index -> the pool its graphs share
        self._decode_buckets: list[int] = []  # the decode graphs' batch buckets
        self._mixed_buckets: list[int] = []  # the mixed steps' token buckets ([]: none)
        self._mixed_captured = False  # ...captured as graphs (else run eagerly in those shapes)
        self.requests: dict[str, CachedRequestState] = {}
        on_cuda = self.device.type == "cuda"
        # Each slot's graphs are captured on a stream of their own (see `capture_graph`): the
        # graphs of a slot restaged across precisions go, and with them the cuBLAS workspace of
        # the stream they were captured on, which the other slot's graphs must not share.
        self._capture_streams = {
            index: torch.cuda.Stream(self.device) for index in range(slots.num_slots)
        } if on_cuda else {}  # fmt: skip
        # Two pinned buffers (and events) for the sampled ids, used in turn: with asynchronous
        # scheduling step N+1's copy is queued before the host has read step N's.
        self._tokens_host = [
            torch.empty(builder.max_num_seqs, dtype=torch.int64, pin_memory=True)
            for _ in range(2)
        ] if on_cuda else None  # fmt: skip
        self._tokens_ready = [torch.cuda.Event() for _ in range(2)] if on_cuda else None
        self._turn = 0
        # The last launched step whose result() has not run: a step launched meanwhile takes
        # the tokens it sampled from the device (asynchronous scheduling).
        self._last: PendingStep | None = None
        self._patch = _InputPatch(builder.max_num_seqs, self.device)
        # Canary probes' log-probabilities, one [chunk tokens, vocab] float32 per chunk.
        self._probe_logprobs: dict[str, list[torch.Tensor]] = {}
        # Logit bias, penalties and grammar masks of the requests that ask for them.
        self.logits_processors = LogitsProcessors(builder.max_num_seqs, self.device, grammars)

    @property
    def weights_version(self) -> str:
        """The version new requests run on (the active slot's)."""
        return self.slots.active_version

    @property
    def weights(self) -> LlamaWeights:
        """The active slot's weights."""
        return self.slots.weights(self.slots.active)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The active slot's decode graphs (None when eager)."""
        return self.slot_graphs.get(self.slots.active)

    def capture_graphs(self, buckets: list[int]) -> float:
        """Capture decode CUDA graphs for every slot; returns the seconds it took.

        A slot's tensors never move (staging copies into them), so its graphs stay valid for
        every version it will hold: a commit flips an index and copies nothing.
        """
        seconds = 0.0
        self._decode_buckets = list(buckets)
        for index in range(self.slots.num_slots):
            graphs = DecodeGraphs(self.model, self.builder, self.kv_caches, buckets)
            pool = self._graph_pools.setdefault(index, torch.cuda.graph_pool_handle())
            seconds += graphs.capture(self.slots.weights(index), pool,
                                      self._capture_streams[index])  # fmt: skip
            self.slot_graphs[index] = graphs
        return seconds

    def prepare_mixed_steps(self, token_buckets: list[int], capture: bool) -> float:
        """Run steps with prompt tokens in fixed shapes per token bucket, on every slot;
        returns the seconds capture took.

        Args:
            token_buckets: the token counts a step is padded to (`mixed_graphs.token_buckets`).
            capture: capture them as CUDA graphs (CUDA; each slot's share the pool of its
                decode graphs); False runs the same fixed-shape forward eagerly (the CPU check
                of what the graphs compute).
        """
        seconds = 0.0
        self._mixed_buckets, self._mixed_captured = list(token_buckets), capture
        for index in range(self.slots.num_slots):
            mixed = MixedGraphs(
                self.model, self.builder, self.kv_caches, self.slots.weights(index), token_buckets
            )
            if capture:
                pool = self._graph_pools.setdefault(index, torch.cuda.graph_pool_handle())
                seconds += mixed.capture(pool, self._capture_streams[index])
            self.slot_mixed[index] = mixed
        return seconds

    def recapture_graphs(self, index: int, beside_serving: bool = False) -> float:
        """Capture slot `index`'s decode and mixed-step graphs again, for tensors that moved (a
        version of another structure was staged into it); returns the seconds it took. The
        old graphs go first, and their memory with them. Eager slots have nothing to do.

        beside_serving: called on a thread of its own while the engine's goes on serving from
            the other slot, which it may: slot `index` is reserved (`WeightSlots.release`), so
            no step reads it or its graphs, and the capture touches nothing a step uses (the
            warm-ups, which run beside the steps, read input buffers of their own and write
            their kernels' scratch of their own: `BesideServing`). Else on the engine's
            thread between two steps.
        """
        pool = self._graph_pools.get(index)
        if not beside_serving or pool is None:
            return self._recapture(index, None)
        if self._model_beside is None:
            raise RuntimeError("this runner has no model to warm up beside serving with")
        if self._precompile is not None:
            try:
                seconds = self._precompile(self.slots.weights(index), self.capture_rows())
            except RuntimeError as exc:  # the warm-ups compile them, the engine's steps waiting
                log.warning("weight slot %d: its kernels could not be compiled ahead (%s); the "
                            "capture compiles them beside serving", index, exc)  # fmt: skip
            else:
                if seconds:
                    log.info("weight slot %d: its kernels compiled in a child process in "
                             "%.1fs", index, seconds)  # fmt: skip
        with torch.cuda.device(self.device):  # the calling thread's, for its launches and syncs
            b = self.builder
            beside = BesideServing(  # one host set: pinned memory made while serving
                StepInputBuilder(b.max_num_tokens, b.max_num_seqs, b.max_blocks_per_seq,
                                 b.block_size, b.device, host_sets=1),
                self._model_beside(),
            )  # fmt: skip
            serving = {t.data_ptr() for t in self.model.kernels.scratch}
            if serving & {t.data_ptr() for t in beside.model.kernels.scratch}:
                raise RuntimeError("the warm-ups' kernels share scratch with the serving ones")
            return self._recapture(index, beside)

    def capture_rows(self) -> tuple[int, ...]:
        """Every row count a capture runs the linears at: the decode graphs' batches, the
        mixed graphs' token buckets and their logits rows, and a canary chunk's logits."""
        rows = {*self._decode_buckets, *self._mixed_buckets, *PROBE_WARM_ROWS}
        rows.update(self.builder.mixed_logits_rows(b) for b in self._mixed_buckets)
        return tuple(sorted(rows))

    def _recapture(self, index: int, beside: BesideServing | None) -> float:
        seconds = 0.0
        pool = self._graph_pools.get(index)
        stream = self._capture_streams.get(index)
        # The old graphs first: their memory goes back to the pool. A capture that fails
        # leaves the slot without graphs, and the next call captures what the runner captures.
        self.slot_graphs.pop(index, None)
        self.slot_mixed.pop(index, None)
        if pool is not None:
            # The new graphs take a pool of their own: torch's device and pinned-host
            # allocators keep the record of a pool whose graphs have all gone, and a capture
            # into it fails their checks unless both caches were emptied first (torch's
            # `graph` does that between two steps). The old pool's memory goes back here.
            pool = self._graph_pools[index] = torch.cuda.graph_pool_handle()
            torch.cuda.empty_cache()
        weights = self.slots.weights(index)
        if self._decode_buckets and pool is not None:
            graphs = DecodeGraphs(self.model, self.builder, self.kv_caches, self._decode_buckets)
            seconds += graphs.capture(weights, pool, stream, beside)
            self.slot_graphs[index] = graphs
        if self._mixed_buckets:
            mixed = MixedGraphs(self.model, self.builder, self.kv_caches, weights,
                                self._mixed_buckets)  # fmt: skip
            if self._mixed_captured and pool is not None:
                seconds += mixed.capture(pool, stream, beside)
            self.slot_mixed[index] = mixed
        return seconds

    @property
    def overlaps_host_work(self) -> bool:
        """True when `launch` returns before the GPU is done (the engine overlaps host work)."""
        return self.device.type == "cuda"

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(sched_out).result()

    @torch.inference_mode()
    def warm_probe_logprobs(self, rows: Sequence[int] = PROBE_WARM_ROWS) -> None:
        """Run what a canary probe's chunk adds to a step (the logits of its hidden states,
        outside the step's graph, and their log-softmax) once per row count in `rows`, on
        the active slot, so that its kernels are compiled and their modules loaded before
        serving: CUDA loads a kernel's module at its first launch, and on an H200 the first
        canary of every benchmark run held a serving step 40-100 ms on the host (later
        canaries, none). Keeps nothing."""
        logits = functools.partial(self.model.compute_logits, self.weights)
        for n in rows:
            hidden = torch.zeros(n, self.model.arch.hidden_size, dtype=self.slots.dtype,
                                 device=self.device)  # fmt: skip
            probe_log_softmax(logits, hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def take_prompt_logprobs(self, req_id: str) -> torch.Tensor:
        """The log-probabilities of every position canary probe `req_id` computed, in order
        ([num_tokens, vocab] float32, on the device); they are kept no longer.

        Raises:
            KeyError: no step computed a token of `req_id`.
        """
        chunks = self._probe_logprobs.pop(req_id)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    @torch.inference_mode()
    def launch(self, sched_out: SchedulerOutput) -> PendingStep:
        """Queue the step's work; `result()` on the returned object waits for its tokens."""
        self._update_states(sched_out)
        req_ids = list(sched_out.num_scheduled_tokens)
        if sched_out.is_empty:
            return PendingStep(self, req_ids, [], None)
        last = self._last
        awaiting = self._await_last_tokens(last, sched_out.num_scheduled_tokens)
        source = last.device_tokens if last is not None else None
        groups: dict[str, list[CachedRequestState]] = {}  # version -> its sub-batch
        for req_id in req_ids:
            state = self.requests[req_id]
            groups.setdefault(state.weights_version, []).append(state)
        rows: list[CachedRequestState] = []
        sampled: list[torch.Tensor] = []  # per sub-batch: [num_sampled] int64
        logprobs: list[tuple[int, SampledLogprobs]] = []  # (first row, its sub-batch's)
        for version, states in groups.items():
            # One sub-batch per version, in turn: on CUDA they queue on one stream, so the next
            # one's input copies wait for this one's forward, and its sampling is queued first.
            logits, inputs, hidden = self._forward(
                version, states, sched_out.num_scheduled_tokens, awaiting, source
            )
            if hidden is not None and any(s.probe for s in states):
                self._keep_probe_logprobs(version, inputs, hidden, sched_out.num_scheduled_tokens)
            group_rows = [self.requests[r] for r in inputs.sampled_req_ids]
            if group_rows:
                tokens, group_logprobs = self._sample(logits, group_rows, inputs, awaiting)
                if group_logprobs is not None:
                    logprobs.append((len(rows), group_logprobs))
                rows += group_rows
                sampled.append(tokens)
        if not rows:
            return PendingStep(self, req_ids, [], None)
        tokens = sampled[0] if len(sampled) == 1 else torch.cat(sampled)
        # Where each row's token goes: the end of its tokens now (a placeholder is appended
        # there if a later step is launched before this one's result).
        indices = [len(state.token_ids) for state in rows]
        host, ready = tokens, None
        for _, group_logprobs in logprobs:
            group_logprobs.to_host()  # queued before the ready event: read after its sync
        if self._tokens_host is not None and self._tokens_ready is not None:
            # CUDA: copy into pinned memory, sync later.
            self._turn ^= 1
            host = self._tokens_host[self._turn][: len(rows)]
            host.copy_(tokens, non_blocking=True)
            ready = self._tokens_ready[self._turn]
            ready.record()
        pending = PendingStep(self, req_ids, rows, host, ready, indices, tokens, logprobs)
        self._last = pending
        return pending

    def _await_last_tokens(
        self, last: PendingStep | None, num_sched: dict[str, int]
    ) -> dict[str, int]:
        """Requests whose next input token is the one `last` (launched, its result not taken)
        is still sampling: each gets a placeholder token, and {req_id: row of `last`'s output}
        says where the real one is on the device (asynchronous scheduling; empty otherwise)."""
        awaiting: dict[str, int] = {}
        if last is None:
            return awaiting
        row_of = {state.req_id: i for i, state in enumerate(last.rows)}
        for req_id in num_sched:
            state = self.requests[req_id]
            if state.num_computed_tokens == len(state.token_ids) and state.samples:
                row = row_of.get(req_id)
                if row is None:
                    raise RuntimeError(f"{req_id!r} is scheduled past its known tokens")
                state.token_ids.append(0)  # placeholder: the device has the real one
                awaiting[req_id] = row
        return awaiting

    def _sample(
        self,
        logits: torch.Tensor,  # [num_sampled, vocab] float32
        rows: list[CachedRequestState],
        inputs: StepInputs,
        awaiting: dict[str, int],
    ) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """The sampled ids ([num_sampled] int64, on the device) and their logprobs if asked."""
        logprobs = SampledLogprobs(logits, rows) if SampledLogprobs.wanted(rows) else None
        if any(s.params.logit_bias or s.params.penalized or s.params.grammar for s in rows):
            last_tokens = inputs.input_ids.index_select(0, inputs.logits_indices)
            self.logits_processors.apply(logits, rows, last_tokens, frozenset(awaiting))
        tokens = sample_on_device(
            logits,
            [s.params for s in rows],
            [s.seed for s in rows],
            [s.num_output_tokens for s in rows],
        )
        if logprobs is not None:
            logprobs.record(tokens)
        return tokens, logprobs

    def _forward(
        self,
        version: str,
        states: list[CachedRequestState],
        num_sched: dict[str, int],
        awaiting: dict[str, int] | None = None,
        source: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, StepInputs, torch.Tensor | None]:
        """Logits of the rows to sample ([num_sampled, vocab] float32), the inputs and the
        final hidden states of every token ([num_tokens (padded), hidden]; None from a decode
        graph, which never carries a probe), for a sub-batch of one version, on its slot."""
        index = self.slots.index_of(version)
        if index is None:
            raise RuntimeError(f"weights version {version!r} is in no slot ({self.slots.versions})")
        weights = self.slots.weights(index)
        graphs = self.slot_graphs.get(index)
        if (
            graphs is not None
            and len(states) <= graphs.max_batch
            and all(num_sched[s.req_id] == 1 and s.samples
                    and s.num_computed_tokens + 1 == len(s.token_ids) for s in states)
        ):  # fmt: skip
            bucket = graphs.bucket_for(len(states))
            inputs = self.builder.build(states, num_sched, pad_decodes_to=bucket)
            self._patch.apply(inputs, awaiting, source)
            # Decode rows are laid out in order and each samples: row i is request i.
            return graphs.replay(bucket)[: len(states)], inputs, None
        mixed = self.slot_mixed.get(index)
        num_tokens = sum(num_sched[s.req_id] for s in states) if mixed is not None else 0
        if mixed is not None and mixed.fits(num_tokens, len(states)):
            bucket = mixed.bucket_for(num_tokens)
            inputs = self.builder.build(states, num_sched, pad_tokens_to=bucket)
            self._patch.apply(inputs, awaiting, source)
            # Row i of the graph's logits is the i-th sampled row; the rest are padding.
            logits = mixed.run(bucket)[: len(inputs.sampled_req_ids)]
            return logits, inputs, mixed.hidden(bucket)
        inputs = self.builder.build(states, num_sched)
        self._patch.apply(inputs, awaiting, source)
        hidden = self.model.forward(
            weights, inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches
        )
        return self.model.compute_logits(weights, hidden[inputs.logits_indices]), inputs, hidden

    def _keep_probe_logprobs(
        self,
        version: str,
        inputs: StepInputs,
        hidden: torch.Tensor,  # [num_tokens (padded), hidden]
        num_sched: dict[str, int],
    ) -> None:
        """Keep the log-probabilities of the probes' tokens in this sub-batch."""
        spans: list[tuple[str, int, int]] = []  # (probe, first token row, tokens)
        row = 0
        for req_id in inputs.req_ids:  # the batch's token order: each request's chunk in turn
            n = num_sched[req_id]
            if self.requests[req_id].probe:
                spans.append((req_id, row, n))
            row += n
        logits = functools.partial(self.model.compute_logits, self.slots.weights_for(version))
        picked = torch.cat([hidden[start : start + n] for _, start, n in spans])  # [probes, H]
        logprobs = probe_log_softmax(logits, picked)
        for (req_id, _, _), chunk in zip(spans, logprobs.split([n for _, _, n in spans])):
            self._probe_logprobs.setdefault(req_id, []).append(chunk)  # [n, vocab]

    def _update_states(self, sched_out: SchedulerOutput) -> None:
        for req_id in sched_out.finished_req_ids | sched_out.preempted_req_ids:
            self.requests.pop(req_id, None)
            self._probe_logprobs.pop(req_id, None)  # a probe that failed: nobody takes them
        # Requests first, then shadows, which share their request's token list: the tokens it
        # samples show in the shadow's rows too.
        for new in sorted(sched_out.new_reqs, key=lambda n: n.shadow_of is not None):
            token_ids = list(new.token_ids)
            if new.shadow_of is not None:
                token_ids = self.requests[new.shadow_of].token_ids
                assert token_ids[: len(new.token_ids)] == new.token_ids, "shadow tokens differ"
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=token_ids,
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.params,
                seed=new.seed,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                weights_version=new.weights_version,
                samples=new.shadow_of is None and not new.probe,
                probe=new.probe,
            )
        for migrated in sched_out.migrated:  # took its shadow's KV: new table, new version
            state = self.requests[migrated.req_id]
            state.block_ids = list(migrated.block_ids)
            state.num_computed_tokens = migrated.num_computed_tokens
            state.weights_version = migrated.weights_version
        for cached in sched_out.cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens


class PendingStep:
    """A launched step whose sampled token ids may still be on their way to the host."""

    def __init__(
        self,
        runner: ModelRunner,
        req_ids: list[str],
        rows: list[CachedRequestState],
        tokens: torch.Tensor | None,  # [len(rows)] int64: pinned host buffer on CUDA
        ready: torch.cuda.Event | None = None,  # recorded after the copy into `tokens`
        indices: list[int] | None = None,  # per row: where its token goes in its token ids
        device_tokens: torch.Tensor | None = None,  # the sampled ids where they were sampled
        logprobs: list[tuple[int, SampledLogprobs]] | None = None,  # (first row, sub-batch's)
    ) -> None:
        self._runner = runner
        self._req_ids = req_ids
        self.rows = rows
        self._tokens = tokens
        self._ready = ready
        self._indices = indices or [len(state.token_ids) for state in rows]
        self.device_tokens = device_tokens
        self._logprobs = logprobs or []

    def result(self) -> ModelRunnerOutput:
        """Wait for the sampled ids (the step's one host sync) and record them."""
        if self._runner._last is self:
            self._runner._last = None
        sampled: dict[str, list[int]] = {}
        if self._tokens is not None:
            if self._ready is not None:
                self._ready.synchronize()  # releases the GIL while the GPU finishes
            for state, index, token_id in zip(self.rows, self._indices, self._tokens.tolist()):
                if index < len(state.token_ids):
                    state.token_ids[index] = token_id  # a later step put a placeholder there
                else:
                    state.token_ids.append(token_id)
                sampled[state.req_id] = [token_id]
        output = ModelRunnerOutput(self._req_ids, [sampled.get(r, []) for r in self._req_ids])
        if self._logprobs:
            output.logprobs = self._logprob_lists(sampled)
        return output

    def _logprob_lists(self, sampled: dict[str, list[int]]) -> list[list[TokenLogprob]]:
        """Per req_id, the logprobs of its sampled token (empty where none was asked)."""
        by_req: dict[str, list[TokenLogprob]] = {}
        for first, group in self._logprobs:
            rows = self.rows[first : first + group.num_rows]
            token_ids = [sampled[state.req_id][0] for state in rows]
            for row, entry in group.entries(token_ids).items():
                by_req[rows[row].req_id] = [entry]
        return [by_req.get(r, []) for r in self._req_ids]


class _InputPatch:
    """Writes tokens a previous step sampled, still on the device, into a step's input ids
    (asynchronous scheduling): the rows and source indices go over in one pinned copy, out of
    host buffers taken in turn (as `StepInputBuilder`'s: a step's second sub-batch must not
    wait on the host for the first one's forward, behind which its copy queues)."""

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        sets = HOST_SETS if on_cuda else 1
        self._host = torch.zeros(sets, 2, max_num_seqs, dtype=torch.int64, pin_memory=on_cuda)
        self._dev = self._host[0].to(device) if on_cuda else self._host[0]
        self._copied = [torch.cuda.Event() for _ in range(sets)] if on_cuda else []
        self._turn = 0

    def apply(
        self, inputs: StepInputs, awaiting: dict[str, int] | None, source: torch.Tensor | None
    ) -> None:
        """`awaiting`: {req_id: row of `source`, the last step's sampled ids}."""
        if not awaiting:
            return
        patch = [(row, awaiting[req_id]) for row, req_id in enumerate(inputs.req_ids)
                 if req_id in awaiting]  # fmt: skip
        if not patch:
            return
        assert source is not None
        n = len(patch)
        if self._copied:
            self._turn = (self._turn + 1) % len(self._copied)
            self._copied[self._turn].synchronize()  # the set's last copy has left it
        pinned = self._host[self._turn]
        # rows (decodes come first: row i is token i), sources
        pinned.numpy()[:, :n] = np.array(patch).T
        index = self._dev[:, :n]
        if self._copied:
            index.copy_(pinned[:, :n], non_blocking=True)
            self._copied[self._turn].record()
        inputs.input_ids.index_copy_(0, index[0], source.index_select(0, index[1]))
