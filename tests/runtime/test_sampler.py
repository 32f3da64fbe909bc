"""Sampler: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

import torch

from sitsd.runtime.sampler import sample
from sitsd.types import SamplingParams


def random_logits(rows=4, vocab=50):
    return torch.randn(rows, vocab) * 3


def test_greedy_takes_the_argmax():
    logits = random_logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [0] * 4, [0] * 4) == logits.argmax(-1).tolist()


def test_same_seed_and_index_give_the_same_token_whatever_the_batch():
    logits = random_logits(rows=1)
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
