"""The model runner: owns the weights, the KV pool and per-request token rows; runs a step.

`execute(SchedulerOutput) -> ModelRunnerOutput` updates the per-request state from what the
scheduler changed, lays out the ragged batch (`input_batch.py`), runs the model, samples the
requests whose chunk reached their last token and returns plain lists. Which tokens to compute
is the scheduler's decision; this module never decides, it only computes.
"""

from __future__ import annotations

import torch

from sitsd.engine.outputs import ModelRunnerOutput, SchedulerOutput
from sitsd.model.llama import LlamaModel, LlamaWeights
from sitsd.runtime.input_batch import CachedRequestState, build_step_inputs
from sitsd.runtime.sampler import sample


class ModelRunner:
    """Runs steps of one model over one KV pool."""

    def __init__(
        self,
        model: LlamaModel,
        weights: LlamaWeights,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        weights_version: str,
    ) -> None:
        self.model = model
        self.weights = weights
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.weights_version = weights_version
        self.requests: dict[str, CachedRequestState] = {}

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched_out)
        if sched_out.is_empty:
            return ModelRunnerOutput([], [])
        states = [self.requests[r] for r in sched_out.num_scheduled_tokens]
        inputs = build_step_inputs(
            states, sched_out.num_scheduled_tokens, self.block_size, self.device
        )
        hidden = self.model.forward(
            self.weights, inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches
        )
        sampled: dict[str, list[int]] = {}
        if inputs.sampled_req_ids:
            logits = self.model.compute_logits(self.weights, hidden[inputs.logits_indices])
            rows = [self.requests[r] for r in inputs.sampled_req_ids]
            token_ids = sample(
                logits,
                [s.params for s in rows],
                [s.seed for s in rows],
                [s.num_output_tokens for s in rows],
            )
            for state, token_id in zip(rows, token_ids):
                state.token_ids.append(token_id)
                sampled[state.req_id] = [token_id]
        req_ids = list(sched_out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, [sampled.get(r, []) for r in req_ids])

    def _update_states(self, sched_out: SchedulerOutput) -> None:
        for req_id in sched_out.finished_req_ids | sched_out.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in sched_out.new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.params,
                seed=new.seed,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in sched_out.cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
