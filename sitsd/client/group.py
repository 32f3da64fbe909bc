"""`WeightGroup`: a trainer (rank 0) and daemons (ranks 1..n) in a torch.distributed group.

    group = WeightGroup.create([WeightsClient("a:50051"), WeightsClient("b:50051")])
    results = group.push(model.state_dict(), version="step-1200")  # one per daemon

`create` hosts the rendezvous (a `TCPStore` on this machine), asks each daemon to join
(`Admin.JoinWeightGroup`) and joins itself; NCCL between GPUs, gloo between CPUs. `push` packs
the tensors into buckets (`bucket_bytes` each, a larger tensor alone: a few broadcasts, not one
per parameter), tells every daemon the layout (`Admin.UpdateWeightsFromGroup`), waits until
each says "ready" (the standby slot is reserved and receiving), then broadcasts the buckets.
The group is an object of its own: no default process group, nothing read from the
environment, so a trainer's own torch.distributed setup is untouched.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import torch
import torch.distributed as dist

from sitsd.api.v1 import admin_pb2
from sitsd.client.tensors import (
    BucketLayout,
    NamedTensors,
    bucket_layout,
    fill_bucket,
    named_list,
    tensor_table,
)
from sitsd.client.weights import (
    POLICIES,
    Progress,
    PushError,
    PushResult,
    WeightsClient,
    _ignore,
    follow_events,
)
from sitsd.runtime.process_group import WeightGroup as ProcessGroup
from sitsd.runtime.process_group import broadcast, local_address_towards, stateless_group

T = TypeVar("T")

DEFAULT_BUCKET_BYTES = 512 * 2**20
_POLL_S = 0.05  # how often to look at the daemons while waiting for them


class WeightGroup:
    """The group a trainer pushes weights over (see the module docstring)."""

    def __init__(
        self, members: Sequence[WeightsClient], group: ProcessGroup, backend: str, name: str
    ) -> None:
        self.members = list(members)
        self.backend = backend
        self.name = name
        self._group = group

    @classmethod
    def create(
        cls,
        clients: Sequence[WeightsClient],
        *,
        backend: str = "",
        master_address: str = "",
        master_port: int = 0,
        name: str = "",
        timeout_s: float = 600.0,
    ) -> WeightGroup:
        """Host a group and have every daemon of `clients` join it (ranks 1..n, in order).

        Args:
            backend: "nccl" or "gloo" ("" = nccl when this process and every daemon have a
                GPU, else gloo).
            master_address: the address daemons reach this machine at ("" = the one on the
                route to the first daemon).
            master_port: the store's port (0 = a free one).
            name: the group's name ("" = generated).
            timeout_s: for the rendezvous and every broadcast.

        Raises:
            PushError: a daemon refused to join.
        """
        if not backend:  # NCCL when every rank has a GPU
            on_gpus = all(c.status().weight_push.device.startswith("cuda") for c in clients)
            backend = "nccl" if on_gpus and torch.cuda.is_available() else "gloo"
        name = name or f"trainer-{time.time_ns()}"
        if not master_address:
            host, _, port = clients[0].address.rpartition(":")
            master_address = local_address_towards(host.strip("[]"), int(port))
        timeout = datetime.timedelta(seconds=timeout_s)
        world = len(clients) + 1
        store = dist.TCPStore(master_address, master_port, world, is_master=True,
                              timeout=timeout, wait_for_workers=False)  # fmt: skip
        joins = []
        for rank, client in enumerate(clients, start=1):
            request = admin_pb2.JoinWeightGroupRequest(
                master_address=master_address, master_port=store.port, world_size=world,
                rank=rank, backend=backend, group_name=name, timeout_s=timeout_s,
            )  # fmt: skip
            join = functools.partial(client.stub.JoinWeightGroup, request,
                                     metadata=client.metadata, timeout=timeout_s)  # fmt: skip
            joins.append(in_thread(join))
        own = in_thread(functools.partial(
            stateless_group, backend=backend, master_address=master_address,
            master_port=store.port, rank=0, world_size=world, group_name=name, timeout=timeout,
            store=store,
        ))  # fmt: skip
        _wait_all([*joins, own])
        self = cls(clients, own.result(), backend, name)
        for client in clients:
            client.group = self
        return self

    def push(
        self,
        named_tensors: NamedTensors,
        *,
        version: str = "",
        policy: str = "",
        partial: bool = False,
        commit: bool = True,
        origin: str = "",
        dtype: torch.dtype | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> list[PushResult]:
        """Push to every daemon of the group at once; one result per member, in order.

        The arguments are `WeightsClient.push`'s. Raises `PushError` when a daemon refuses
        (before any broadcast) or rejects the push.
        """
        tensors = named_list(named_tensors, dtype)
        header = admin_pb2.PushHeader(
            version=version, policy=POLICIES[policy], partial=partial, stage_only=not commit,
            origin=origin, tensors=tensor_table(tensors),
        )  # fmt: skip
        return self._push(header, tensors, progress or _ignore, timeout, bucket_bytes)

    def push_header(
        self,
        client: WeightsClient,
        header: admin_pb2.PushHeader,
        tensors: list[tuple[str, torch.Tensor]],
        progress: Progress,
        timeout: float | None,
    ) -> PushResult:
        """`WeightsClient.push` over the group: every member receives it; `client`'s result."""
        results = self._push(header, tensors, progress, timeout, DEFAULT_BUCKET_BYTES)
        return results[self.members.index(client)]

    def _push(
        self,
        header: admin_pb2.PushHeader,
        tensors: list[tuple[str, torch.Tensor]],
        progress: Progress,
        timeout: float | None,
        bucket_bytes: int,
    ) -> list[PushResult]:
        started = time.monotonic()
        layout = bucket_layout(tensors, bucket_bytes)
        request = admin_pb2.UpdateWeightsFromGroupRequest(
            header=header, bucket_bytes=layout.bucket_bytes, src_rank=0,
            placements=[admin_pb2.TensorPlacement(bucket=b, offset=o)
                        for b, o in layout.placements],
        )  # fmt: skip
        calls = [m.stub.UpdateWeightsFromGroup(request, metadata=m.metadata, timeout=timeout)
                 for m in self.members]  # fmt: skip
        ready = [threading.Event() for _ in calls]
        results = [
            in_thread(functools.partial(follow_events, call, progress, _when_ready(event)))
            for call, event in zip(calls, ready, strict=True)
        ]
        try:
            for event, result in zip(ready, results, strict=True):
                while not (event.wait(_POLL_S) or result.done()):
                    pass
                if result.done():
                    result.result()  # refused before any broadcast: its error
            self._broadcast(tensors, layout)
            updates = [r.result() for r in results]
        except grpc.RpcError as exc:
            for call in calls:
                call.cancel()  # the others must not wait for broadcasts that never come
            raise PushError(exc.code(), exc.details() or "") from None
        elapsed = time.monotonic() - started
        return [PushResult.of(update, elapsed) for update in updates]

    def _broadcast(self, tensors: list[tuple[str, torch.Tensor]], layout: BucketLayout) -> None:
        """Fill each bucket and broadcast it from rank 0 (this process)."""
        sizes = layout.bucket_bytes
        if self.backend == "nccl":
            cuda = [t.device for _, t in tensors if t.is_cuda]
            device = cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        buffer = torch.empty(max(sizes), dtype=torch.uint8, device=device)
        for index, size in enumerate(sizes):
            bucket = buffer[:size]
            fill_bucket(bucket, tensors, layout, index)
            # NCCL: the next fill waits on the current stream for this broadcast to be read.
            broadcast(self._group, bucket, 0)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def _when_ready(event: threading.Event) -> Callable[[str], None]:
    def on_stage(stage: str) -> None:
        if stage == "ready":
            event.set()

    return on_stage


def in_thread(fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """Run `fn` on a daemon thread (a blocked rendezvous must not hold up the exit)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def body() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=body, daemon=True, name="sitsd-client").start()
    return future


def _wait_all(futures: Sequence[concurrent.futures.Future[Any]]) -> None:
    """Wait for all; the first failure is raised at once (the others may never end)."""
    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for future in done:
        exc = future.exception()
        if isinstance(exc, grpc.RpcError):
            raise PushError(exc.code(), exc.details() or "") from None
        if exc is not None:
            raise exc
