"""Per-request state the runner keeps, and the step's input tensors built from it.

The scheduler sends only what changed (`SchedulerOutput`); the runner keeps each request's
tokens and block table here. `StepInputBuilder` lays out one step's ragged batch (decodes
first, then prompt chunks) into persistent host buffers (pinned on CUDA), copies them to
persistent device buffers once per step, and returns views of those as `StepInputs`. The device
buffers are also the static inputs of the CUDA graphs (`cuda_graphs.py`): a decode batch padded
to a graph's bucket has seq_len 0 and slot -1 in its padding rows. A mixed step padded to a
token bucket (`mixed_graphs.py`, `pad_tokens_to`) fills every buffer to fixed sizes: padding
tokens (id 0, position 0, slot -1) belong to no sequence, padding sequences are empty
(seq_len 0, `query_start_loc` repeats the real total), padding logits rows gather token 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sitsd.model.attention import AttentionMetadata
from sitsd.runtime.grammar import GrammarState
from sitsd.types import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers of a request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + sampled tokens
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    weights_version: str = ""  # the weights slot it runs on
    samples: bool = True  # False for a migration shadow or a probe: they never sample
    probe: bool = False  # a canary probe: the runner keeps its positions' log-probabilities
    grammar: GrammarState | None = None  # structured output: its matcher, made on first use

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    """One step's model inputs plus the host-side bookkeeping to read its outputs."""

    input_ids: torch.Tensor  # [num_tokens] int64 (num_tokens includes graph padding)
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    req_ids: list[str]  # batch order (decodes first)
    logits_indices: torch.Tensor  # [num_sampled] int64: the token whose logits are sampled
    sampled_req_ids: list[str]  # the requests those rows belong to
    num_tokens: int  # real tokens, without padding
    is_decode_only: bool


class _Buffers:
    """One set of input buffers (host or device), sized for the largest step."""

    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device, pin: bool
    ) -> None:
        def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device, pin_memory=pin)

        self.input_ids = make(max_tokens, dtype=torch.int64)
        self.positions = make(max_tokens, dtype=torch.int64)
        self.slot_mapping = make(max_tokens, dtype=torch.int64)
        self.logits_indices = make(max_seqs, dtype=torch.int64)
        self.seq_lens = make(max_seqs, dtype=torch.int32)
        self.query_start_loc = make(max_seqs + 1, dtype=torch.int32)
        self.prefill_query_start_loc = make(max_seqs + 1, dtype=torch.int32)
        self.block_tables = make(max_seqs, max_blocks, dtype=torch.int32)

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.slot_mapping, self.logits_indices,
                self.seq_lens, self.query_start_loc, self.prefill_query_start_loc,
                self.block_tables]  # fmt: skip


# Host buffer sets a CUDA builder writes in turn: a step of two weights versions builds twice.
HOST_SETS = 4


class StepInputBuilder:
    """Builds `StepInputs` into persistent buffers; one host-to-device copy per buffer a step."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        host_sets: int = HOST_SETS,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        on_cuda = device.type == "cuda"
        cpu = torch.device("cpu")
        # On CUDA the builds take `host_sets` host buffer sets in turn: a build waits until the
        # copies out of its set, `host_sets` builds ago, have run, and the copies of a step's
        # second sub-batch queue behind the first one's forward (one stream): with one set, the
        # next build waited for that forward on the host, which then showed as launch time.
        self._hosts = [
            _Buffers(max_num_tokens, max_num_seqs, max_blocks_per_seq, cpu, on_cuda)
            for _ in range(host_sets if on_cuda else 1)
        ]  # fmt: skip
        self._nps = [{name: t.numpy() for name, t in vars(h).items()} for h in self._hosts]
        self._copied = [torch.cuda.Event() for _ in self._hosts] if on_cuda else []
        self._turn = 0  # the set the last build wrote
        # On the CPU the host buffers are the inputs: no copy.
        self.dev = (
            _Buffers(max_num_tokens, max_num_seqs, max_blocks_per_seq, device, False)
            if on_cuda else self._hosts[0]
        )  # fmt: skip

    @property
    def host(self) -> _Buffers:
        """The host buffers the last build wrote (the inputs themselves on the CPU)."""
        return self._hosts[self._turn]

    def build(
        self,
        states: list[CachedRequestState],
        num_scheduled: dict[str, int],
        pad_decodes_to: int | None = None,
        pad_tokens_to: int | None = None,
    ) -> StepInputs:
        """Lay out the batch: decodes (one token) first, then prompt chunks, in given order.

        Args:
            states: the scheduled requests.
            num_scheduled: tokens to compute per request this step.
            pad_decodes_to: for a decode-only batch replayed by a CUDA graph, the graph's batch
                size; rows past the real batch become padding (seq_len 0, slot -1).
            pad_tokens_to: for any batch run in a mixed step's fixed shapes, its token bucket:
                the inputs are padded to it and to `max_num_seqs` sequences, and `meta` is
                `mixed_meta(pad_tokens_to)` (one unified attention call).
        """
        if self._copied:
            self._turn = (self._turn + 1) % len(self._hosts)
            self._copied[self._turn].synchronize()  # the set's last copies have left it
        # A decode computes the one token it then samples from; a one-token chunk that does not
        # reach the end of its prompt (or a shadow's, which never samples) goes with the prefills.
        decodes = [
            s
            for s in states
            if num_scheduled[s.req_id] == 1
            and s.samples
            and s.num_computed_tokens + 1 == len(s.token_ids)
        ]
        decode_ids = {s.req_id for s in decodes}
        prefills = [s for s in states if s.req_id not in decode_ids]
        ordered = decodes + prefills
        h = self._nps[self._turn]
        bs = self.block_size
        # Decodes: one token each, laid out with list comprehensions (the hot path at large
        # batch), then one numpy assignment per buffer.
        nd = len(decodes)
        pos = [s.num_computed_tokens for s in decodes]
        h["input_ids"][:nd] = [s.token_ids[p] for s, p in zip(decodes, pos)]
        h["positions"][:nd] = pos
        h["slot_mapping"][:nd] = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(decodes, pos)]
        h["seq_lens"][:nd] = [p + 1 for p in pos]
        h["query_start_loc"][: nd + 1] = np.arange(nd + 1)
        sampled_req_ids = [s.req_id for s in decodes]
        h["logits_indices"][:nd] = np.arange(nd)
        num_tokens, num_sampled = nd, nd
        for i, state in enumerate(prefills, start=nd):
            start = state.num_computed_tokens
            n = num_scheduled[state.req_id]
            end = start + n
            span = slice(num_tokens, num_tokens + n)
            h["input_ids"][span] = state.token_ids[start:end]
            positions = np.arange(start, end)
            h["positions"][span] = positions
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            h["slot_mapping"][span] = blocks[positions // bs] * bs + positions % bs
            h["seq_lens"][i] = end
            num_tokens += n
            h["query_start_loc"][i + 1] = num_tokens
            if end == len(state.token_ids) and state.samples:  # reaches the last known token
                h["logits_indices"][num_sampled] = num_tokens - 1
                num_sampled += 1
                sampled_req_ids.append(state.req_id)
        max_blocks = max((len(s.block_ids) for s in ordered), default=1)
        for i, state in enumerate(ordered):
            h["block_tables"][i, : len(state.block_ids)] = state.block_ids
        if pad_tokens_to is not None:
            assert pad_decodes_to is None, "one kind of padding at a time"
            inputs = self._pad_mixed(pad_tokens_to, len(ordered), num_tokens, num_sampled)
            self._copy(pad_tokens_to, self.max_num_seqs, self.mixed_logits_rows(pad_tokens_to),
                       1, max_blocks)  # fmt: skip
            inputs.req_ids = [s.req_id for s in ordered]
            inputs.sampled_req_ids = sampled_req_ids
            inputs.is_decode_only = not prefills
            return inputs
        num_seqs = len(ordered)
        num_decodes = len(decodes)
        padded_seqs, padded_tokens = num_seqs, num_tokens
        if pad_decodes_to is not None:
            assert not prefills, "only decode-only batches are padded for graphs"
            assert pad_decodes_to >= num_seqs
            padded_seqs = padded_tokens = pad_decodes_to
            pad = slice(num_seqs, pad_decodes_to)
            h["input_ids"][pad] = 0
            h["positions"][pad] = 0
            h["slot_mapping"][pad] = -1
            h["seq_lens"][pad] = 0
            h["query_start_loc"][num_seqs + 1 : pad_decodes_to + 1] = num_tokens
            # Graph replays read the whole static table: stale rows must not hold ids past the
            # pool, and padding rows are never read (seq_len 0).
            max_blocks = self.max_blocks_per_seq
        q0 = h["query_start_loc"][num_decodes]
        num_prefills = num_seqs - num_decodes
        h["prefill_query_start_loc"][: num_prefills + 1] = (
            h["query_start_loc"][num_decodes : num_seqs + 1] - q0
        )
        self._copy(padded_tokens, padded_seqs, num_sampled, num_prefills + 1, max_blocks)
        d = self.dev
        meta = AttentionMetadata(
            slot_mapping=d.slot_mapping[:padded_tokens],
            block_tables=d.block_tables[:padded_seqs, :max_blocks],
            seq_lens=d.seq_lens[:padded_seqs],
            query_start_loc=d.query_start_loc[: padded_seqs + 1],
            prefill_query_start_loc=d.prefill_query_start_loc[: num_prefills + 1],
            num_decodes=padded_seqs if pad_decodes_to is not None else num_decodes,
            num_decode_tokens=padded_seqs if pad_decodes_to is not None else num_decodes,
            max_seq_len=int(h["seq_lens"][:num_seqs].max()) if num_seqs else 0,
        )
        return StepInputs(
            input_ids=d.input_ids[:padded_tokens],
            positions=d.positions[:padded_tokens],
            meta=meta,
            req_ids=[s.req_id for s in ordered],
            logits_indices=d.logits_indices[:num_sampled],
            sampled_req_ids=sampled_req_ids,
            num_tokens=num_tokens,
            is_decode_only=not prefills,
        )

    def mixed_logits_rows(self, num_tokens: int) -> int:
        """Logits rows a mixed step padded to `num_tokens` computes (at most one per sequence)."""
        return min(num_tokens, self.max_num_seqs)

    def mixed_meta(self, num_tokens: int) -> AttentionMetadata:
        """Fixed-shape metadata of a mixed step padded to `num_tokens` tokens: views of the
        device buffers whose shapes depend on `num_tokens` only (a mixed CUDA graph's)."""
        d, max_seqs = self.dev, self.max_num_seqs
        return AttentionMetadata(
            slot_mapping=d.slot_mapping[:num_tokens],
            block_tables=d.block_tables[:max_seqs],  # full width: any context up to the maximum
            seq_lens=d.seq_lens[:max_seqs],
            query_start_loc=d.query_start_loc[: max_seqs + 1],
            prefill_query_start_loc=d.prefill_query_start_loc[:1],  # unused when unified
            num_decodes=0,
            num_decode_tokens=0,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
            unified=True,
        )

    def _pad_mixed(
        self, bucket: int, num_seqs: int, num_tokens: int, num_sampled: int
    ) -> StepInputs:
        """Pad the laid-out host buffers to `bucket` tokens and `max_num_seqs` sequences."""
        if not num_tokens <= bucket <= self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens do not fit bucket {bucket}")
        h = self._nps[self._turn]
        h["input_ids"][num_tokens:bucket] = 0
        h["positions"][num_tokens:bucket] = 0
        h["slot_mapping"][num_tokens:bucket] = -1
        h["seq_lens"][num_seqs:] = 0
        h["query_start_loc"][num_seqs + 1 :] = num_tokens
        # Stale indices of an earlier, larger step would gather past this bucket's rows.
        h["logits_indices"][num_sampled : self.mixed_logits_rows(bucket)] = 0
        d = self.dev
        return StepInputs(
            input_ids=d.input_ids[:bucket],
            positions=d.positions[:bucket],
            meta=self.mixed_meta(bucket),
            req_ids=[],
            logits_indices=d.logits_indices[:num_sampled],
            sampled_req_ids=[],
            num_tokens=num_tokens,
            is_decode_only=False,
        )

    def _copy(
        self,
        num_tokens: int,
        num_seqs: int,
        num_sampled: int,
        num_prefill_qsl: int,
        max_blocks: int,
    ) -> None:
        if self.dev is self.host:
            return
        h, d = self.host, self.dev
        # Pinned source + non_blocking: queued on the stream, no host sync.
        for name, n in (("input_ids", num_tokens), ("positions", num_tokens),
                        ("slot_mapping", num_tokens), ("logits_indices", num_sampled),
                        ("seq_lens", num_seqs), ("query_start_loc", num_seqs + 1),
                        ("prefill_query_start_loc", num_prefill_qsl)):  # fmt: skip
            getattr(d, name)[:n].copy_(getattr(h, name)[:n], non_blocking=True)
        d.block_tables[:num_seqs, :max_blocks].copy_(
            h.block_tables[:num_seqs, :max_blocks], non_blocking=True
        )
        self._copied[self._turn].record()


def build_step_inputs(
    states: list[CachedRequestState],
    num_scheduled: dict[str, int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> StepInputs:
    """One-off `StepInputs` with buffers sized for this batch (tests and tools)."""
    builder = StepInputBuilder(
        max_num_tokens=sum(num_scheduled[s.req_id] for s in states),
        max_num_seqs=len(states),
        max_blocks_per_seq=max(len(s.block_ids) for s in states),
        block_size=block_size,
        device=torch.device(device),
    )
    return builder.build(states, num_scheduled)
