"""`RequestStream`: a consumer that falls behind gets the deltas that piled up as one."""

from __future__ import annotations

import asyncio

from sitsd.engine.async_engine import RequestStream
from sitsd.types import FinishReason, RequestDelta, Usage


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
