"""What the engine needs of the model runner and its weight slots (`sitsd.runtime` has them).

The engine core launches steps (`ModelRunnerLike.launch`); the swap controller flips, fills and
releases weight slots (`WeightSlotsLike`) and takes the log-probabilities of canary prompts the
steps computed (`take_prompt_logprobs`). Nothing in the engine holds a tensor except those,
which it hands to the weights subsystem untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from sitsd.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    import torch

    from sitsd.model.arch import LlamaArch
    from sitsd.model.llama import LlamaWeights
    from sitsd.quant.source import QuantSource
    from sitsd.runtime.weight_slots import PinnedUpload, SlotViews


class PendingStepLike(Protocol):
    """A launched step; `result()` waits for its sampled tokens."""

    def result(self) -> ModelRunnerOutput: ...


class WeightSlotsLike(Protocol):
    """The runner's weight slots (`sitsd.runtime.weight_slots.WeightSlots`)."""

    versions: list[str | None]  # the version each slot holds (None: being rewritten)
    active: int  # the slot new requests run on

    @property
    def arch(self) -> LlamaArch: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def standby(self) -> int | None: ...

    @property
    def active_version(self) -> str: ...

    @property
    def slot_nbytes(self) -> int: ...

    @property
    def copy_seconds(self) -> float:
        """Device seconds of the staging copies' host-to-device transfers so far."""
        ...

    def pinned_uploads(self) -> PinnedUpload | None:
        """The pinned buffers a swap's uploads go through (None on a CPU)."""
        ...

    def index_of(self, version: str) -> int | None: ...

    def weights(self, index: int) -> LlamaWeights: ...

    def views(self, index: int) -> SlotViews:
        """Slot `index`'s tensors by Hugging Face name (kept while its tensors stay)."""
        ...

    def activate(self, version: str) -> None: ...

    def release(self, index: int) -> None: ...

    def fill(self, index: int, version: str) -> None: ...

    def copy_into(
        self,
        index: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        chunk_bytes: int,
        on_progress: Callable[[int, int], None] | None = None,
        source: QuantSource | None = None,
    ) -> int: ...

    def nbytes(self, index: int) -> int: ...

    def precision(self, index: int) -> str: ...

    def restructured(self, index: int) -> bool: ...

    def take_restructured(self, index: int) -> bool: ...


class ModelRunnerLike(Protocol):
    """The model runner (`sitsd.runtime.model_runner.ModelRunner`)."""

    def recapture_graphs(self, index: int, beside_serving: bool = False) -> float:
        """Capture slot `index`'s CUDA graphs again (its tensors moved); seconds taken.
        `beside_serving`: on another thread while the engine's serves from the other slot
        (`index` reserved), else on the engine's thread between two steps."""
        ...

    @property
    def slots(self) -> WeightSlotsLike: ...

    @property
    def overlaps_host_work(self) -> bool:
        """True when `launch` returns before the device has finished the step."""
        ...

    def launch(self, sched_out: SchedulerOutput) -> PendingStepLike: ...

    def take_prompt_logprobs(self, req_id: str) -> torch.Tensor:
        """The next-token log-probabilities at every position of canary probe `req_id`
        (`NewRequestData.probe`), whose last chunk a step computed ([num_tokens, vocab]
        float32, on the device); the runner keeps them no longer."""
        ...
