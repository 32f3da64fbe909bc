"""A real in-process engine (the tiny Llama) with its swap manager, its `WeightPushes` and, when
asked, the gRPC server in front of them on port 0: what the push tests drive.

Tensors pushed are the tiny model's Hugging Face-named tensors; `slot_tensors` reads a slot
back under the same names (through the weight copy plan), so a test can compare what a push
put in a slot with what it sent, bit for bit.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from sitsd.api.server import ApiServer
from sitsd.config import ServerConfig
from sitsd.model.llama import weight_copy_plan
from sitsd.weights.push import PushHeader, PushSettings, UpdateReport, WeightPushes
from sitsd.weights.push_plan import DTYPES, PushPlan, TensorSpec
from sitsd.weights.push_stream import StreamedPush, TensorPiece
from tests.weights.test_swap_manager import Served
from tests.weights.tiny_versions import write_version

ADMIN_TOKEN = "push-test-token"
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_two_versions(root: Path) -> dict[str, Path]:
    """ "v1" and "v2" (v1 with fresh random noise) as version directories under `root`."""
    return {
        "v1": write_version(root / "v1"),
        "v2": write_version(root / "v2", noise_seed=random.randrange(2**20)),
    }


def version_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The Hugging Face-named tensors of a version directory."""
    return load_file(str(directory / "model.safetensors"))


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    dtype = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
    return TensorSpec(name, dtype, tuple(tensor.shape))


def streamed(
    tensors: dict[str, torch.Tensor], *, partial: bool = False, chunk_bytes: int = 4096
) -> StreamedPush:
    """A gRPC-like push of `tensors`, cut into pieces of `chunk_bytes`."""
    plan = PushPlan(tuple(spec_of(n, t) for n, t in tensors.items()), partial=partial)
    return StreamedPush(plan, pieces(tensors.items(), chunk_bytes))


async def pieces(
    tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int
) -> AsyncIterator[TensorPiece]:
    for name, tensor in tensors:
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        step = chunk_bytes - chunk_bytes % tensor.element_size()
        for start in range(0, len(raw), step):
            yield TensorPiece(name, raw[start : start + step])


class PushServed(Served):
    """`Served` with live pushes, and optionally the gRPC server (`serve_grpc`)."""

    def __init__(self, v1: Path, state_dir: Path, keep_pushed: int = 8, **weights) -> None:
        super().__init__(v1, state_dir, **weights)
        self.pushes = WeightPushes(self.manager, PushSettings(keep_pushed=keep_pushed), self.obs)
        self.server: ApiServer | None = None
        self.address = ""

    def serve_grpc(self) -> str:
        async def start() -> int:
            self.server = ApiServer(
                ServerConfig(host="127.0.0.1", port=0), admin_token=ADMIN_TOKEN,
                max_tokens_default=16,
            )  # fmt: skip
            port = await self.server.start()
            await self.server.attach_engine(self.engine, self.manager, self.pushes)
            return port

        self.address = f"127.0.0.1:{self.run(start())}"
        return self.address

    def push(
        self, source: StreamedPush, header: PushHeader | None = None, transport: str = "grpc"
    ) -> UpdateReport:
        header = header or PushHeader()
        return self.run(self.pushes.push(header, source, transport, "test", self.progress.append))

    def slot_tensors(self, version: str) -> dict[str, torch.Tensor]:
        """The tensors of the slot holding `version`, by Hugging Face name (copies)."""
        slots = self.engine.core.runner.slots
        index = slots.index_of(version)
        assert index is not None, f"{version} is in no slot: {slots.versions}"
        plan = weight_copy_plan(slots.arch, slots.weights(index))
        return {name: view.clone() for view, name in plan}

    def close(self) -> None:
        if self.server is not None:
            self.run(self.server.stop(0))
        super().close()


def run_async(coro):
    return asyncio.run(coro)
