"""A push's tensor table, checked before any weight slot is touched, and what a transport does.

A trainer's push (`sitsd.weights.push`) announces its tensors before their bytes: each one's
Hugging Face name, the dtype of the bytes sent and the shape, in the order they will come. Every
transport (a gRPC stream, CUDA IPC handles, a torch.distributed group) carries that table, so
`check_plan` can reject an unknown name, a wrong shape or dtype, a duplicate, or (unless the
push is partial) a missing tensor before the standby slot is reserved. A partial push names
only some tensors; the stager copies the others from the active slot. Values (NaN, Inf) can
only be checked once they are in the slot; `check_received` tells a push cut short.

A transport is a `PushSource`: the stager (`sitsd.weights.staging.StandbyStager.stage_pushed`)
asks it to `check` what it was told (IPC handles, a bucket layout), then hands it a
`SlotWriter` of the reserved slot and awaits `receive`. Validating values, copying
the rest, the canary and the commit are the stager's and the swap manager's, shared with
versions read from files.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Protocol

import torch

from sitsd.weights.checks import ServingModel, VersionRejected
from sitsd.weights.progress import ProgressSink

if TYPE_CHECKING:
    from sitsd.runtime.slot_writer import SlotWriter

# The dtypes a push may send (as their names on the wire); the stager casts to the slot's.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_EXAMPLES = 3  # names quoted in a message about many tensors


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a push carries."""

    name: str  # Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
    dtype: str  # of the bytes sent: a key of DTYPES
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class PushPlan:
    """What a push carries: its tensors in the order they come, and whether it is partial.

    Its names and bytes are computed once (~300 tensors of an 8B model): the interpreter a push
    holds at its start is taken from the engine's steps."""

    tensors: tuple[TensorSpec, ...]
    partial: bool = False  # tensors not named are copied from the active version

    @functools.cached_property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def check_plan(plan: PushPlan, serving: ServingModel) -> None:
    """Check a push's table against the serving model.

    Raises:
        VersionRejected: naming the first tensor that is wrong (or the ones missing).
    """
    if not plan.tensors:
        raise VersionRejected("the push names no tensor")
    expected = serving.shapes
    seen: set[str] = set()
    for spec in plan.tensors:
        if spec.name in seen:
            raise VersionRejected(f"{spec.name} is sent twice")
        seen.add(spec.name)
        shape = expected.get(spec.name)
        if shape is None:
            hint = " (its embeddings are tied)" if spec.name == "lm_head.weight" else ""
            raise VersionRejected(f"{spec.name} is not a tensor of the serving model{hint}")
        if spec.dtype not in DTYPES:
            raise VersionRejected(
                f"{spec.name} has dtype {spec.dtype or '(none)'}, expected one of "
                f"{', '.join(DTYPES)}"
            )
        if spec.shape != shape:
            raise VersionRejected(f"{spec.name} has shape {spec.shape}, expected {shape}")
    missing = [name for name in expected if name not in seen]
    if missing and not plan.partial:
        raise VersionRejected(
            f"{len(missing)} tensors missing, e.g. {missing[:_EXAMPLES]} (a push that is not "
            "partial names every tensor; a partial one keeps the others from the active version)"
        )


def check_received(plan: PushPlan, writer: SlotWriter) -> None:
    """Every tensor of the table arrived whole.

    Raises:
        VersionRejected: the first tensor cut short, or how many never came.
    """
    never = []
    for spec in plan.tensors:
        got = writer.written(spec.name)
        if got == 0:
            never.append(spec.name)
        elif got < spec.numel:
            raise VersionRejected(
                f"incomplete push: {spec.name} got {got * spec.torch_dtype.itemsize} of "
                f"{spec.nbytes} bytes"
            )
    if never:
        raise VersionRejected(
            f"incomplete push: {len(never)} tensors never came, e.g. {never[:_EXAMPLES]}"
        )


class PushSource(Protocol):
    """A transport's side of one push (`sitsd.weights.push_stream`, `push_ipc`, `push_dist`)."""

    @property
    def plan(self) -> PushPlan: ...

    def check(self) -> None:
        """The transport's own checks of what it was told (before any slot is touched).

        Raises:
            VersionRejected: naming the tensor.
        """
        ...

    async def receive(
        self, writer: SlotWriter, version: str, progress: ProgressSink, cpu_share: float
    ) -> int:
        """Write the table's tensors into the reserved slot through `writer`; the bytes
        received. Work off the event loop and the engine thread; pace CPU work to `cpu_share`
        of a core (`sitsd.weights.progress.Pacer`).

        Raises:
            VersionRejected: the bytes do not fit the table (the reason names the tensor).
        """
        ...
