"""`RequestStream`: a consumer that falls behind gets the deltas that piled up as one."""

from __future__ import annotations

import asyncio

import pytest

from sitsd.config import SchedulerConfig
from sitsd.engine.async_engine import AsyncEngine, RequestStream
from sitsd.engine.core import EngineCore
from sitsd.engine.errors import QueueFullError
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.messages import AbortRequest, AddRequest
from sitsd.engine.scheduler import Scheduler
from sitsd.outputs import ModelInfo
from sitsd.types import EndReason, FinishReason, RequestDelta, SamplingParams, Usage
from tests.engine.fakes import FakeRunner
from tests.engine.test_detokenizer import ByteTokenizer


def delta(tokens, version="m@1", finish=None, usage=None) -> RequestDelta:
    text = "".join(f"<{t}>" for t in tokens)
    return RequestDelta("r", list(tokens), text, finish, usage, version)


async def drain(stream: RequestStream) -> list[RequestDelta]:
    return [d async for d in stream]


def test_deltas_that_piled_up_arrive_as_one_with_the_last_ones_finish():
    stream = RequestStream(engine=None, req_id="r", num_prompt_tokens=3)
    usage = Usage(prompt_tokens=3, completion_tokens=4)
    for d in (delta([1]), delta([2, 3]), delta([4], finish=FinishReason.LENGTH, usage=usage)):
        stream._put(d)
    (got,) = asyncio.run(drain(stream))
    assert got.new_token_ids == [1, 2, 3, 4]
    assert got.text == "<1><2><3><4>"
    assert (got.finish_reason, got.usage) == (FinishReason.LENGTH, usage)
    assert got.weights_version == "m@1"
    assert stream.finished


def test_deltas_of_two_weights_versions_are_never_joined():
    stream = RequestStream(engine=None, req_id="r", num_prompt_tokens=3)
    for d in (delta([1]), delta([2]), delta([3], "m@2"), delta([4], "m@2", FinishReason.STOP)):
        stream._put(d)
    got = asyncio.run(drain(stream))
    assert [(d.new_token_ids, d.weights_version) for d in got] == [([1, 2], "m@1"), ([3, 4], "m@2")]
    assert got[-1].finished


def test_a_consumer_that_keeps_up_gets_every_delta_on_its_own():
    async def run() -> list[list[int]]:
        stream = RequestStream(engine=None, req_id="r", num_prompt_tokens=3)
        seen = []

        async def produce() -> None:
            for i in range(5):
                stream._put(delta([i], finish=FinishReason.STOP if i == 4 else None))
                await asyncio.sleep(0.01)  # the consumer runs between two puts

        producer = asyncio.create_task(produce())
        async for d in stream:
            seen.append(d.new_token_ids)
        await producer
        return seen

    assert asyncio.run(run()) == [[0], [1], [2], [3], [4]]


def engine_not_stepping(max_num_seqs: int, max_num_waiting: int):
    """An `AsyncEngine` over a real core whose loop is not running: nothing the API submits
    is taken yet, as when the engine thread is mid-step."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_waiting=max_num_waiting)
    sched = Scheduler(config, KVCacheManager(32, 4), 128)
    core = EngineCore(sched, FakeRunner(4, vocab_size=256), ByteTokenizer(), "fake-model")
    info = ModelInfo("fake-model", 128, 256, "llama", "float32", "cpu", "/fake")
    engine = AsyncEngine(core, info)
    loop = asyncio.new_event_loop()
    engine.bind(loop)
    return engine, loop


def test_an_aborted_stream_no_longer_counts_in_flight_before_the_engine_takes_the_abort():
    # The case of a stream aborted by its caller (a passed deadline) while the engine's status
    # already shows the room it leaves: the next request must not be refused as a full queue.
    engine, loop = engine_not_stepping(max_num_seqs=2, max_num_waiting=1)
    try:
        streams = [engine.add_request([1, 2], SamplingParams(max_tokens=4)) for _ in range(3)]
        with pytest.raises(QueueFullError):
            engine.add_request([1, 2], SamplingParams(max_tokens=4))
        streams[0].abort("deadline exceeded", EndReason.DEADLINE)
        streams[0].abort("deadline exceeded", EndReason.DEADLINE)  # idempotent: counted once
        engine.add_request([3, 4], SamplingParams(max_tokens=4))
        with pytest.raises(QueueFullError):
            engine.add_request([1, 2], SamplingParams(max_tokens=4))
    finally:
        loop.close()
    # The engine takes the abort before the add that replaced it: never more than the limit.
    inbox = []
    while not engine.core._inbox.empty():
        inbox.append(engine.core._inbox.get_nowait())
    kinds = [(type(m).__name__, m.req_id) for m in inbox]
    aborted = streams[0].req_id
    assert kinds.index(("AbortRequest", aborted)) < len(kinds) - 1
    assert isinstance(inbox[-1], AddRequest)
    (abort,) = [m for m in inbox if isinstance(m, AbortRequest)]
    assert abort.cause is EndReason.DEADLINE
