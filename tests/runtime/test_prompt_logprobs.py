"""Canary probes in the model runner: prompts scored inside normal steps next to the requests
being served (`NewRequestData.probe`, the canary's forward pass), in chunks, each on the slot of
its version, equal to transformers' log-softmax on the same weights, leaving requests alone.

Driven by the real scheduler (its probes part) and the real CPU runner, eagerly and in the
fixed shapes of mixed-step graphs."""

from __future__ import annotations

import pytest
import torch

from sitsd.config import SchedulerConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.pacing import PacingSettings
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler
from sitsd.runtime.mixed_graphs import token_buckets
from sitsd.runtime.model_runner import PROBE_WARM_ROWS, probe_log_softmax
from sitsd.types import SamplingParams, Tier
from tests.runtime.test_weight_slots import BLOCK, runner_with_two_versions
from tests.weights.tiny_models import tiny_llama_model


def serve(runner, requests, probes, chunk=7, max_steps=200):
    """Run `requests` ({req_id: (prompt, version, num_new)}) to the end and `probes`
    ([(prompt, version)], queued at the start) through a scheduler and `runner`; returns
    (tokens per request, log-probabilities per probe, num_scheduled_tokens of every step).
    Probes get `chunk` tokens a step."""
    kv = KVCacheManager(64, BLOCK)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, policy="fcfs")
    sched = Scheduler(cfg, kv, 256, pacing=PacingSettings(fixed_tokens=chunk))
    for req_id, (prompt, version, num_new) in requests.items():
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        sched.add_request(Request(req_id, list(prompt), params, seed=0, tier=Tier.SILVER,
                                  arrival_time=0.0, weights_version=version))  # fmt: skip
    results: dict[int, torch.Tensor] = {}

    def done(index, probe_id, error):
        assert error is None, error
        results[index] = runner.take_prompt_logprobs(probe_id)

    for index, (prompt, version) in enumerate(probes):
        sched.probes.add(prompt, version, lambda p, e, i=index: done(i, p, e))
    tokens = {r: [] for r in requests}
    steps = []
    while sched.has_work():
        so = sched.schedule()
        steps.append(dict(so.num_scheduled_tokens))
        for update in sched.update_from_output(so, runner.execute(so)):
            tokens[update.request.req_id] += update.new_token_ids
        assert len(steps) < max_steps
    runner.execute(sched.schedule())  # the runner hears of the last finished ids
    assert kv.num_used_blocks == 0, "the probes' blocks went back to the pool"
    return tokens, [results[i] for i in range(len(probes))], steps


def transformers_logprobs(seed, prompt):
    with torch.no_grad():
        logits = tiny_llama_model(seed=seed)(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("shapes", ["eager", "mixed"])
def test_probes_in_steps_with_decoding_requests_equal_transformers_log_softmax(rng, shapes):
    runner, arch = runner_with_two_versions(tmp_seed_a=1, tmp_seed_b=2)
    if shapes == "mixed":  # the fixed-shape forward the mixed-step graphs capture, on the CPU
        runner.prepare_mixed_steps(token_buckets(runner.builder.max_num_tokens), capture=False)
    requests = {
        f"r{i}": ([rng.randrange(arch.vocab_size) for _ in range(rng.randrange(3, 30))], "v1", 12)
        for i in range(3)
    }
    probes = [
        ([rng.randrange(arch.vocab_size) for _ in range(37)], "v1"),  # past two KV blocks
        ([rng.randrange(arch.vocab_size) for _ in range(rng.randrange(2, 20))], "v2"),
    ]
    alone, _, _ = serve(runner, requests, [])
    tokens, got, steps = serve(runner, requests, probes)
    assert tokens == alone, "probes changed what requests generate"
    probe_steps = [s for s in steps if any(r.startswith("\x00probe") for r in s)]
    assert len(probe_steps) >= 37 // 7, "a probe goes in chunks"
    assert all(any(r in s for r in requests) for s in probe_steps[:2]), "probes ride with requests"
    atol = 1e-4 if shapes == "mixed" else 2e-5
    for (prompt, version), logprobs in zip(probes, got):
        want = transformers_logprobs(1 if version == "v1" else 2, prompt)
        torch.testing.assert_close(logprobs, want, atol=atol, rtol=0)


def test_warming_a_canarys_kernels_keeps_nothing_and_changes_no_probe():
    # The daemon runs a canary chunk's logits and the comparison once at start-up on a GPU
    # (their kernels' modules load at the first launch); the runner must keep nothing of it,
    # and a probe afterwards must score as on a runner never warmed.
    import math

    from sitsd.weights.canary import warm_compare

    prompt = [5, 9, 2, 7, 11, 3, 8, 4, 6, 10]
    cold, arch = runner_with_two_versions()
    warm, _ = runner_with_two_versions()
    warm.warm_probe_logprobs()
    assert warm._probe_logprobs == {}
    score = warm_compare(warm.device, arch.vocab_size)
    assert score.kl == 0.0
    assert score.nll_active == score.nll_new == pytest.approx(math.log(arch.vocab_size))
    _, (expected,), _ = serve(cold, {}, [(prompt, "v2")])
    _, (got,), _ = serve(warm, {}, [(prompt, "v2")])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("num_rows", [1, 3, 39, 256, 257, 700])
def test_a_canary_chunks_logits_run_only_at_the_row_counts_warmed_at_start_up(num_rows):
    # cuBLAS picks its kernel by rows and CUDA loads each kernel's module at its first launch:
    # a chunk at a row count the warm-up never ran held a GPU step 12-20 ms on the host.
    torch.manual_seed(num_rows)
    weight = torch.randn(50, 8)
    hidden = torch.randn(num_rows, 8)
    seen = []

    def logits(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return rows @ weight.T

    got = probe_log_softmax(logits, hidden)
    assert set(seen) <= set(PROBE_WARM_ROWS)
    torch.testing.assert_close(got, torch.log_softmax(hidden @ weight.T, -1), rtol=0, atol=1e-5)
