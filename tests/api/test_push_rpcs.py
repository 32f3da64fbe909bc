"""The push RPCs over a real socket: the trainer's client (`sitsd.client`) against the gRPC
server in front of a real in-process engine (the tiny Llama)."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from sitsd.api.push_wire import MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES
from sitsd.api.server import UPDATE_WEIGHTS
from sitsd.api.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from sitsd.client import PushError, WeightGroup, WeightsClient
from sitsd.client.tensors import tensor_table
from sitsd.weights.versions import VersionState
from tests.weights.push_harness import ADMIN_TOKEN, PushServed, version_tensors, write_two_versions

NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    return write_two_versions(tmp_path_factory.mktemp("rpc-versions"))


@pytest.fixture
def served(versions, tmp_path):
    instance = PushServed(versions["v1"], tmp_path, keep_pushed=4)
    instance.serve_grpc()
    yield instance
    instance.close()


@pytest.fixture
def client(served):
    c = WeightsClient(served.address, token=ADMIN_TOKEN)
    yield c
    c.close()


def assert_slot_holds(served: PushServed, version: str, tensors: dict[str, torch.Tensor]) -> None:
    got = served.slot_tensors(version)
    for name, tensor in tensors.items():
        torch.testing.assert_close(got[name], tensor.float(), rtol=0, atol=0, msg=name)


def test_a_grpc_push_lands_exactly_and_status_shows_its_timings(served, client, versions):
    pushed = version_tensors(versions["v2"])
    sent = []
    result = client.push(pushed, version="step-3", chunk_bytes=random.randrange(100, 9000),
                         progress=sent.append)  # fmt: skip
    assert (result.version, result.transport, result.outcome) == ("step-3", "grpc", "committed")
    assert result.num_bytes == sent[-1].bytes_done == sent[-1].bytes_total
    assert result.timings["receive"] > 0
    assert result.timings["commit"] > 0
    assert result.call_s >= result.total_s > 0
    assert_slot_holds(served, "step-3", pushed)
    status = client.status().weight_push
    assert (status.device, status.device_uuid, status.weight_group) == ("cpu", "", "")
    last = status.last_update
    assert (last.version, last.outcome, last.num_tensors) == ("step-3", "committed", len(pushed))
    assert last.receive_s == pytest.approx(result.timings["receive"])
    metrics = served.obs.metrics
    assert metrics.weight_updates.labels("v1", "grpc", "committed")._value.get() == 1
    assert metrics.last_weight_update.labels("v1", "receive")._value.get() == last.receive_s


def test_push_rpcs_need_the_admin_token(served, versions):
    stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(served.address))
    header = admin_pb2.PushHeader(version="sneaky")
    calls = [
        lambda: stub.UpdateWeights(iter([admin_pb2.UpdateWeightsRequest(header=header)])),
        lambda: list(stub.UpdateWeightsIpc(admin_pb2.UpdateWeightsIpcRequest(header=header))),
        lambda: stub.JoinWeightGroup(admin_pb2.JoinWeightGroupRequest(master_port=1)),
        lambda: list(stub.UpdateWeightsFromGroup(admin_pb2.UpdateWeightsFromGroupRequest())),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert served.manager.registry.find("sneaky") is None
    assert served.pushes.last is None


def test_a_push_stream_starts_with_its_header_and_transports_are_checked(served, client):
    with pytest.raises(grpc.RpcError) as error:
        client.stub.UpdateWeights(
            iter([admin_pb2.UpdateWeightsRequest(chunk=admin_pb2.TensorChunk(name=NORM))]),
            metadata=client.metadata,
        )
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("header:")
    with pytest.raises(grpc.RpcError) as error:  # a CPU daemon: no IPC
        list(client.stub.UpdateWeightsIpc(admin_pb2.UpdateWeightsIpcRequest(),
                                          metadata=client.metadata))  # fmt: skip
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("device_uuid: this daemon serves on the CPU")
    norm = {NORM: torch.ones(64)}
    with pytest.raises(ValueError, match="ipc needs every tensor on the daemon's GPU"):
        client.push(norm, partial=True, transport="ipc")
    with pytest.raises(ValueError, match="dist needs a weight group"):
        client.push(norm, partial=True, transport="dist")
    with pytest.raises(grpc.RpcError) as error:
        list(client.stub.UpdateWeightsFromGroup(
            admin_pb2.UpdateWeightsFromGroupRequest(), metadata=client.metadata))  # fmt: skip
    assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "no weight group joined" in error.value.details()
    assert served.pushes.last is None  # nothing was pushed


def test_a_push_message_may_carry_64_mib_and_every_other_rpcs_message_4(served, client):
    header = admin_pb2.PushHeader(version="big", partial=True,
                                  tensors=tensor_table([(NORM, torch.ones(64))]))  # fmt: skip
    first = admin_pb2.UpdateWeightsRequest(header=header).SerializeToString()
    push = grpc.insecure_channel(served.address).stream_unary(UPDATE_WEIGHTS)

    def chunk(nbytes: int) -> bytes:
        data = random.randbytes(nbytes)
        return admin_pb2.UpdateWeightsRequest(
            chunk=admin_pb2.TensorChunk(name=NORM, data=data)
        ).SerializeToString()

    # The largest chunk is taken (and read: more bytes than the tensor holds), one past the
    # daemon's limit is not.
    with pytest.raises(grpc.RpcError) as error:
        push(iter([first, chunk(MAX_CHUNK_BYTES)]), metadata=client.metadata)
    assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert f"{NORM}: more bytes than its shape" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        push(iter([first, chunk(MAX_MESSAGE_BYTES + 1)]), metadata=client.metadata)
    assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(ValueError, match="chunk_bytes must be in"):
        client.push({NORM: torch.ones(64)}, partial=True, chunk_bytes=MAX_CHUNK_BYTES + 1)
    # Any other RPC: gRPC's default 4 MiB, as before pushes raised the server's limit.
    text = "".join(random.choices("abcdefgh ", k=4 * 2**20 + 1))
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(served.address))
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(inference_pb2.GenerateRequest(text=text)))
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("request: ")
    assert f"more than the {4 * 2**20}" in error.value.details()


def test_a_gloo_group_push_commits_what_the_trainer_broadcast(served, client, versions):
    group = WeightGroup.create([client], backend="gloo", name="test", timeout_s=60)
    assert client.status().weight_push.weight_group == "test"
    pushed = {n: t.to(torch.bfloat16) for n, t in version_tensors(versions["v2"]).items()}
    events = []
    result = client.push(pushed, version="dist-1", progress=events.append)
    assert (result.transport, result.outcome) == ("dist", "committed")
    assert "ready" in [e.stage for e in events]
    assert_slot_holds(served, "dist-1", pushed)
    # Small buckets: many broadcasts, and a partial push through the group object itself.
    norm = {NORM: torch.randn(64)}
    [partial] = group.push(norm, version="dist-2", partial=True, bucket_bytes=1024)
    assert partial.outcome == "committed"
    assert_slot_holds(served, "dist-2", {**pushed, **norm})


def test_a_client_gone_mid_push_leaves_no_half_version_and_the_next_push_lands(
    served, client, versions
):
    pushed = version_tensors(versions["v2"])
    table = [admin_pb2.TensorSpec(name=n, dtype="float32", shape=list(t.shape))
             for n, t in pushed.items()]  # fmt: skip
    header = admin_pb2.PushHeader(version="cut", tensors=table)
    first = next(iter(pushed))
    sent, gone = threading.Event(), threading.Event()

    def messages():
        yield admin_pb2.UpdateWeightsRequest(header=header)
        yield admin_pb2.UpdateWeightsRequest(
            chunk=admin_pb2.TensorChunk(
                name=first, data=pushed[first].view(-1)[:8].numpy().tobytes()
            )
        )
        sent.set()
        gone.wait(30)  # the client goes away before the rest

    future = client.stub.UpdateWeights.future(messages(), metadata=client.metadata)
    assert sent.wait(30)
    deadline = time.monotonic() + 30
    while served.manager.registry.find("cut") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    future.cancel()
    gone.set()
    while served.manager.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    record = served.manager.registry.get("cut")
    assert record.state is VersionState.REJECTED
    assert served.pushes.last.outcome in ("rejected", "failed")
    assert "cut" not in served.manager.versions().slots
    assert client.push(pushed, version="after").outcome == "committed"


def test_fifty_pushes_under_load_fail_no_request_and_leak_no_block_slot_or_thread(
    served, client, versions
):
    pushed = version_tensors(versions["v2"])
    WeightGroup.create([client], backend="gloo", name="fifty", timeout_s=60)
    failures, served_count, stop = [], [0], threading.Event()

    def load() -> None:
        while not stop.is_set():
            prompt = [random.randrange(3, 300) for _ in range(random.randrange(4, 40))]
            try:
                served.generate(prompt, n=random.randrange(4, 12))
                served_count[0] += 1
            except Exception as exc:  # any failed request fails the test
                failures.append(repr(exc))

    loaders = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    threads_before = threading.active_count()
    for t in loaders:
        t.start()
    outcomes = []
    for n in range(50):
        kind = n % 5
        try:
            if kind == 0:
                r = client.push(pushed, version=f"full-{n}", transport="grpc")
            elif kind == 1:
                r = client.push({NORM: torch.randn(64)}, version=f"part-{n}", partial=True)
            elif kind == 2:
                r = client.push({NORM: torch.randn(64)}, version=f"dist-{n}", partial=True,
                                transport="dist")  # fmt: skip
            elif kind == 3:
                r = client.push({NORM: torch.full((64,), float("nan"))}, version=f"nan-{n}",
                                partial=True)  # fmt: skip
            else:
                r = client.push({"model.bogus": torch.ones(2)}, version=f"bogus-{n}", partial=True)
            outcomes.append(r.outcome)
        except PushError as exc:
            outcomes.append(exc.code.name)
    stop.set()
    for t in loaders:
        t.join(60)
    assert failures == []
    assert served_count[0] > 0
    assert outcomes == ["committed"] * 3 + ["FAILED_PRECONDITION"] * 2 + outcomes[5:]
    assert outcomes == (["committed"] * 3 + ["FAILED_PRECONDITION"] * 2) * 10
    status = served.engine.status()
    assert status.num_blocks_used == 0
    assert (status.num_running, status.num_waiting) == (0, 0)
    slots = served.manager.versions().slots
    assert set(slots.values()) <= {"active", "standby"}
    assert served.manager.registry.active in slots
    pushed_kept = [v for v in served.manager.versions().versions if v.source == "push"]
    assert len(pushed_kept) <= 4 + 2  # keep_pushed, plus the active one and the rollback target
    deadline = time.monotonic() + 30
    while threading.active_count() > threads_before + 2:  # gloo's and gRPC's own, at most
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)


def test_the_client_imports_without_the_daemons_heavy_dependencies():
    code = (
        "import sys, sitsd.client\n"
        "heavy = ('fastapi', 'uvicorn', 'opentelemetry', 'prometheus_client', 'structlog',"
        " 'safetensors', 'tokenizers', 'transformers', 'sitsd.engine', 'sitsd.weights',"
        " 'sitsd.http', 'sitsd.observability')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(heavy))\n"
        "print(loaded); assert 'torch' in sys.modules and 'grpc' in sys.modules\n"
        "sys.exit(1 if loaded else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_bucket_layout_that_does_not_fit_is_rejected_before_the_standby_slot_is_touched(
    served, client, versions
):
    pushed = version_tensors(versions["v2"])
    v1 = served.manager.registry.active
    client.push(pushed, version="kept")  # v1 goes to the standby slot: the rollback target
    WeightGroup.create([client], backend="gloo", timeout_s=60)
    spec = admin_pb2.TensorSpec(name=NORM, dtype="float32", shape=[64])
    for placement, reason in (
        (admin_pb2.TensorPlacement(bucket=0, offset=3), "offsets are multiples of 16"),
        (admin_pb2.TensorPlacement(bucket=0, offset=16), "of bucket 0 (256 bytes"),
        (admin_pb2.TensorPlacement(bucket=2, offset=0), "placed in bucket 2 of none"),
    ):
        request = admin_pb2.UpdateWeightsFromGroupRequest(
            header=admin_pb2.PushHeader(version="layout", partial=True, tensors=[spec]),
            bucket_bytes=[256], placements=[placement],
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as error:
            list(client.stub.UpdateWeightsFromGroup(request, metadata=client.metadata))
        assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert reason in error.value.details()
        assert served.manager.versions().slots == {"kept": "active", v1: "standby"}


def test_a_join_that_cannot_work_gets_a_client_error_naming_why_and_serving_goes_on(served, client):
    """Fields out of range are INVALID_ARGUMENT naming the field (a fuzzed world size of 2**32-1
    or a timeout of 3e38 once reached torch as INTERNAL); a store nobody answers on is
    FAILED_PRECONDITION naming where; the daemon serves a request afterwards."""
    base = dict(master_address="127.0.0.1", master_port=29500, world_size=2, rank=1,
                backend="gloo", timeout_s=1.0)  # fmt: skip
    for change, field in (
        ({"world_size": 2**32 - 1}, "world_size"),
        ({"world_size": 1, "rank": 0}, "world_size"),
        ({"rank": 2}, "rank"),
        ({"timeout_s": 3.0e38}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"master_port": 70000}, "master_port"),
        ({"master_address": "x" * 300}, "master_address"),
        ({"master_address": "host\x00name"}, "master_address"),
        ({"backend": "mpi"}, "backend"),
    ):
        request = admin_pb2.JoinWeightGroupRequest(**{**base, **change})
        with pytest.raises(grpc.RpcError) as error:
            client.stub.JoinWeightGroup(request, metadata=client.metadata, timeout=60)
        assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT, change
        assert error.value.details().startswith(f"{field}:"), error.value.details()
    with socket.socket() as closed:  # bound, never listening: every connect is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        request = admin_pb2.JoinWeightGroupRequest(**{**base, "master_port": port})
        with pytest.raises(grpc.RpcError) as error:
            client.stub.JoinWeightGroup(request, metadata=client.metadata, timeout=120)
    assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert f"at 127.0.0.1:{port} as rank 1 of 2" in error.value.details()
    assert client.status().weight_push.weight_group == ""
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(served.address))
    request = inference_pb2.GenerateRequest(
        text="hi", sampling=inference_pb2.SamplingParams(max_tokens=3), ignore_eos=True
    )
    replies = list(stub.Generate(request, timeout=60))
    assert replies[-1].usage.completion_tokens == 3


def test_a_group_push_from_no_rank_or_a_trainer_that_never_broadcasts_ends_with_a_client_error(
    served, client, versions
):
    """A source rank outside the group is FAILED_PRECONDITION before the slot is touched (a
    uint32 of 2**32-1 once reached torch as INTERNAL); a broadcast that never comes ends the
    push ABORTED when the group's timeout passes (a last guard, not a wait); a group joined
    again then carries a push that commits."""
    active = served.manager.registry.active
    WeightGroup.create([client], backend="gloo", name="silent", timeout_s=2)
    spec = admin_pb2.TensorSpec(name=NORM, dtype="float32", shape=[64])
    header = admin_pb2.PushHeader(partial=True, tensors=[spec])
    for src_rank in (1, 2, 2**32 - 1):  # the daemon itself, past the group, past a C int
        header.version = f"from-{src_rank}"
        request = admin_pb2.UpdateWeightsFromGroupRequest(
            header=header, bucket_bytes=[256], src_rank=src_rank,
            placements=[admin_pb2.TensorPlacement(bucket=0, offset=0)],
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as error:
            list(client.stub.UpdateWeightsFromGroup(request, metadata=client.metadata))
        assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert f"src_rank {src_rank} is not another rank of the weight group" in (
            error.value.details()
        )
    header.version = "never-sent"
    request = admin_pb2.UpdateWeightsFromGroupRequest(
        header=header, bucket_bytes=[256],
        placements=[admin_pb2.TensorPlacement(bucket=0, offset=0)],
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as error:
        list(client.stub.UpdateWeightsFromGroup(request, metadata=client.metadata, timeout=120))
    assert error.value.code() is grpc.StatusCode.ABORTED
    assert "the weight group's broadcast failed" in error.value.details()
    assert served.manager.registry.active == active
    assert "never-sent" not in served.manager.versions().slots
    assert served.pushes.last.outcome == "failed"
    group = WeightGroup.create([client], backend="gloo", name="again", timeout_s=60)
    norm = {NORM: torch.randn(64)}
    [result] = group.push(norm, version="after-silence", partial=True)
    assert result.outcome == "committed"
    assert_slot_holds(served, "after-silence", norm)
