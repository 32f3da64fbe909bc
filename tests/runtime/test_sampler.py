"""Sampler: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sitsd.runtime.sampler import exponential_noise, mix_seed, sample, uniform_bits
from sitsd.types import SamplingParams


def random_logits(rows=4, vocab=50):
    return torch.randn(rows, vocab) * 3


def test_greedy_takes_the_argmax():
    logits = random_logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [0] * 4, [0] * 4) == logits.argmax(-1).tolist()


def test_same_seed_and_index_give_the_same_token_whatever_the_batch():
    logits = torch.randn(1, 50)  # flat enough that 20 draws never all pick one token
    p = SamplingParams(temperature=1.0)
    alone = [sample(logits, [p], [1234], [i])[0] for i in range(20)]
    others = random_logits(rows=3)
    batched = [
        sample(torch.cat([others, logits]), [p] * 4, [1, 2, 3, 1234], [i] * 4)[3] for i in range(20)
    ]
    assert alone == batched
    assert len(set(alone)) > 1  # the draws do vary with the index


def test_different_seeds_give_different_streams():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0)
    a = [sample(logits, [p], [1], [i])[0] for i in range(10)]
    b = [sample(logits, [p], [2], [i])[0] for i in range(10)]
    assert a != b


def test_top_k_only_ever_picks_among_the_k_best():
    logits = random_logits(rows=1, vocab=100)
    best = set(logits[0].topk(3).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=3)
    picks = {sample(logits, [p], [s], [0])[0] for s in range(200)}
    assert picks <= best
    assert len(picks) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.75)
    picks = {sample(logits, [p], [s], [0])[0] for s in range(300)}
    assert picks == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None]
    p = SamplingParams(temperature=1.0)
    n = 3000
    counts = (
        torch.bincount(
            torch.tensor([sample(logits, [p], [s], [0])[0] for s in range(n)]), minlength=3
        ).float()
        / n
    )
    assert torch.allclose(counts, probs, atol=0.04)


def test_mixed_greedy_and_random_rows():
    logits = random_logits(rows=3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, params, [0, 5, 0], [0, 0, 0])
    assert out == logits.argmax(-1).tolist()  # top_k=1 is greedy too


def splitmix_reference(seed: int, steps: int) -> int:
    """Pure-Python splitmix64 advanced `steps` times: what the tensor code must compute."""
    mask = (1 << 64) - 1
    z = (seed + steps * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_noise_bits_are_splitmix64_of_the_seed_and_token():
    seeds = [0, 1, (1 << 64) - 1, random.getrandbits(64), mix_seed(12345, 7)]
    vocab = 1000
    bits = uniform_bits(seeds, vocab, torch.device("cpu"))
    noise = exponential_noise(seeds, vocab, torch.device("cpu"))
    for row, seed in enumerate(seeds):
        for j in (0, 1, 499, vocab - 1):
            top = splitmix_reference(seed, j + 1) >> 41
            assert bits[row, j].item() == top
            assert noise[row, j].item() == pytest.approx(-math.log((top + 0.5) / 2**23), abs=1e-6)


def test_no_noise_is_zero_so_a_token_of_probability_zero_is_never_drawn():
    # 64 draws over a 2**20 vocabulary: 2**26 uniforms, so the largest one (all top bits set)
    # comes up several times. A noise of 0 there would make that token win the exponential race
    # whatever its probability (and a masked token's 0 / 0 is NaN, which argmax picks).
    vocab, one = 1 << 20, 7
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, one] = 0.0
    p = SamplingParams(temperature=1.0)
    for draw in range(64):
        noise = exponential_noise([mix_seed(3, draw)], vocab, torch.device("cpu"))
        assert noise.min().item() > 0
        assert sample(logits, [p], [3], [draw]) == [one]


def test_noise_is_exponential_and_rows_are_independent():
    seeds = [mix_seed(7, i) for i in range(8)]
    noise = exponential_noise(seeds, 50_000, torch.device("cpu")).double()
    assert torch.all(noise > 0)
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)  # Exp(1): mean 1, variance 1
    assert noise.var().item() == pytest.approx(1.0, abs=0.03)
    u = torch.exp(-noise)  # back to uniforms
    assert torch.corrcoef(u)[~torch.eye(8, dtype=torch.bool)].abs().max() < 0.03


def test_one_request_follows_the_distribution_over_its_draws():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log()[None]
    p = SamplingParams(temperature=1.0)
    n = 4000
    draws = torch.tensor([sample(logits, [p], [42], [i])[0] for i in range(n)])
    counts = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(counts, probs, atol=0.03)


@pytest.mark.gpu
def test_noise_bits_are_the_same_on_the_gpu_and_the_cpu():
    seeds = [random.getrandbits(64) for _ in range(5)]
    gpu = uniform_bits(seeds, 128256, torch.device("cuda")).cpu()
    assert torch.equal(gpu, uniform_bits(seeds, 128256, torch.device("cpu")))
