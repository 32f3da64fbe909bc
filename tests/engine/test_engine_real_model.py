"""The real engine on the embedded SmolLM2: batching, seeds, prefix cache, block accounting."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from sitsd.builder import build_engine
from sitsd.config import CacheConfig, SchedulerConfig, SitsdConfig
from sitsd.types import FinishReason, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name a colour.",
    "Count to five.",
    "Write one sentence about dogs and cats living together in a small flat.",
    "Why?",
    "Explain gravity to a child in three short sentences, please.",
    "What is 2 + 2?",
    "Say hello.",
]


@pytest.fixture(scope="module")
def engine():
    """One engine for the module, serving on an event loop of its own thread."""
    cfg = SitsdConfig(
        cache=CacheConfig(kv_cache_memory=192 * 2**20),
        # FCFS: these tests pin batching, not SLA tiers; under the default tiers policy the SITS
        # (GPU) queue limits would rightly refuse part of an 8-request burst on this CPU.
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96, policy="fcfs"),
    )
    engine = build_engine(cfg)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(30)
    engine.test_loop = loop
    yield engine
    asyncio.run_coroutine_threadsafe(engine.shutdown(5.0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def chat_ids(engine, question):
    tok = engine.tokenizer
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False
    )


def generate(engine, requests):
    """Run (ids, params) pairs concurrently; return (token ids, text, last delta) per request."""

    async def one(ids, params):
        tokens, text, last = [], "", None
        async for delta in engine.add_request(ids, params):
            tokens += delta.new_token_ids
            text += delta.text
            last = delta
        return tokens, text, last

    async def all_of():
        return await asyncio.gather(*(one(ids, p) for ids, p in requests))

    return asyncio.run_coroutine_threadsafe(all_of(), engine.test_loop).result(300)


def test_a_cpu_engine_schedules_one_step_at_a_time_unless_asked(engine):
    # Asynchronous scheduling is left to the device (None): a CPU step returns only when it is
    # done, so there is nothing to overlap.
    assert SchedulerConfig().async_scheduling is None
    assert engine.core.scheduler.config.async_scheduling is False


def test_greedy_output_is_the_same_alone_and_among_eight_mixed_requests(engine):
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    target = chat_ids(engine, QUESTIONS[0])
    [(alone, text, last)] = generate(engine, [(target, greedy)])
    assert "Paris" in text
    assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    mixed = [
        (chat_ids(engine, q), SamplingParams(max_tokens=random.randint(4, 30), temperature=0.0))
        for q in QUESTIONS[1:]
    ]
    mixed.insert(random.randrange(len(mixed) + 1), (target, greedy))
    results = generate(engine, mixed)
    batched = results[[ids for ids, _ in mixed].index(target)][0]
    assert batched == alone
    assert engine.status().num_blocks_used == 0


def test_same_seed_gives_the_same_sample_and_another_seed_differs(engine):
    ids = chat_ids(engine, "Tell me a short story.")
    a, b, c = generate(
        engine,
        [
            (ids, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=7)),
            (ids, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=7)),
            (ids, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=8)),
        ],
    )
    assert a[0] == b[0]
    assert a[0] != c[0]


def test_repeated_prompt_is_served_from_the_prefix_cache(engine):
    ids = chat_ids(engine, "List the planets of the solar system in order from the sun.")
    before = engine.status().prefix_cache_hits
    first, second = [
        (generate(engine, [(ids, SamplingParams(max_tokens=4, temperature=0.0))]))[0]
        for _ in range(2)
    ]
    block = engine.status().block_size
    assert second[2].usage.cached_tokens == (len(ids) - 1) // block * block
    assert engine.status().prefix_cache_hits - before >= second[2].usage.cached_tokens
    assert first[0] == second[0]


def test_stop_string_cuts_the_text(engine):
    ids = chat_ids(engine, QUESTIONS[0])
    [(_tokens, text, last)] = generate(
        engine, [(ids, SamplingParams(max_tokens=24, temperature=0.0, stop=("Paris",)))]
    )
    assert "Paris" not in text
    assert last.finish_reason is FinishReason.STOP
