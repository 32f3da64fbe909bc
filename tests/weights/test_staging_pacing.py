"""Staging's one pacing rule: work on what serving needs takes at most a share of the time,
counted on that resource's clock. On a CPU device every stage (verify, validate, copy) counts
the stager thread's CPU time; on a GPU the host's checks run unpaced and the copy counts the
device time of its transfers (`SwapPort.copy_seconds`).

The real `StandbyStager` stages a real version against a port whose copy reports a known
transfer time per chunk; `time.sleep` is recorded, not slept."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from sitsd.weights import load_checkpoint
from sitsd.weights.checks import serving_model_of
from sitsd.weights.progress import NoTrace, Pacer
from sitsd.weights.staging import StagingSettings, StandbyStager
from sitsd.weights.startup import manifest_digest
from sitsd.weights.versions import VersionState, WeightVersion
from tests.weights.tiny_versions import write_version

CHUNK_LINK_S = 0.05  # what the port says each copied chunk held the link for


class Sleeps:
    """`time.sleep` in `sitsd.weights.progress`, recorded with what was going on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stage = "checks"
        self.slept: list[tuple[str, float]] = []
        monkeypatch.setattr("sitsd.weights.progress.time.sleep", self)

    def __call__(self, seconds: float) -> None:
        self.slept.append((self.stage, seconds))

    def of(self, stage: str) -> list[float]:
        return [s for st, s in self.slept if st == stage]


class LinkPort:
    """The parts of a `SwapPort` staging uses, with a copy whose every chunk reports
    `CHUNK_LINK_S` of transfer time (and takes almost no CPU)."""

    num_slots = 2

    def __init__(self, sleeps: Sleeps, num_chunks: int) -> None:
        self.sleeps = sleeps
        self.num_chunks = num_chunks
        self.link_s = 0.0
        self.filled: list[tuple[int, str]] = []

    def copy_seconds(self) -> float:
        assert threading.current_thread().name == "sitsd-stager", "read on the copying thread"
        return self.link_s

    def pinned_uploads(self) -> None:
        return None  # no GPU

    def copy_into(self, index, tensors, *, chunk_bytes, on_progress=None, source=None) -> int:
        self.sleeps.stage = "copy"
        for i in range(self.num_chunks):
            self.link_s += CHUNK_LINK_S
            on_progress(i + 1, self.num_chunks)
        self.sleeps.stage = "after"
        return self.num_chunks

    async def reserve_standby(self) -> int:
        return 1

    async def fill(self, index: int, version: str) -> None:
        self.filled.append((index, version))


def stage_with(tmp_path, sleeps, *, to_gpu: bool, share: float, num_chunks=6):
    path = write_version(tmp_path / "v2", noise_seed=random.randrange(100))
    checkpoint = load_checkpoint(path)
    serving = serving_model_of(checkpoint.arch, checkpoint.tokenizer, torch.float32,
                               torch.device("cpu"))  # fmt: skip
    port = LinkPort(sleeps, num_chunks)
    settings = StagingSettings(chunk_bytes=512, share=share, to_gpu=to_gpu)
    stager = StandbyStager(port, serving, settings)  # type: ignore[arg-type]
    record = WeightVersion("tiny", "v2", str(path), manifest_digest(path), VersionState.STAGED,
                           "deploy")  # fmt: skip
    asyncio.run(stager.stage(record, lambda p: None, NoTrace()))
    assert port.filled == [(1, "v2")]


def test_on_a_cpu_device_every_stage_is_paced_on_the_stager_threads_cpu_time(tmp_path, monkeypatch):
    sleeps = Sleeps(monkeypatch)
    stage_with(tmp_path, sleeps, to_gpu=False, share=0.5)
    assert sleeps.of("checks"), "hashing and checking pause for the cores"
    copy = sleeps.of("copy")
    assert copy, "the copy pauses too"
    # On its CPU time: the port's tiny loop, not the link time it reports.
    assert max(copy) < CHUNK_LINK_S / 10


def test_on_a_gpu_the_copy_is_paced_on_its_link_time_and_the_host_checks_are_not(
    tmp_path, monkeypatch
):
    sleeps = Sleeps(monkeypatch)
    share = random.choice([0.1, 0.25, 0.5])
    stage_with(tmp_path, sleeps, to_gpu=True, share=share, num_chunks=6)
    assert sleeps.of("checks") == [], "the engine leaves the host's cores free"
    # After each chunk but the first (the pacer's mark), its link time x (1 - share) / share.
    want = CHUNK_LINK_S * (1 - share) / share
    assert sleeps.of("copy") == pytest.approx([want] * 5)


def test_a_pacer_sleeps_in_proportion_to_the_work_its_clock_counts(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("sitsd.weights.progress.time.sleep", slept.append)
    clock = iter([0.0, 0.2, 0.5, 0.5])
    pacer = Pacer(0.2, clock=lambda: next(clock))
    for _ in range(4):
        pacer()
    assert slept == pytest.approx([0.8, 1.2, 0.0])
    unpaced = Pacer(1.0)
    unpaced()
    unpaced()
    assert len(slept) == 3


def test_on_the_cpu_clock_the_first_piece_counts_from_the_threads_start(monkeypatch):
    """The work a thread did before its first call (checks before the first chunk, the first
    chunk) is paced as well: it used to run unpaced, back to back with the second piece."""
    slept: list[float] = []
    monkeypatch.setattr("sitsd.weights.progress.time.sleep", slept.append)
    share = 0.25
    pacer = Pacer(share)
    seen: list[tuple[float, float]] = []

    def worker() -> None:
        deadline = time.thread_time() + 0.02
        while time.thread_time() < deadline:  # CPU work, not a wait
            pass
        before = time.thread_time()
        pacer()
        seen.append((before, time.thread_time()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    [(before, after)] = seen
    factor = (1 - share) / share
    assert len(slept) == 1
    assert before * factor <= slept[0] <= after * factor
