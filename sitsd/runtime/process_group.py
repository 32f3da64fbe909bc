"""A torch.distributed process group of its own: no default group, no environment variables.

`torch.distributed.init_process_group` keeps one group per process in module state and reads
`MASTER_ADDR` & co. from the environment; a daemon that joins a trainer's weight group (and a
trainer that also trains with its own default group) needs a group that is just an object:
`stateless_group` rendezvouses through a `TCPStore` (the trainer's rank hosts it) and builds
the backend directly (gloo on CPUs, NCCL on GPUs). The trainer's client (`sitsd.client`) and the
daemon (`sitsd.weights.push_dist`) both build theirs here, so they agree on how.
"""

from __future__ import annotations

import datetime
import socket
from typing import Protocol, cast

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class WeightGroup(Protocol):
    """What a weight push uses of a process group (a gloo or NCCL backend object)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def rank(self) -> int: ...

    def size(self) -> int: ...


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (the interface gloo must listen on)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # a UDP connect sends nothing: it only picks the route
        return str(probe.getsockname()[0])


def stateless_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: datetime.timedelta,
    store: dist.TCPStore | None = None,
) -> WeightGroup:
    """Join (rank 0: host) a group of `world_size` ranks; blocks until every rank has joined.

    Args:
        backend: "gloo" or "nccl".
        master_address, master_port: where rank 0's `TCPStore` listens.
        rank, world_size: this rank, and how many there are.
        group_name: prefixes the rendezvous keys (several groups may share one store).
        timeout: for the rendezvous and every collective after it.
        store: rank 0's own store (created by the caller to learn its port); None: connect.

    Raises:
        ValueError: an unknown backend, or NCCL in a build without it.
        RuntimeError, TimeoutError: the rendezvous failed (a rank never came).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False,
                              timeout=timeout)  # fmt: skip
    prefixed = dist.PrefixStore(f"sitsd-weights/{group_name}/", store)
    # torch's stubs lag its bindings (the option objects torch's own init_process_group uses).
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        address = local_address_towards(master_address, master_port)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        gloo = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        return cast(WeightGroup, gloo)
    if not dist.is_nccl_available():
        raise ValueError("this torch build has no NCCL: use the gloo backend")
    nccl_options = dist.ProcessGroupNCCL.Options()
    nccl_options._timeout = timeout
    nccl = dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_options)
    return cast(WeightGroup, nccl)


def broadcast(group: WeightGroup, tensor: torch.Tensor, src_rank: int) -> None:
    """Broadcast `tensor` from `src_rank` to every rank of `group`, in place.

    Gloo: returns once done. NCCL: returns once queued, with the current CUDA stream made to
    wait for it (work queued after it on that stream sees the data).
    """
    options = dist.BroadcastOptions()
    options.rootRank = src_rank
    group.broadcast([tensor], options).wait()
