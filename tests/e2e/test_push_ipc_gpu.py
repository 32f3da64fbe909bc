"""CUDA IPC pushes into the real daemon on the GPU, from this process on the same GPU (marker
`gpu`): the checks of `test_push_load` for the IPC transport. Float32 on both sides, so a
daemon started fresh on the pushed weights computes what the pushed one must.

The daemons share the GPU with this process (`--gpu-memory-limit`); run on the GPU machine:

    scripts/device-check.sh tests tests/e2e/test_push_ipc_gpu.py
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from sitsd.api.v1 import admin_pb2, inference_pb2_grpc
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.client import PushError, WeightsClient
from sitsd.client.tensors import flat_copy, ipc_tensor, ipc_tensors, tensor_table
from sitsd.weights.export import perturbed, write_version
from tests.e2e.daemon_process import DaemonProcess
from tests.e2e.test_hot_swap_load import QUESTIONS
from tests.e2e.test_push_load import check_tokens, push_under_load

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1200)]

# A fixed migration allowance: the measured one spaces a piece that runs on the other slot
# alone (a whole pass over its weights) by up to 128 steps, and SmolLM2 on a GPU streams a
# token a step, so its shadows never caught up before the requests ended (on an H200 no request
# spanned the commit, twice). The pacing is `tests/engine`'s; here the transport is under test.
FLAGS = ("--device", "cuda", "--dtype", "float32", "--gpu-memory-limit", "6GiB",
         "--served-model-name", "smollm2", "--scheduling-policy", "fcfs", "--max-num-seqs", "8",
         "--max-model-len", "1024", "--migration-tokens-per-step", "64")  # fmt: skip
NOISE_SEED = random.randrange(2**20)
# Tokens of each continuation compared with a fresh daemon's. On a GPU a float32 step's result
# depends on the batch it ran in (cuBLAS picks its kernels by shape), so two daemons given the
# same weights and prefix agree only up to the first near tie; in the 300-500 tokens these
# requests run, mostly past their answers (ignore_eos), an H200 run met one (in one of the
# flattened push's continuations; the other pushes' all matched).
COMPARED = 48
LAYER0 = "model.layers.0."


@pytest.fixture(scope="module")
def pushed(smollm2) -> dict[str, torch.Tensor]:
    """The trainer's update, on this process's GPU."""
    return {n: t.cuda() for n, t in perturbed(smollm2.tensors, 0.02, seed=NOISE_SEED).items()}


@pytest.fixture(scope="module")
def layer0(pushed) -> dict[str, torch.Tensor]:
    """A partial update: layer 0's tensors only."""
    return {n: t for n, t in pushed.items() if n.startswith(LAYER0)}


def start(state: Path, model: Path) -> DaemonProcess:
    daemon = DaemonProcess(state, "--model", str(model), *FLAGS)
    daemon.wait_until_serving()
    return daemon


@pytest.fixture(scope="module")
def daemons(smollm2, pushed, layer0, tmp_path_factory) -> Iterator[dict[str, DaemonProcess]]:
    """The daemon pushed into (on v1), and fresh references on what each push makes."""
    root = tmp_path_factory.mktemp("ipc")
    cpu = {n: t.cpu() for n, t in pushed.items()}
    write_version(smollm2, root / "v1")
    write_version(smollm2, root / "full", cpu)
    write_version(smollm2, root / "partial", {**smollm2.tensors, **{n: cpu[n] for n in layer0}})
    started: dict[str, DaemonProcess] = {}
    try:
        for name in ("v1", "full", "partial"):
            started[name] = start(tmp_path_factory.mktemp(f"state-{name}"), root / name)
        yield started
    finally:
        for daemon in started.values():
            assert daemon.terminate() == 0, daemon.log


@pytest.fixture(scope="module")
def prompts(daemons) -> list[list[int]]:
    with grpc.insecure_channel(daemons["v1"].address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        chats = [
            pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=q)]) for q in QUESTIONS
        ]
        return [list(stub.Tokenize(pb.TokenizeRequest(chat=c)).token_ids) for c in chats]


@pytest.fixture(scope="module")
def client(daemons) -> Iterator[WeightsClient]:
    c = WeightsClient(daemons["v1"].address, token=daemons["v1"].admin_token())
    yield c
    c.close()


def test_partial_then_full_ipc_pushes_under_load_fail_nothing_and_match_fresh_daemons(
    daemons, prompts, client, pushed, layer0
):
    results, events = [], []

    def push(tensors: dict[str, torch.Tensor], version: str, partial: bool):
        def run() -> None:
            results.append(client.push(tensors, version=version, partial=partial,
                                       progress=events.append))  # fmt: skip

        return run

    # A GPU streams 200 tokens in a fraction of a second: requests long enough to span the
    # push (~0.1 s) and the migration behind it.
    long = (300, 500)
    records, _ = push_under_load(daemons["v1"], prompts, push(layer0, "ipc-partial", True), long)
    check_tokens(records, daemons["partial"], "v1", "ipc-partial", COMPARED)
    records, _ = push_under_load(daemons["v1"], prompts, push(pushed, "ipc-full", False), long)
    check_tokens(records, daemons["full"], "ipc-partial", "ipc-full", COMPARED)
    assert [(r.transport, r.outcome) for r in results] == [("ipc", "committed")] * 2
    stages = [e.stage for e in events]
    assert stages.count("released") == 2  # the daemon said when the tensors were free
    assert results[1].num_bytes == sum(t.numel() * 4 for t in pushed.values())


def test_bad_ipc_pushes_are_rejected_and_twenty_more_leak_nothing(daemons, client, pushed):
    name = "model.layers.1.mlp.down_proj.weight"
    nan = pushed[name].clone()
    nan.view(-1)[random.randrange(nan.numel())] = float("nan")
    with pytest.raises(PushError, match=f"{name} holds NaN or Inf"):
        client.push({name: nan}, version="ipc-nan", partial=True)
    with pytest.raises(PushError, match=f"{name} has shape"):
        client.push({name: pushed[name].T.contiguous()}, version="ipc-shape", partial=True)
    # A handle claiming less memory than its view reads is refused before it is opened.
    tensors = [(name, pushed[name])]
    request = admin_pb2.UpdateWeightsIpcRequest(
        header=admin_pb2.PushHeader(version="ipc-extent", partial=True,
                                    tensors=tensor_table(tensors)),
        tensors=[ipc_tensor(name, pushed[name])],
        device_uuid=str(torch.cuda.get_device_properties(0).uuid),
    )  # fmt: skip
    request.tensors[0].storage_size_bytes = 64
    with pytest.raises(grpc.RpcError) as error:
        list(client.stub.UpdateWeightsIpc(request, metadata=client.metadata))
    assert "its view reaches byte" in error.value.details()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for n in range(20):
        update = {name: pushed[name] * (1 + n / 100)}
        assert client.push(update, version=f"ipc-{n}", partial=True).outcome == "committed"
        del update
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()  # blocks the daemon released are free again
    assert torch.cuda.memory_allocated() <= before
    status = client.status()
    assert (status.num_blocks_used, status.num_running, status.num_waiting) == (0, 0, 0)
    slots = client.stub.ListVersions(admin_pb2.ListVersionsRequest(), metadata=client.metadata)
    assert sorted(v.slot for v in slots.versions if v.slot) == ["active", "standby"]


def test_a_flattened_ipc_push_under_load_fails_nothing_and_matches_a_fresh_daemon(
    daemons, prompts, client, pushed
):
    """`ipc_flatten`: the tensors as views of one buffer, one allocation for the daemon to map,
    reduced once (one handle, one count: the daemon releases it once, and the buffer is free)."""
    before = client.status().weights_version
    two = random.sample(sorted(pushed.items()), 2)
    described = ipc_tensors(flat_copy(two))
    assert len({(t.storage_handle, t.ref_counter_handle, t.ref_counter_offset)
                for t in described}) == 1  # fmt: skip
    del described  # (its count is never released: those two views' buffer stays in limbo)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    results = []

    def push() -> None:
        results.append(client.push(pushed, version="ipc-flat", ipc_flatten=True))

    records, _ = push_under_load(daemons["v1"], prompts, push, (300, 500))
    check_tokens(records, daemons["full"], before, "ipc-flat", COMPARED)
    assert [(r.transport, r.outcome) for r in results] == [("ipc", "committed")]
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()  # the flat buffer is free once the daemon let go of its count
    assert torch.cuda.memory_allocated() <= allocated
