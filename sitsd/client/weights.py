"""`WeightsClient`: push a trainer's tensors into a running sitsd as a new weights version.

    client = WeightsClient("gpu-host:50051")                      # token: $SITSD_ADMIN_TOKEN,
    result = client.push(model.state_dict(), version="step-1200")  # else the daemon's file
    result.timings  # {"receive": ..., "validate": ..., "canary": ..., "commit": ...}

`push` chooses the transport unless told (`transport="auto"`):

    ipc    every tensor is on a CUDA device and that GPU is the daemon's (its UUID, from
           Admin.Status): the daemon copies device to device from the trainer's memory
    dist   this client joined a weight group (`WeightGroup.create`): one broadcast per bucket
           feeds every daemon of the group (NCCL between GPUs, gloo between CPUs)
    grpc   otherwise: the bytes over the Admin.UpdateWeights stream, in chunks

The daemon validates, canaries and commits the version like one from files; a rejected push
raises `PushError` (its `code` and the reason, which names the tensor). Progress goes to
`progress` as `PushProgress` (bytes sent for grpc, the daemon's stages for ipc and dist).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
import torch

from sitsd.api.push_wire import MAX_CHUNK_BYTES
from sitsd.api.v1 import admin_pb2, admin_pb2_grpc
from sitsd.client.tensors import (
    NamedTensors,
    chunk_messages,
    flat_copy,
    ipc_tensors,
    named_list,
    nbytes,
    tensor_table,
)
from sitsd.config import ADMIN_TOKEN_FILE_NAME, default_state_dir

TOKEN_ENV = "SITSD_ADMIN_TOKEN"
TRANSPORTS = ("auto", "grpc", "ipc", "dist")
# A thousand messages for 16 GB: each message costs the daemon's event loop a turn or more, and
# under 2 MiB ones (under gRPC's default 4 MiB limit) those turns, not the bytes, held the rate
# to 0.5 GB/s on an H200 host; past glibc's 32 MiB mmap threshold every message's buffers would
# be fresh pages again.
DEFAULT_CHUNK_BYTES = 16 * 2**20
UPDATE_WEIGHTS = "/sitsd.api.v1.Admin/UpdateWeights"
POLICIES = {
    "": admin_pb2.SWAP_POLICY_UNSPECIFIED,
    "migrate": admin_pb2.SWAP_POLICY_MIGRATE,
    "drain": admin_pb2.SWAP_POLICY_DRAIN,
    "restart": admin_pb2.SWAP_POLICY_RESTART,
}


class PushError(Exception):
    """The daemon refused or rejected a push; `code` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class PushProgress:
    """How far a push is."""

    stage: str  # "send" (grpc, this side), or the daemon's: ready, receive, released, ...
    bytes_done: int = 0
    bytes_total: int = 0
    message: str = ""


@dataclass(frozen=True)
class PushResult:
    """A push that landed."""

    version: str
    transport: str  # grpc, ipc or dist
    outcome: str  # committed, or staged (commit=False)
    num_tensors: int
    num_bytes: int
    timings: dict[str, float] = field(default_factory=dict)  # the daemon's seconds per stage
    total_s: float = 0.0  # the daemon's, from the call to the commit
    call_s: float = 0.0  # this side's, from the call to the answer
    pause_ms: float = 0.0  # the serving pause at the commit
    policy: str = ""

    @staticmethod
    def of(update: admin_pb2.WeightUpdate, call_s: float) -> PushResult:
        stages = {"receive": update.receive_s, "validate": update.validate_s,
                  "canary": update.canary_s, "commit": update.commit_s}  # fmt: skip
        return PushResult(
            update.version, update.transport, update.outcome, update.num_tensors,
            update.num_bytes, stages, update.total_s, call_s, update.pause_ms, update.policy,
        )  # fmt: skip


Progress = Callable[[PushProgress], None]


class GroupLike(Protocol):
    """The weight group a client joined (`sitsd.client.group.WeightGroup`)."""

    def push_header(
        self,
        client: WeightsClient,
        header: admin_pb2.PushHeader,
        tensors: list[tuple[str, torch.Tensor]],
        progress: Progress,
        timeout: float | None,
    ) -> PushResult: ...


def read_token(token: str | None, token_file: str | None) -> str:
    """The admin token: `token`, else `token_file`, else $SITSD_ADMIN_TOKEN, else the daemon's
    default file (`<state dir>/admin-token`)."""
    if token:
        return token
    if not token_file and os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    path = Path(token_file or Path(default_state_dir(os.environ)) / ADMIN_TOKEN_FILE_NAME)
    return path.expanduser().read_text().strip()


class WeightsClient:
    """One daemon's Admin service, for pushing weights (see the module docstring)."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        token_file: str | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        """Args:
        address: the daemon's gRPC address (host:port).
        token, token_file: the admin token, or where to read it.
        channel: a channel to use instead of a plaintext one to `address`.
        """
        self.address = address
        self._metadata = (("authorization", f"Bearer {read_token(token, token_file)}"),)
        self._channel = channel or grpc.insecure_channel(address)
        self.stub = admin_pb2_grpc.AdminStub(self._channel)
        # UpdateWeights with messages serialized already (`chunk_messages`): the stub's own
        # would take `UpdateWeightsRequest`s, built with three copies of every chunk.
        self._update_weights = self._channel.stream_unary(
            UPDATE_WEIGHTS, response_deserializer=admin_pb2.WeightUpdate.FromString
        )
        self.group: GroupLike | None = None  # set by WeightGroup.create
        self._device_uuid: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def close(self) -> None:
        self._channel.close()

    def status(self, timeout: float = 10.0) -> admin_pb2.StatusResponse:
        return self.stub.Status(admin_pb2.StatusRequest(), metadata=self._metadata, timeout=timeout)

    def push(
        self,
        named_tensors: NamedTensors,
        *,
        version: str = "",
        transport: str = "auto",
        policy: str = "",
        partial: bool = False,
        commit: bool = True,
        origin: str = "",
        dtype: torch.dtype | None = None,
        progress: Progress | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        ipc_flatten: bool = False,
        timeout: float | None = None,
    ) -> PushResult:
        """Push tensors (Hugging Face names) as a new weights version; returns once committed.

        Args:
            named_tensors: a mapping or (name, tensor) pairs, e.g. `model.state_dict()`.
            version: its id ("" = the daemon generates one).
            transport: "auto", "grpc", "ipc" or "dist" (see the module docstring).
            policy: what the commit does with requests in flight ("" = the daemon's).
            partial: only some tensors: the daemon keeps the active version's others.
            commit: False: validated and staged only (commit later with Admin.Swap).
            origin: free text kept with the version (run, step).
            dtype: cast the tensors to this before sending (e.g. torch.bfloat16).
            progress: called as the push goes.
            chunk_bytes: grpc: the most one message carries (at most `MAX_CHUNK_BYTES`, 64 MiB:
                the daemon refuses larger messages).
            ipc_flatten: ipc: copy the tensors into one flat buffer on their GPU first (their
                size again, until the push returns), so that the daemon maps one allocation
                instead of one per tensor the trainer allocated apart.
            timeout: seconds for the whole push (None: no limit).

        Raises:
            PushError: refused or rejected (the reason names the tensor).
            ValueError: an unknown transport, one that cannot carry these tensors, or a
                `chunk_bytes` the daemon would refuse.
        """
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], not {chunk_bytes}")
        tensors = named_list(named_tensors, dtype)
        header = admin_pb2.PushHeader(
            version=version, policy=POLICIES[policy], partial=partial, stage_only=not commit,
            origin=origin, tensors=tensor_table(tensors),
        )  # fmt: skip
        chosen = self._transport(transport, tensors)
        started = time.monotonic()
        report = progress or _ignore
        try:
            if chosen == "grpc":
                update = self._push_grpc(header, tensors, chunk_bytes, report, timeout)
            elif chosen == "ipc":
                sent = flat_copy(tensors) if ipc_flatten else tensors
                update = self._push_ipc(header, sent, report, timeout)
            else:
                assert self.group is not None
                return self.group.push_header(self, header, tensors, report, timeout)
        except grpc.RpcError as exc:
            raise PushError(exc.code(), exc.details() or "") from None
        return PushResult.of(update, time.monotonic() - started)

    # ------------------------------------------------------------------------ transports

    def _transport(self, transport: str, tensors: list[tuple[str, torch.Tensor]]) -> str:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
        if transport == "dist" and self.group is None:
            raise ValueError("transport dist needs a weight group: WeightGroup.create([client])")
        if transport == "ipc" and not self._same_gpu(tensors):
            raise ValueError("transport ipc needs every tensor on the daemon's GPU")
        if transport != "auto":
            return transport
        if self._same_gpu(tensors):
            return "ipc"
        return "dist" if self.group is not None else "grpc"

    def _same_gpu(self, tensors: list[tuple[str, torch.Tensor]]) -> bool:
        devices = {t.device for _, t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return False
        if self._device_uuid is None:
            self._device_uuid = self.status().weight_push.device_uuid
        device = next(iter(devices))
        return bool(self._device_uuid) and (
            str(torch.cuda.get_device_properties(device).uuid) == self._device_uuid
        )

    def _push_grpc(
        self,
        header: admin_pb2.PushHeader,
        tensors: list[tuple[str, torch.Tensor]],
        chunk_bytes: int,
        progress: Progress,
        timeout: float | None,
    ) -> admin_pb2.WeightUpdate:
        total = nbytes(tensors)

        def messages() -> Iterator[bytes]:
            yield admin_pb2.UpdateWeightsRequest(header=header).SerializeToString()
            sent = 0
            for name, t in tensors:
                for message, carried in chunk_messages(name, t, chunk_bytes):
                    yield message
                    sent += carried
                    progress(PushProgress("send", sent, total))

        update: admin_pb2.WeightUpdate = self._update_weights(
            messages(), metadata=self._metadata, timeout=timeout
        )
        return update

    def _push_ipc(
        self,
        header: admin_pb2.PushHeader,
        tensors: list[tuple[str, torch.Tensor]],
        progress: Progress,
        timeout: float | None,
    ) -> admin_pb2.WeightUpdate:
        device = tensors[0][1].device
        torch.cuda.current_stream(device).synchronize()  # what the tensors hold is written
        request = admin_pb2.UpdateWeightsIpcRequest(
            header=header,
            tensors=ipc_tensors(tensors),
            device_uuid=str(torch.cuda.get_device_properties(device).uuid),
        )
        # `tensors` stays referenced until the daemon says "released" (or the call ends).
        return follow_events(
            self.stub.UpdateWeightsIpc(request, metadata=self._metadata, timeout=timeout),
            progress,
        )


def follow_events(
    events: Iterator[admin_pb2.PushEvent],
    progress: Progress,
    on_stage: Callable[[str], None] | None = None,
) -> admin_pb2.WeightUpdate:
    """The last event's update, reporting (and telling `on_stage` of) the ones before."""
    for event in events:
        if event.WhichOneof("event") == "done":
            return event.done
        p = event.progress
        progress(PushProgress(p.stage, p.bytes_done, p.bytes_total, p.message))
        if on_stage is not None:
            on_stage(p.stage)
    raise PushError(grpc.StatusCode.UNKNOWN, "the daemon ended the push without a result")


def _ignore(progress: PushProgress) -> None:
    pass
