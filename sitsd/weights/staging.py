"""The staging pipeline of a swap: verify, load, validate, copy into the standby slot, canary.

`StandbyStager.stage(record)` takes a registered version to "ready to commit":

    verify + load  the manifest against every file (and, in the same read,
                   the values it can test: `finite_scan`; on a GPU in a
                   child process, `hash_child`), the checkpoint             stager thread
    validate       against the serving model (`checks.validate`)           stager thread
    stage          reserve the standby slot (once no request runs on it:
                   a drain may still hold it), copy into it; a version of
                   another structure (precision) has the slot's CUDA
                   graphs captured again, beside serving                    stager thread
    canary         prompts on both slots (`canary.py`), as low-priority
                   work in the engine's steps, compared off the loop        engine thread

One pacing rule for all of it: work on what serving needs takes at most `share` of the time,
counted on that resource's clock (`progress.Pacer`). On a CPU device serving needs every core,
so hashing, checking and copying count the stager thread's CPU time. On a GPU, verify and
validate run unpaced on host cores the engine leaves free (hashed by several threads of a
child process, `hash_child`: in this one they held up the engine's thread, which takes the
interpreter back after each call into torch; the finiteness check's uploads measured
harmless: ITL P99 1.02x of steady on an H200), and the copy into the standby slot counts the
device time of its host-to-device transfers: the link is what it shares with the engine's
own uploads. The canary's prompts are paced by the engine
(`sitsd.engine.pacing`), like every swap's work inside its steps.

Everything it asks of the engine goes through the `SwapPort`. Each stage is timed in the
swap's trace and announced by a progress event as it starts. A failed check raises
`checks.VersionRejected`; the caller (`sitsd.weights.swap.SwapManager`) records it. With one
weight slot only verify, load and validate run: the commit copies the loaded version in place.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sitsd.config import DEFAULT_CHUNK_BYTES
from sitsd.engine.swap_controller import StandbyBusy
from sitsd.engine.swap_port import SwapPort
from sitsd.weights import CheckpointError, load_checkpoint
from sitsd.weights.canary import CanaryResult, CanaryScore, compare
from sitsd.weights.checks import (
    LoadedVersion,
    ServingModel,
    VersionRejected,
    load_version,
    validate,
)
from sitsd.weights.errors import SwapRefusedError
from sitsd.weights.offthread import run_off_engine
from sitsd.weights.progress import ByteProgress, Pacer, ProgressSink, SwapProgress, SwapTraceLike
from sitsd.weights.push_plan import PushSource, check_plan, check_received
from sitsd.weights.versions import WeightVersion

log = logging.getLogger("sitsd.swap")

_SLOT_POLL_S = 0.2  # how often staging asks again for a standby slot that still drains
# Files (or blocks of them, `manifest.BLOCK_BYTES`) of a version hashed at once when hashing
# is not paced (GPU, in a child process): half the host's cores, which the engine's and the
# event loop's threads barely use, up to 8.
_HASH_WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))
# The pieces those workers read in: the copy's (`config.DEFAULT_CHUNK_BYTES`), one progress
# report each. A paced stager (a CPU device) reads the manifest's default 4 MiB, each piece a
# pause of the engine's cores.
_GPU_HASH_CHUNK_BYTES = DEFAULT_CHUNK_BYTES
# Canary prompt tokens whose log-probabilities ([tokens, vocab] float32) are held at once.
_CANARY_TOKENS_IN_FLIGHT = 512


@dataclass(frozen=True)
class StagingSettings:
    """Limits of staging (from `WeightsConfig` and `SwapConfig`)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # the most a check or the copy moves at once
    # Of what it shares with serving, the most staging uses (it sleeps between chunks; see the
    # module docstring); 1 = as fast as it can.
    share: float = 1.0
    to_gpu: bool = False  # serving runs on a GPU: the share is the link's, the host's cores free
    slot_wait_s: float = 600.0  # how long to wait for the standby slot to drain
    canary_prompts: tuple[tuple[int, ...], ...] = ()  # token ids; empty: no canary
    canary_max_kl: float = 0.5  # nats
    watch_root: str = ""  # versions the watcher found must resolve inside it


class StandbyStager:
    """Stages versions for one engine; see the module docstring."""

    def __init__(self, port: SwapPort, serving: ServingModel, settings: StagingSettings) -> None:
        self.port = port
        self.serving = serving
        self.settings = settings

    async def stage(
        self, record: WeightVersion, progress: ProgressSink, trace: SwapTraceLike
    ) -> LoadedVersion:
        """Verify, load and validate `record`; with two slots, copy it into the standby slot
        and run the canary. Returns the loaded version (one slot: the commit copies it).

        Raises:
            VersionRejected: a check failed (the reason).
            SwapRefusedError: the standby slot did not drain in time.
        """
        loop = asyncio.get_running_loop()
        with trace.stage("verify"):
            loaded = await run_off_engine(lambda: self._load(record, loop, progress))
        with trace.stage("validate"):
            # Its bytes are what the hashing's read could not test (often none): say it began.
            progress(SwapProgress("validate", record.version, message="against the serving model"))
            on_bytes = ByteProgress(
                loop, progress, "validate", record.version, pace=self._host_pacer()
            )
            chunk, uploads = self.settings.chunk_bytes, self.port.pinned_uploads()

            def check() -> None:
                validate(loaded, self.serving, chunk_bytes=chunk, on_progress=on_bytes,
                         uploads=uploads)  # fmt: skip

            await run_off_engine(check)
        if self.port.num_slots == 2:
            await self._copy_to_standby(loaded, record.version, progress, trace)
        return loaded

    async def stage_pushed(
        self, version: str, push: PushSource, progress: ProgressSink, trace: SwapTraceLike
    ) -> None:
        """Stage a pushed version into the standby slot (see the module docstring).

        Raises:
            VersionRejected: its table, its bytes, a value or the canary (the reason says).
            SwapRefusedError: the standby slot did not drain in time.
        """
        check_plan(push.plan, self.serving)  # before any slot is touched
        push.check()
        index = await self._reserve_standby(version, progress)
        # On a GPU the push's device copies and checks share the memory serving reads: they
        # take the staging share of the device's bandwidth, as a file's copy takes of the link.
        share = self.settings.share if self.settings.to_gpu else 1.0
        chunk = self.settings.chunk_bytes
        # Off the event loop: the first push after start-up (or after a slot's tensors moved)
        # makes the slots' views by name (~300 each, milliseconds of the interpreter).
        writer = await run_off_engine(
            lambda: self.port.slot_writer(index, chunk_bytes=chunk, device_share=share)
        )
        try:
            with trace.stage("receive"):
                await push.receive(writer, version, progress, self._host_pacer().share)
                check_received(push.plan, writer)
                on_bytes = self._bytes(progress, "receive", version)
                await run_off_engine(lambda: writer.copy_rest(on_bytes))
            with trace.stage("validate"):
                on_bytes = self._bytes(progress, "validate", version)
                bad = await run_off_engine(
                    lambda: writer.first_nonfinite(push.plan.names, on_bytes)
                )
        finally:
            await run_off_engine(writer.sync)  # no copy may land in the slot after this
        if bad is not None:
            dtype = str(writer.dtype).removeprefix("torch.")
            raise VersionRejected(f"{bad} holds NaN or Inf values (in {dtype})")
        await self.port.fill(index, version)
        if self.settings.canary_prompts:
            with trace.stage("canary"):
                result = await self._run_canary(version, progress)
            if not result.passed:  # nothing may run on rejected weights
                await self.port.release(index)
                raise VersionRejected(result.describe())

    async def _capture_graphs(self, index: int) -> None:
        """Where the copy moved the slot's tensors (a version of another precision), capture
        its CUDA graphs again on a stager thread while serving goes on; should that fail,
        `fill` captures them on the engine's thread between two steps (the streams wait)."""
        try:
            seconds = await run_off_engine(lambda: self.port.capture_graphs(index))
        except Exception:
            log.exception("weight slot %d: its graphs could not be captured beside serving; "
                          "the engine captures them between two steps", index)  # fmt: skip
            return
        if seconds:  # None: the tensors stayed; 0: no graphs (a CPU)
            log.info("weight slot %d holds a new structure: graphs captured beside serving "
                     "in %.2fs", index, seconds)  # fmt: skip

    def _bytes(self, progress: ProgressSink, stage: str, version: str) -> ByteProgress:
        loop = asyncio.get_running_loop()
        return ByteProgress(loop, progress, stage, version, pace=self._host_pacer())

    def _load(
        self, record: WeightVersion, loop: asyncio.AbstractEventLoop, progress: ProgressSink
    ) -> LoadedVersion:
        """The version's checkpoint, checked against its manifest (stager thread)."""
        path = Path(record.path)
        if not record.manifest_digest:  # the start-up model: a checkpoint without a manifest
            try:
                checkpoint = load_checkpoint(path, tokenizer=self.serving.tokenizer)
                return LoadedVersion(checkpoint, manifest=None)
            except CheckpointError as exc:
                raise VersionRejected(str(exc)) from None
        root = Path(self.settings.watch_root) if record.source == "watch" else None
        pacer = self._host_pacer()
        on_bytes = ByteProgress(loop, progress, "verify", record.version, pace=pacer)
        # A paced stager (CPU serving) hashes on its own thread, the only one its pacer sees;
        # an unpaced one in a child process, whose threads leave this interpreter alone.
        unpaced = pacer.share >= 1.0
        loaded = load_version(path, root=root, on_progress=on_bytes,
                              hash_workers=_HASH_WORKERS if unpaced else 1,
                              tokenizer=self.serving.tokenizer, dtype=self.serving.dtype,
                              chunk_bytes=_GPU_HASH_CHUNK_BYTES if unpaced else 0,
                              in_child=unpaced)  # fmt: skip
        assert loaded.manifest is not None
        if loaded.manifest.digest != record.manifest_digest:
            raise VersionRejected("manifest.json changed since the version was registered")
        return loaded

    async def _copy_to_standby(
        self, loaded: LoadedVersion, version: str, progress: ProgressSink, trace: SwapTraceLike
    ) -> None:
        index = await self._reserve_standby(version, progress)
        loop = asyncio.get_running_loop()
        on_bytes = ByteProgress(loop, progress, "stage", version, pace=self._copy_pacer())
        tensors, chunk = loaded.checkpoint.tensors, self.settings.chunk_bytes
        source = loaded.checkpoint.quant
        with trace.stage("stage"):
            await run_off_engine(
                lambda: self.port.copy_into(
                    index, tensors, chunk_bytes=chunk, on_progress=on_bytes, source=source
                )
            )
            await self._capture_graphs(index)
        await self.port.fill(index, version)
        if self.settings.canary_prompts:
            with trace.stage("canary"):
                result = await self._run_canary(version, progress)
            if not result.passed:  # nothing may run on rejected weights
                await self.port.release(index)
                raise VersionRejected(result.describe())

    async def _reserve_standby(self, version: str, progress: ProgressSink) -> int:
        """Take the standby slot from the engine once no request runs on it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.slot_wait_s
        while True:
            try:
                return await self.port.reserve_standby()
            except StandbyBusy as busy:
                held, num = busy.version, busy.num_requests
            if loop.time() > deadline:
                raise SwapRefusedError(
                    f"the standby slot still serves {num} requests on version {held} (a drain, "
                    "or a restart taking them back); try again when they have left it"
                )
            message = f"waiting for {num} requests on {held} to leave its slot"
            progress(SwapProgress("stage", version, message=message))
            await asyncio.sleep(_SLOT_POLL_S)

    def _host_pacer(self) -> Pacer:
        """Verify and validate: paced on the stager thread's CPU time where serving needs the
        cores (a CPU device); unpaced on a GPU, whose engine leaves host cores free."""
        return Pacer(1.0 if self.settings.to_gpu else self.settings.share)

    def _copy_pacer(self) -> Pacer:
        """The copy: on a GPU paced on the device time of its transfers (the link), else on
        the stager thread's CPU time (the cores)."""
        if self.settings.to_gpu:
            return Pacer(self.settings.share, clock=self.port.copy_seconds)
        return Pacer(self.settings.share)

    async def _run_canary(self, version: str, progress: ProgressSink) -> CanaryResult:
        """Both versions' log-probabilities on every prompt, computed in the engine's steps
        (a few prompts at a time: their log-probabilities stay on the device until compared),
        each prompt compared on a thread of its own (the comparison's host syncs would stall
        the event loop, which streams every token)."""
        active_version = self.port.status().weights_version
        prompts = [list(ids) for ids in self.settings.canary_prompts]
        started = f"{len(prompts)} prompts on {active_version} and {version}"
        progress(SwapProgress("canary", version, message=started))
        scores: list[CanaryScore] = []
        for group in _in_flight_groups(prompts, _CANARY_TOKENS_IN_FLIGHT):
            scores += await asyncio.gather(
                *(self._score(prompt, active_version, version) for prompt in group)
            )
        result = CanaryResult(tuple(scores), self.settings.canary_max_kl)
        message = result.describe()
        progress(SwapProgress("canary", version, message=message, canary_kl=result.mean_kl,
                              canary_ppl_ratio=result.ppl_ratio))  # fmt: skip
        log.info("%s", message, extra={"weights_version": version})
        return result

    async def _score(self, prompt: list[int], active_version: str, version: str) -> CanaryScore:
        active, new = await asyncio.gather(
            self.port.prompt_logprobs(prompt, active_version),
            self.port.prompt_logprobs(prompt, version),
        )
        return await run_off_engine(lambda: compare(active, new, prompt), name="sitsd-canary")


def _in_flight_groups(prompts: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive prompts whose tokens, counted under both versions, stay within
    `max_tokens` (a longer prompt goes alone)."""
    groups: list[list[list[int]]] = []
    size = max_tokens
    for prompt in prompts:
        if size + 2 * len(prompt) > max_tokens:
            groups.append([])
            size = 0
        groups[-1].append(prompt)
        size += 2 * len(prompt)
    return groups
