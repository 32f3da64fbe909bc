"""Per-request state the runner keeps, and the step's input tensors built from it.

The scheduler sends only what changed (`SchedulerOutput`); the runner keeps each request's
tokens and block table here. `build_step_inputs` lays out one step's ragged batch, decodes
first, and builds `AttentionMetadata` on the host, then moves it to the device in one go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sitsd.model.attention import AttentionMetadata
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

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    """One step's model inputs plus the host-side bookkeeping to read its outputs."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    req_ids: list[str]  # batch order (decodes first)
    logits_indices: torch.Tensor  # [num_sampled] int64: the token whose logits are sampled
    sampled_req_ids: list[str]  # the requests those rows belong to


def build_step_inputs(
    states: list[CachedRequestState],
    num_scheduled: dict[str, int],
    block_size: int,
    device: torch.device | str,
) -> StepInputs:
    """Lay out the batch: decodes (one token) first, then prompt chunks, in scheduler order."""
    decodes = [s for s in states if num_scheduled[s.req_id] == 1]
    prefills = [s for s in states if num_scheduled[s.req_id] > 1]
    ordered = decodes + prefills
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    sampled_req_ids: list[str] = []
    for state in ordered:
        start = state.num_computed_tokens
        end = start + num_scheduled[state.req_id]
        input_ids += state.token_ids[start:end]
        for pos in range(start, end):
            positions.append(pos)
            slot_mapping.append(state.block_ids[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + end - start)
        if end == len(state.token_ids):  # the chunk reaches the last known token: sample
            logits_indices.append(query_start_loc[-1] - 1)
            sampled_req_ids.append(state.req_id)
    max_blocks = max(len(s.block_ids) for s in ordered)
    block_tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in ordered]
    num_decodes = len(decodes)
    prefill_qsl = [q - query_start_loc[num_decodes] for q in query_start_loc[num_decodes:]]

    def ints(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=ints(slot_mapping, torch.int64),
        block_tables=ints(block_tables, torch.int32).view(len(ordered), max_blocks),
        seq_lens=ints(seq_lens, torch.int32),
        query_start_loc=ints(query_start_loc, torch.int32),
        prefill_query_start_loc=ints(prefill_qsl, torch.int32),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_seq_len=max(seq_lens),
    )
    return StepInputs(
        input_ids=ints(input_ids, torch.int64),
        positions=ints(positions, torch.int64),
        meta=meta,
        req_ids=[s.req_id for s in ordered],
        logits_indices=ints(logits_indices, torch.int64),
        sampled_req_ids=sampled_req_ids,
    )
