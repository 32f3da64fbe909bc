"""The swap port: the weights subsystem's only door into the engine, end to end with the core's
thread (reserve, copy, fill, release, canary prompts, commit)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from sitsd.engine.swap_controller import StandbyBusy
from sitsd.engine.swap_port import SwapPort
from tests.engine.test_core import wait_for
from tests.engine.test_core_swap import V0, V1, add, make_core, overlaps

__all__ = ["overlaps"]  # the fixture: sync runner, overlapping runner, asynchronous scheduling


def run(coro):
    return asyncio.run(coro)


def test_reserve_copy_fill_and_commit_go_through_the_port(overlaps):
    core, runner, _ = make_core(overlaps)
    port = SwapPort(core)
    try:
        assert (port.num_slots, port.status().slot_versions) == (2, (V0, ""))
        tensors = {"model.norm.weight": torch.ones(4)}

        async def stage_and_commit():
            index = await port.reserve_standby()
            # The copy runs on the caller's thread, into a slot that holds no version.
            port.copy_into(index, tensors, chunk_bytes=2048)
            await port.fill(index, V1)
            return index, [e.kind async for e in port.commit(V1, "migrate")]

        index, kinds = run(stage_and_commit())
        assert index == 1
        assert runner.slots.copies == [
            (threading.current_thread().name, 1, [V0, None], ["model.norm.weight"], 2048)
        ]
        assert kinds == ["committed"]
        assert (port.status().weights_version, port.status().slot_versions) == (V1, (V0, V1))
    finally:
        core.stop()


def test_the_standby_slot_is_refused_while_requests_drain_on_it():
    core, runner, sink = make_core(False, slow_s=0.002)
    port = SwapPort(core)
    try:
        add(core, "old", b"abcdefgh", 40)
        assert wait_for(lambda: len(runner.tokens.get("old", ())) > 10)
        runner.slots.load(V1)

        async def drain_then_reserve():
            kinds = [e.kind async for e in port.commit(V1, "drain")]
            with pytest.raises(StandbyBusy) as busy:  # "old" still runs on V0, in the standby
                await port.reserve_standby()
            return kinds, busy.value

        kinds, busy = run(drain_then_reserve())
        assert kinds == ["committed"]
        assert (busy.version, busy.num_requests) == (V0, 1)
        sink.until_finished({"old"})
        assert run(port.reserve_standby()) == 0  # drained: slot 0 (V0) is released
        assert port.status().slot_versions == ("", V1)
        run(port.release(0))
    finally:
        core.stop()


def test_canary_prompts_run_on_the_version_asked_for():
    core, runner, _ = make_core(False)
    port = SwapPort(core)
    try:
        runner.slots.load(V1)
        prompt = [3, 7, 11, 13]

        async def both():
            return (
                await port.prompt_logprobs(prompt, V0),
                await port.prompt_logprobs(prompt, V1),
            )

        active, new = run(both())
        assert active.shape == (4, 256)
        # The fake model under V0 predicts `last + 1`; under V1, `last + 2`.
        assert active.argmax(-1).tolist() == [4, 8, 12, 14]
        assert new.argmax(-1).tolist() == [5, 9, 13, 15]
        with pytest.raises(KeyError, match="fake@9"):
            run(port.prompt_logprobs(prompt, "fake@9"))
    finally:
        core.stop()


def test_a_failed_commit_through_the_port_reports_why_and_changes_nothing():
    core, _, _ = make_core(False)
    port = SwapPort(core)
    try:

        async def commit():
            return [e async for e in port.commit("fake@7", "migrate")]

        (event,) = run(commit())
        assert (event.kind, port.status().weights_version) == ("failed", V0)
        assert "not in a weight slot" in event.message
    finally:
        core.stop()


def test_requests_keep_streaming_while_the_port_is_used(overlaps):
    core, _, sink = make_core(overlaps, slow_s=0.001)
    port = SwapPort(core)
    try:
        for i in range(3):
            add(core, f"r{i}", bytes(range(20 + i, 40 + i)), 30)

        async def canaries():
            for _ in range(5):
                await port.prompt_logprobs([1, 2, 3], V0)

        run(canaries())
        deltas = sink.until_finished({"r0", "r1", "r2"})
        assert all(sum(len(d.new_token_ids) for d in ds) == 30 for ds in deltas.values())
    finally:
        core.stop()
