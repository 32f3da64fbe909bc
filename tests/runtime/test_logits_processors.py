"""Logit bias, penalties, grammar masks and logprobs against plain-Python references."""

from __future__ import annotations

import random

import pytest
import torch
from llguidance.torch import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    fill_next_token_bitmask,
)

from sitsd.runtime.grammar import GrammarCompiler, GrammarError, GrammarMasks
from sitsd.runtime.input_batch import CachedRequestState
from sitsd.runtime.logits_processors import LogitsProcessors, SampledLogprobs
from sitsd.types import GrammarSpec, SamplingParams
from sitsd.weights import load_checkpoint

VOCAB = 64


def state(token_ids: list[int], num_prompt: int, **params) -> CachedRequestState:
    return CachedRequestState(
        req_id=f"r{random.random()}", token_ids=token_ids, num_prompt_tokens=num_prompt,
        params=SamplingParams(**params), seed=0, block_ids=[], num_computed_tokens=0,
    )  # fmt: skip


def reference(logits: torch.Tensor, s: CachedRequestState) -> torch.Tensor:
    """vLLM's definitions, one token at a time."""
    x = logits.clone()
    p = s.params
    for token_id, bias in p.logit_bias:
        x[token_id] += bias
    outputs = s.token_ids[s.num_prompt_tokens :]
    for t in set(s.token_ids) if p.repetition_penalty != 1.0 else ():
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(outputs):
        x[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    return x


def random_state(rng: random.Random) -> CachedRequestState:
    num_prompt = rng.randint(1, 10)
    ids = [rng.randrange(VOCAB) for _ in range(num_prompt + rng.randint(0, 12))]
    return state(
        ids,
        num_prompt,
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), 3))
        if rng.random() < 0.5
        else (),
    )


def test_bias_and_penalties_match_the_reference_row_by_row(rng):
    rows = [random_state(rng) for _ in range(8)]
    logits = torch.randn(len(rows), VOCAB) * 3
    expected = torch.stack([reference(logits[i], s) for i, s in enumerate(rows)])
    last = torch.tensor([s.token_ids[-1] for s in rows])
    LogitsProcessors(8, torch.device("cpu")).apply(logits, rows, last)
    torch.testing.assert_close(logits, expected)


def test_the_last_token_comes_from_the_device_not_the_host_list(rng):
    """With asynchronous scheduling the host's last token is a placeholder (0)."""
    real = [rng.randrange(1, VOCAB) for _ in range(6)]
    placeholder = state([*real[:-1], 0], 2, frequency_penalty=1.5, repetition_penalty=1.3)
    logits = torch.randn(1, VOCAB)
    expected = reference(logits[0], state(real, 2, frequency_penalty=1.5, repetition_penalty=1.3))
    LogitsProcessors(1, torch.device("cpu")).apply(logits, [placeholder], torch.tensor([real[-1]]))
    torch.testing.assert_close(logits[0], expected)


def test_rows_that_ask_for_nothing_are_untouched():
    rows = [state([1, 2, 3], 2), state([4, 5, 6], 1, presence_penalty=1.0)]
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    LogitsProcessors(2, torch.device("cpu")).apply(logits, rows, torch.tensor([3, 6]))
    torch.testing.assert_close(logits[0], before[0])
    assert not torch.equal(logits[1], before[1])


def test_logprobs_are_the_log_softmax_at_the_sampled_tokens_with_the_top_alternatives():
    rows = [state([1], 1, logprobs=3), state([1], 1), state([1], 1, logprobs=0)]
    logits = torch.randn(3, VOCAB)
    tokens = torch.randint(0, VOCAB, (3,))
    logprobs = SampledLogprobs(logits, rows)
    logprobs.record(tokens)
    logprobs.to_host()
    entries = logprobs.entries(tokens.tolist())
    assert set(entries) == {0, 2}
    reference_lp = torch.log_softmax(logits, dim=-1)
    for row, entry in entries.items():
        assert entry.token_id == tokens[row]
        assert entry.logprob == pytest.approx(reference_lp[row, tokens[row]].item(), abs=1e-6)
    top = torch.topk(reference_lp[0], 3)
    assert [t for t, _ in entries[0].top] == top.indices.tolist()
    assert entries[2].top == ()


@pytest.fixture(scope="module")
def compiler(smollm2_path) -> tuple[GrammarCompiler, object]:
    tokenizer = load_checkpoint(smollm2_path, load_tensors=False).tokenizer
    return GrammarCompiler.for_tokenizer(tokenizer, tokenizer.vocab_size), tokenizer


def test_a_grammar_mask_allows_exactly_the_tokens_that_continue_a_match(compiler):
    grammars, tokenizer = compiler
    vocab = tokenizer.vocab_size
    word = random.choice(["yes", "no", "maybe"])
    processors = LogitsProcessors(1, torch.device("cpu"), grammars)
    row = state([5, 6], 2, grammar=GrammarSpec("regex", "(yes|no|maybe)"))
    logits = torch.randn(1, vocab)
    processors.apply(logits, [row], torch.tensor([6]))
    allowed = torch.nonzero(logits[0] > float("-inf"))[:, 0].tolist()
    texts = [tokenizer.decode([t]) for t in allowed]
    assert allowed
    assert all(t and any(w.startswith(t) for w in ("yes", "no", "maybe")) for t in texts)
    # Feed the word token by token through the mask; then only the end of sequence is left.
    for token_id in tokenizer.encode(word, add_special_tokens=False):
        row.token_ids.append(token_id)
        logits = torch.randn(1, vocab)
        processors.apply(logits, [row], torch.tensor([token_id]))
    allowed = torch.nonzero(logits[0] > float("-inf"))[:, 0].tolist()
    assert allowed == [tokenizer.eos_token_ids[0]]


@pytest.mark.parametrize("layout", ["every row", "a run of rows", "scattered rows"])
def test_grammar_masks_equal_llguidances_own_masking_row_by_row(compiler, layout):
    grammars, tokenizer = compiler
    num_rows = 6
    rows = {"every row": [0, 1, 2, 3, 4, 5], "a run of rows": [2, 3, 4],
            "scattered rows": sorted(random.sample(range(num_rows), 3))}[layout]  # fmt: skip
    # Matchers at different points of one grammar: each has consumed a random prefix.
    word = "".join(random.choices("abc", k=12))
    ids = tokenizer.encode(word, add_special_tokens=False)
    states = []
    for _ in rows:
        state = grammars.matcher(GrammarSpec("regex", "[abc]{12}"))
        state.advance(ids[: random.randrange(len(ids))])
        states.append(state)
    logits = torch.randn(num_rows, tokenizer.vocab_size)
    expected = logits.clone()
    for state, row in zip(states, rows):
        bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
        fill_next_token_bitmask(state.matcher, bitmask, 0)
        apply_token_bitmask_inplace(expected[row : row + 1], bitmask)
    GrammarMasks(tokenizer.vocab_size, num_rows, torch.device("cpu")).apply(logits, rows, states)
    assert torch.equal(logits, expected)


def test_a_schema_that_does_not_compile_is_a_grammar_error(compiler):
    grammars, _ = compiler
    with pytest.raises(GrammarError):
        grammars.check(GrammarSpec("json_schema", '{"type": "object", "properties": 3}'))
    with pytest.raises(GrammarError):
        grammars.check(GrammarSpec("json_schema", "{not json"))
    grammars.check(GrammarSpec("json_schema", '{"type": "integer"}'))


def test_min_p_never_samples_a_token_less_likely_than_min_p_times_the_top_one():
    from sitsd.runtime.sampler import sample

    logits = torch.randn(1, VOCAB) * 2
    probs = torch.softmax(logits[0], -1)
    min_p = 0.3
    kept = set(torch.nonzero(probs >= min_p * probs.max())[:, 0].tolist())
    params = [SamplingParams(min_p=min_p)]
    drawn = {sample(logits, params, [random.getrandbits(63)], [i])[0] for i in range(200)}
    assert drawn <= kept
    assert len(kept) == 1 or len(drawn) > 1  # still a draw, not greedy
