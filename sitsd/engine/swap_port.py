"""The swap port: the one door from the weights subsystem into the engine.

`sitsd.weights` (staging, the canary, the swap manager) holds a `SwapPort` and nothing else of
the engine. Each call crosses from the asyncio loop to the engine thread, where the swap
controller (`sitsd.engine.swap_controller`) runs it between two steps, and back:

    reserve_standby()              the standby slot's index, released to the caller (or
                                   `StandbyBusy` while requests still run on its version)
    copy_into(index, tensors)      the caller's thread copies a version into the reserved slot
                                   (`copy_seconds`: the device time its transfers took)
    slot_writer(index)             or writes a pushed one into it, piece by piece (`SlotWriter`)
    capture_graphs(index)          then captures its CUDA graphs again where the copy moved its
                                   tensors (another precision), while serving goes on
    fill(index, version)           the copy is complete: the slot holds `version`
    release(index)                 give the slot back empty (a rejected version)
    prompt_logprobs(ids, version)  a canary prompt on that version, computed as low-priority
                                   work in the engine's next steps (the batch never pauses)
    commit(version, policy)        flip to `version`; its `SwapEvent`s until committed/failed
                                   (with one slot, `in_place` is copied over the only slot)

and it tells the fixed facts of the slots (`num_slots`, `arch`, `dtype`, `device`,
`slot_nbytes`) and the engine's status. A rollback is a commit of the version in the standby
slot. What to stage and when to commit is the weights subsystem's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, TypeVar, cast

from sitsd.engine.core import EngineCore
from sitsd.engine.messages import AheadWait, EngineCall, InPlaceCopy, SwapCommand, SwapEvent
from sitsd.outputs import EngineStatus

if TYPE_CHECKING:
    import torch

    from sitsd.model.arch import LlamaArch
    from sitsd.quant.source import QuantSource
    from sitsd.runtime.slot_writer import SlotWriter
    from sitsd.runtime.weight_slots import PinnedUpload

T = TypeVar("T")


class SwapPort:
    """The engine's hot-swap operations, awaitable from the asyncio loop."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._controller = core.swaps
        self._slots = core.runner.slots

    # ------------------------------------------------------------------------------ facts

    @property
    def num_slots(self) -> int:
        """1 or 2: with one, a commit copies in place (there is no standby slot)."""
        return self._slots.num_slots

    @property
    def slot_nbytes(self) -> int:
        return self._slots.slot_nbytes

    @property
    def arch(self) -> LlamaArch:
        return self._slots.arch

    @property
    def dtype(self) -> torch.dtype:
        return self._slots.dtype

    @property
    def device(self) -> torch.device:
        return self._slots.device

    def status(self) -> EngineStatus:
        """The engine's last snapshot (which version is in which slot, what is active)."""
        return self._core.status()

    # -------------------------------------------------------------------- engine thread

    async def reserve_standby(self) -> int:
        """The standby slot, released to the caller to copy a version into.

        Raises:
            sitsd.engine.swap_controller.StandbyBusy: requests still run on its version.
        """
        return await self._call(self._controller.reserve_standby, waits_for="standby")

    async def fill(self, index: int, version: str) -> None:
        """Slot `index` holds `version` now. A step in flight cannot read a slot being filled;
        one whose tensors moved and whose graphs were not captured beside serving
        (`capture_graphs`) has them captured first, which runs the model."""
        waits: AheadWait = "any" if self._slots.restructured(index) else "none"
        await self._call(functools.partial(self._controller.fill, index, version), waits_for=waits)

    async def release(self, index: int) -> None:
        await self._call(functools.partial(self._controller.release, index))

    async def prompt_logprobs(self, token_ids: list[int], version: str) -> torch.Tensor:
        """Next-token log-probabilities of every prompt position under `version`
        ([len(token_ids), vocab] float32 on the engine's device), computed in the engine's
        steps next to the requests they serve, under the pacing of a swap's work.

        Raises:
            KeyError: `version` is in no slot.
            RuntimeError: the prompt could not run (its version left its slot, its step
                failed, the engine stopped).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[torch.Tensor] = loop.create_future()

        def on_done(result: torch.Tensor | None, exc: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, done, result, exc)

        call = functools.partial(self._controller.prompt_logprobs, list(token_ids), version,
                                 on_done)  # fmt: skip
        await self._call(call, waits_for="none")  # queueing it runs nothing yet
        return await done

    def copy_into(
        self,
        index: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        chunk_bytes: int,
        on_progress: Callable[[int, int], None] | None = None,
        source: QuantSource | None = None,
    ) -> int:
        """Copy a checkpoint (`source`: what it stores quantized) into reserved slot `index`
        on the calling thread (never the engine's or the loop's: it takes seconds); returns
        the bytes copied."""
        return self._slots.copy_into(index, tensors, chunk_bytes=chunk_bytes,
                                     on_progress=on_progress, source=source)  # fmt: skip

    def capture_graphs(self, index: int) -> float | None:
        """Capture reserved slot `index`'s CUDA graphs again where its copy moved its tensors
        (a version of another precision), on the calling thread (never the engine's or the
        loop's: it takes seconds) while the engine goes on serving from the other slot; the
        seconds it took, None when its tensors stayed. Should it fail, `fill` captures them
        on the engine's thread between two steps, the streams waiting."""
        if not self._slots.restructured(index):
            return None
        seconds = self._core.runner.recapture_graphs(index, beside_serving=True)
        self._slots.take_restructured(index)
        return seconds

    def copy_seconds(self) -> float:
        """Device seconds the copies' host-to-device transfers took so far (0 on a CPU): the
        clock staging paces a copy to a GPU on. Read it on the copying thread."""
        return self._slots.copy_seconds

    def pinned_uploads(self) -> PinnedUpload | None:
        """The pinned buffers a swap's uploads go through (made at start-up; None on a CPU):
        one swap at a time uses them, on its own thread."""
        return self._slots.pinned_uploads()

    def slot_writer(self, index: int, *, chunk_bytes: int, device_share: float = 1.0) -> SlotWriter:
        """A writer into reserved slot `index` for a pushed version; what the push leaves out
        it copies from the active slot; on a GPU its device work takes at most `device_share`
        of the time. Used on the caller's threads (never the engine's or the loop's: copies
        take seconds)."""
        from sitsd.runtime.slot_writer import SlotWriter  # torch, only once a push arrives

        slots = self._slots
        return SlotWriter(slots.views(index), slots.views(slots.active), chunk_bytes=chunk_bytes,
                          device_share=device_share,
                          uploads=slots.pinned_uploads())  # fmt: skip

    def quantized_tensors(self) -> list[str]:
        """Tensors a weight slot holds in a quantized layout (a push writes 16-bit ones only)."""
        slots = self._slots
        return [name for i in range(slots.num_slots) for name in slots.views(i).quantized]

    async def commit(
        self, version: str, policy: str, in_place: InPlaceCopy | None = None
    ) -> AsyncIterator[SwapEvent]:
        """Commit `version` between two steps; yields its events until "committed" or
        "failed" (`sitsd.engine.swap_controller`)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[SwapEvent] = asyncio.Queue()

        def on_event(event: SwapEvent) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(events.put_nowait, event)

        self._core.submit(SwapCommand(version, policy, on_event, in_place))
        while True:
            event = await events.get()
            yield event
            if event.kind in ("committed", "failed"):
                return

    async def _call(self, fn: Callable[[], T], *, waits_for: AheadWait = "any") -> T:
        """Run `fn()` on the engine thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def reply(result: object, exc: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, done, cast(T, result), exc)

        self._core.submit(EngineCall(fn, reply, waits_for))
        return await done


def _settle(done: asyncio.Future[T], result: T | None, exc: BaseException | None) -> None:
    """Resolve `done` (on its loop) unless it is already (a caller gave up waiting)."""
    if done.done():
        return
    if exc is None:
        done.set_result(cast(T, result))
    else:
        done.set_exception(exc)
