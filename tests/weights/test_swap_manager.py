"""The swap manager on a real in-process engine (the tiny Llama): deploy, swap, rollback, bad
versions, the canary, one weight slot, and a hundred swaps under load without a leak."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import threading
import time
from pathlib import Path

import pytest

from sitsd.builder import build_engine
from sitsd.config import (
    CacheConfig,
    ModelConfig,
    ObservabilityConfig,
    SchedulerConfig,
    ServerConfig,
    SitsdConfig,
    SwapConfig,
    WeightsConfig,
)
from sitsd.observability import Observability
from sitsd.types import FinishReason, SamplingParams
from sitsd.weights.errors import SwapRefusedError, UnknownVersionError, VersionRejectedError
from sitsd.weights.startup import choose_startup, create_swap_manager
from sitsd.weights.versions import ACTIVE_STATE_FILE, VersionState
from tests.weights.tiny_versions import BAD_DROPS, write_bad_version, write_version


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    return {
        "v1": write_version(root / "v1"),
        "v2": write_version(root / "v2", noise_seed=1),
        "v3": write_version(root / "v3", noise_seed=2),
        "far": write_version(root / "far", seed=9),  # another model altogether (canary)
    }


class Served:
    """An engine on its own event-loop thread, and its swap manager."""

    def __init__(
        self, v1: Path, state_dir: Path, drain_hold_s: float = SwapConfig.drain_hold_s, **weights
    ) -> None:
        self.config = SitsdConfig(
            model=ModelConfig(model=str(v1)),
            cache=CacheConfig(num_blocks=200, block_size=16),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, policy="fcfs"),
            server=ServerConfig(state_dir=str(state_dir)),
            weights=WeightsConfig(**weights),
            swap=SwapConfig(migration_tokens_per_step=32, drain_hold_s=drain_hold_s),
        )
        self.choice = choose_startup(self.config)
        self.engine = build_engine(
            self.choice.config_for(self.config), weights_version=self.choice.version
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self.engine.start())
        self.obs = Observability.create(ObservabilityConfig(metrics_enabled=False))
        self.obs.metrics.bind_model(self.engine.model_info.name)
        self.manager = create_swap_manager(
            self.engine.swap_port(), self.engine.tokenizer, self.config, self.choice, self.obs
        )
        self.progress: list = []

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def swap(self, version: str, policy: str = ""):
        return self.run(self.manager.swap(version, policy, self.progress.append))

    def generate(self, prompt: list[int], n: int = 8) -> tuple[list[int], set[str]]:
        async def go():
            tokens, seen = [], set()
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            async for delta in self.engine.add_request(prompt, params):
                tokens += delta.new_token_ids
                seen.add(delta.weights_version)
                assert delta.finish_reason in (None, FinishReason.LENGTH), delta.error
            return tokens, seen

        return self.run(go())

    def greedy_runs(self, prompts: list[list[int]]) -> list[list[int]]:
        """16 greedy tokens of each prompt. Tests that tell two versions apart by their outputs
        compare three such runs: v2 (20% noise) greedily agrees with v1 on 0.3% of single
        16-token runs."""
        return [self.generate(p, 16)[0] for p in prompts]

    def slots(self) -> dict[str, str]:
        return self.manager.versions().slots

    def close(self) -> None:
        self.run(self.engine.shutdown(5.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def served(versions, tmp_path):
    instance = Served(versions["v1"], tmp_path)
    yield instance
    instance.close()


def swaps_counted(served: Served, outcome: str) -> float:
    metric = served.obs.metrics.swaps.labels(served.engine.model_info.name, outcome)
    return metric._value.get()


def test_deploy_stages_into_the_standby_slot_then_swap_flips_to_it_and_persists(served, versions):
    v1 = served.manager.registry.active
    record = served.run(served.manager.deploy(str(versions["v2"]), "", served.progress.append))
    assert record.state is VersionState.VALIDATED
    assert served.slots() == {v1: "active", "v2": "standby"}
    stages = [p.stage for p in served.progress]
    assert stages[0] == "verify"
    assert stages[-1] == "staged"
    assert {"validate", "stage"} <= set(stages)
    copied = [p for p in served.progress if p.stage == "stage"]
    assert copied[-1].bytes_done == copied[-1].bytes_total > 0
    prompts = [[random.randrange(1, 300) for _ in range(9)] for _ in range(3)]
    _, seen_before = served.generate(prompts[0])
    before = served.greedy_runs(prompts)
    done = served.swap("v2")
    assert (done.stage, done.version, done.policy) == ("committed", "v2", "migrate")
    _, seen_after = served.generate(prompts[0])
    assert (seen_before, seen_after) == ({v1}, {"v2"})
    assert served.greedy_runs(prompts) != before  # the other weights really serve
    assert served.slots() == {"v2": "active", v1: "standby"}
    assert served.manager.registry.get(v1).state is VersionState.RETIRED
    state = json.loads((Path(served.config.server.state_dir) / ACTIVE_STATE_FILE).read_text())
    assert state["models"]["v1"]["active"]["version"] == "v2"
    assert state["models"]["v1"]["previous"]["version"] == v1
    assert swaps_counted(served, "committed") == 1


def test_a_slow_disk_at_the_commit_does_not_hold_up_the_event_loop(served, versions):
    store, save = served.manager.store, served.manager.store.save
    saved = []

    def slow_save(*args):  # an fsync behind gigabytes of dirty pages
        time.sleep(1.0)
        save(*args)
        saved.append(time.monotonic())

    store.save = slow_save
    served.run(served.manager.deploy(str(versions["v2"]), "", served.progress.append))

    async def swap_while_ticking() -> tuple[float, float]:
        ticks = [time.monotonic()]
        swap = asyncio.ensure_future(served.manager.swap("v2", "", served.progress.append))
        while not swap.done():
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())
        await swap
        return max(b - a for a, b in itertools.pairwise(ticks)), time.monotonic()

    longest_gap, returned = served.run(swap_while_ticking())
    assert longest_gap < 0.5
    assert len(saved) == 1
    assert saved[0] <= returned  # persisted before the swap was reported
    state = json.loads((Path(served.config.server.state_dir) / ACTIVE_STATE_FILE).read_text())
    assert state["models"][served.manager.registry.model]["active"]["version"] == "v2"


def test_rollback_flips_back_to_the_previous_outputs_and_needs_a_previous_version(served, versions):
    with pytest.raises(SwapRefusedError, match="nothing to roll back to"):
        served.run(served.manager.rollback())
    prompts = [[random.randrange(1, 300) for _ in range(9)] for _ in range(3)]
    old = served.greedy_runs(prompts)
    served.run(served.manager.deploy(str(versions["v2"])))
    served.swap("v2")
    new = served.greedy_runs(prompts)
    done = served.run(served.manager.rollback())
    assert done.stage == "committed"
    assert served.greedy_runs(prompts) == old
    assert new != old
    assert served.manager.registry.previous == "v2"
    assert swaps_counted(served, "rolled_back") == 1


def test_unknown_versions_are_not_found_and_a_second_operation_is_refused(served, versions):
    with pytest.raises(UnknownVersionError):
        served.swap("nope")
    served.manager.register(str(versions["v2"]))
    release = asyncio.Event()
    original = served.manager.stager.stage

    async def held_stage(*args):
        await release.wait()
        return await original(*args)

    served.manager.stager.stage = held_stage
    pending = asyncio.run_coroutine_threadsafe(served.manager.swap("v2"), served.loop)
    with pytest.raises(SwapRefusedError, match="swap to v2 is in progress"):
        served.run(served.manager.deploy(str(versions["v3"])))
    assert served.manager.busy == "swap to v2"
    served.loop.call_soon_threadsafe(release.set)
    assert pending.result(60).stage == "committed"
    assert served.manager.busy == ""


@pytest.mark.parametrize("kind", sorted(set(BAD_DROPS) - {"symlink"}))
def test_a_bad_version_is_rejected_with_its_reason_and_nothing_changes(
    served, versions, tmp_path, kind
):
    served.run(served.manager.deploy(str(versions["v2"])))  # the rollback target, in standby
    slots = served.slots()
    prompt = [random.randrange(1, 300) for _ in range(9)]
    want, _ = served.generate(prompt)
    bad = write_bad_version(kind, tmp_path / f"bad-{kind}", tmp_path / "outside")
    with pytest.raises(VersionRejectedError, match=re.escape(BAD_DROPS[kind])):
        served.run(served.manager.deploy(str(bad)))
    record = served.manager.registry.get(bad.name)
    assert record.state is VersionState.REJECTED
    assert BAD_DROPS[kind] in record.reason
    assert served.slots() == slots  # the standby slot was never touched
    assert served.generate(prompt)[0] == want
    assert swaps_counted(served, "rejected") == 1
    with pytest.raises(SwapRefusedError, match="was rejected"):
        served.swap(bad.name)


def test_the_canary_rejects_a_distant_version_and_passes_a_close_one(versions, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text(
        'Hello, world! How are you today?\n{"prompt": "The quick brown fox"}\n'
        '{"token_ids": [5, 17, 42, 99, 100, 7]}\n'
    )
    served = Served(versions["v1"], tmp_path / "state", canary_file=str(canary), canary_max_kl=0.01)
    try:
        with pytest.raises(VersionRejectedError, match=r"canary: mean KL \d"):
            served.run(served.manager.deploy(str(versions["far"]), "", served.progress.append))
        measured = [p for p in served.progress if p.stage == "canary"]
        assert measured[-1].canary_kl > 0.01
        assert "far" not in served.slots()  # rejected weights are in no slot
        served.progress.clear()
        served.run(served.manager.deploy(str(versions["v2"]), "", served.progress.append))
        started, passed = [p for p in served.progress if p.stage == "canary"]
        assert (started.canary_kl, started.message) == (-1.0, "3 prompts on v1 and v2")
        assert 0 < passed.canary_kl <= 0.01
        assert served.manager.registry.get("v2").state is VersionState.VALIDATED
    finally:
        served.close()


def test_with_one_slot_a_swap_copies_in_place_recomputes_requests_and_refuses_drain(
    versions, tmp_path
):
    served = Served(versions["v1"], tmp_path, weight_slots="1")
    try:
        prompts = [[random.randrange(1, 300) for _ in range(9)] for _ in range(3)]
        old = served.greedy_runs(prompts)
        served.manager.register(str(versions["v2"]))
        with pytest.raises(SwapRefusedError, match="drain needs two weight slots"):
            served.swap("v2", "drain")
        done = served.swap("v2", "migrate")
        assert done.policy == "restart"  # the old weights are overwritten: nothing to migrate to
        assert done.flip_s > 0  # the in-place copy, measured
        assert done.pause_s >= done.flip_s
        assert served.slots() == {"v2": "active"}
        assert served.greedy_runs(prompts) != old
        served.run(served.manager.rollback())  # restaged from its directory, copied again
        assert served.greedy_runs(prompts) == old
    finally:
        served.close()


def test_a_hundred_swaps_under_load_leave_every_block_free_and_both_slots_accounted(
    versions, tmp_path
):
    # No drain hold: right after a drain the hold keeps new requests queued, so the swap that
    # follows it (at once, here) would find only requests already on its version running and
    # leave its policy nothing in flight; the hold has tests of its own.
    served = Served(versions["v1"], tmp_path, drain_hold_s=0.0)
    try:
        hundred_swaps(served, versions)
    finally:
        served.close()


def hundred_swaps(served: Served, versions: dict[str, Path]) -> None:
    v1 = served.manager.registry.active
    served.manager.register(str(versions["v2"]))
    policies = ["migrate", "drain", "restart"]
    stop = threading.Event()
    failures: list[str] = []

    async def client(seed: int) -> int:
        rng, done = random.Random(seed), 0
        while not stop.is_set():
            prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(2, 60))]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True
            )
            async for delta in served.engine.add_request(prompt, params):
                if delta.finish_reason not in (None, FinishReason.LENGTH):
                    failures.append(delta.error)
            done += 1
        return done

    load = [asyncio.run_coroutine_threadsafe(client(i), served.loop) for i in range(6)]
    commits = []
    try:
        for i in range(100):
            commits.append(served.swap("v2" if i % 2 == 0 else v1, policies[i % 3]))
    finally:
        stop.set()
    served_requests = sum(f.result(120) for f in load)
    assert not failures
    assert served_requests > 0
    in_flight = [c for c in commits if c.num_migrating + c.num_restarted + c.num_draining]
    assert len(in_flight) >= 50  # most swaps met requests in flight, for every policy
    assert {c.policy for c in in_flight} == set(policies)
    status = served.engine.status()
    assert status.num_blocks_used == 0
    assert status.num_running == status.num_waiting == 0
    assert sorted(status.slot_versions) == sorted([v1, "v2"])
    assert not status.swapping
    scheduler = served.engine.core.scheduler
    assert scheduler.swaps.migration is None
    assert scheduler.kv_cache.pool.num_free_blocks == scheduler.kv_cache.num_blocks
    assert not [r for r in served.engine.core.runner.requests if "\x00" in r]  # no shadow left
