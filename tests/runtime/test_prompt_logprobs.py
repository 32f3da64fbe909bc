"""`ModelRunner.prompt_logprobs`: a prompt scored on one slot outside any request (the canary's
forward pass), equal to transformers' log-softmax on the same weights, leaving requests alone."""

from __future__ import annotations

import itertools
import random

import torch

from tests.runtime.test_weight_slots import greedy, runner_with_two_versions
from tests.weights.tiny_models import tiny_llama_model


def test_prompt_logprobs_on_each_slot_equal_transformers_log_softmax_of_that_version():
    runner, arch = runner_with_two_versions(tmp_seed_a=1, tmp_seed_b=2)
    rng = random.Random(7)
    prompt = [rng.randrange(arch.vocab_size) for _ in range(37)]  # past two KV blocks
    for slot, seed in ((runner.slots.index_of("v1"), 1), (runner.slots.index_of("v2"), 2)):
        got = runner.prompt_logprobs(prompt, slot)
        with torch.no_grad():
            logits = tiny_llama_model(seed=seed)(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, torch.log_softmax(logits.float(), -1), atol=2e-5, rtol=0)


def test_prompt_logprobs_between_steps_leave_running_requests_unchanged():
    runner, arch = runner_with_two_versions()
    rng = random.Random(3)
    prompts = {
        "a": ([rng.randrange(arch.vocab_size) for _ in range(20)], "v1"),
        "b": ([rng.randrange(arch.vocab_size) for _ in range(9)], "v2"),
    }
    want = greedy(runner, prompts, num_new=6)
    # Again, with prompts of growing length scored on both slots between every two steps: the
    # scratch KV pool grows for them and never touches a request's blocks.
    lengths = itertools.cycle([5, 70, 33, 90, 2, 17])

    def score_between_steps(sched_out):
        for slot in range(2):
            n = next(lengths)
            runner.prompt_logprobs([rng.randrange(arch.vocab_size) for _ in range(n)], slot)
        return execute(sched_out)

    execute = runner.execute
    runner.execute = score_between_steps
    assert greedy(runner, prompts, num_new=6) == want
