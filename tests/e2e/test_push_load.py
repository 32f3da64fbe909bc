"""Live pushes into the real daemon (SmolLM2 on the CPU) under a steady load of concurrent
streams, from this process as the trainer: over gRPC, and over a gloo weight group. The pushed
weights are SmolLM2's with seeded relative noise; a daemon started fresh on them (from a version
directory) is the reference for every token. Zero requests may fail; each request's tokens are
v1's up to the commit and the pushed version's after it, never back (the per-token versions
switch exactly once), and those after it equal the fresh daemon's from the same prefix; a
request that began after the commit is wholly the pushed version's. Bad pushes are rejected by
name while the load goes on.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from sitsd.api.v1 import admin_pb2, inference_pb2_grpc
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.client import PushError, WeightGroup, WeightsClient
from sitsd.weights.export import perturbed, write_version
from tests.e2e.daemon_process import DaemonProcess
from tests.e2e.load import Record, StreamLoad
from tests.e2e.test_hot_swap_load import FLAGS, QUESTIONS, generate_all
from tests.http.requests import request
from tests.observability.tools import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a busy 2-core machine

NOISE_SEED = random.randrange(2**20)  # the trainer's "update": fresh each run
GATE = "model.layers.3.mlp.gate_proj.weight"


@pytest.fixture(scope="module")
def pushed_tensors(smollm2) -> dict[str, torch.Tensor]:
    return perturbed(smollm2.tensors, 0.02, seed=NOISE_SEED)


@pytest.fixture(scope="module")
def v1_dir(smollm2, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("push-v1") / "v1"
    write_version(smollm2, directory)
    return directory


@pytest.fixture(scope="module")
def fresh(smollm2, pushed_tensors, tmp_path_factory) -> Iterator[DaemonProcess]:
    """A daemon started on the pushed weights, from files: the reference."""
    directory = tmp_path_factory.mktemp("push-ref") / "pushed"
    write_version(smollm2, directory, pushed_tensors)
    daemon = DaemonProcess(tmp_path_factory.mktemp("fresh"), "--model", str(directory), *FLAGS)
    try:
        daemon.wait_until_serving()
        yield daemon
    finally:
        assert daemon.terminate() == 0, daemon.log


@pytest.fixture(scope="module")
def daemon(v1_dir, tmp_path_factory) -> Iterator[DaemonProcess]:
    process = DaemonProcess(tmp_path_factory.mktemp("pushed-into"), "--model", str(v1_dir), *FLAGS)
    try:
        process.wait_until_serving()
        yield process
    finally:
        assert process.terminate() == 0, process.log


@pytest.fixture(scope="module")
def prompts(daemon) -> list[list[int]]:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        chats = [
            pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=q)]) for q in QUESTIONS
        ]
        return [list(stub.Tokenize(pb.TokenizeRequest(chat=c)).token_ids) for c in chats]


@pytest.fixture(scope="module")
def client(daemon) -> Iterator[WeightsClient]:
    c = WeightsClient(daemon.address, token=daemon.admin_token())
    yield c
    c.close()


def push_under_load(
    daemon: DaemonProcess, prompts, push, max_tokens: tuple[int, int] = (10, 20)
) -> tuple[list[Record], float]:
    """Streams going, `push()` mid-load, streams after the commit; (records, commit time).
    `max_tokens`: long enough that requests are still streaming when the push commits."""
    load = StreamLoad(daemon.address, prompts, num_clients=4, max_tokens=max_tokens).start()
    try:
        wait_for(lambda: len(load.in_flight(min_tokens=3)) >= 3, 300, "requests streaming")
        push()
        committed_at = time.monotonic()
        try:
            wait_for(lambda: sum(r.ok and r.started > committed_at for r in load.records) >= 2,
                     600, "requests after the commit")  # fmt: skip
        except AssertionError as exc:  # say what the load and the daemon were doing
            seen = [(r.ok, r.status, round(r.started - committed_at, 1), len(r.tokens))
                    for r in load.records]  # fmt: skip
            raise AssertionError(f"{exc}; (ok, status, start [s], tokens): {seen}\n"
                                 f"{daemon.log[-6000:]}") from None  # fmt: skip
    finally:
        records = load.stop(timeout=600)
    return records, committed_at


def split_at_commit(record: Record, old: str, new: str) -> tuple[list[int], list[int]]:
    """(tokens computed by `old`, by `new`): the versions switch once, never back."""
    versions = record.versions
    cut = versions.index(new) if new in versions else len(versions)
    assert set(versions[:cut]) <= {old}, versions
    assert set(versions[cut:]) <= {new}, versions
    return record.token_ids[:cut], record.token_ids[cut:]


def check_tokens(
    records: list[Record], fresh: DaemonProcess, old: str, new: str, first: int | None = None
) -> None:
    """Every request ok, the versions switching once, and each continuation on `new` (of a
    request spanning the commit, or started after it) what `fresh` makes of the same prefix:
    all of it, or its `first` tokens."""
    assert all(r.ok for r in records), [r.status for r in records if not r.ok]
    splits = [(r, *split_at_commit(r, old, new)) for r in records]
    spanning = [(r, b, a[:first]) for r, b, a in splits if b and a]
    after = [r for r, b, _ in splits if not b]
    assert spanning, "no request was in flight across the commit"
    assert after, "no request started after the commit"
    got = [a for _, _, a in spanning] + [r.token_ids[:first] for r in after]
    queries = [(r.prompt + b, len(a)) for r, b, a in spanning] + [
        (r.prompt, len(g)) for r, g in zip(after, got[len(spanning) :], strict=True)
    ]
    want = generate_all(fresh, queries)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        where = next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), None)
        assert g == w, f"continuation {i} of {len(got)} differs from token {where} on"


def test_a_grpc_push_under_load_fails_nothing_and_every_token_is_its_versions(
    daemon, fresh, prompts, client, pushed_tensors
):
    results = []

    def push() -> None:
        results.append(client.push(pushed_tensors, version="step-100", transport="grpc",
                                   policy="migrate", origin=f"seed {NOISE_SEED}"))  # fmt: skip

    records, _ = push_under_load(daemon, prompts, push)
    check_tokens(records, fresh, "v1", "step-100")
    [result] = results
    assert (result.transport, result.outcome, result.policy) == ("grpc", "committed", "migrate")
    assert result.num_bytes == sum(t.numel() * t.element_size() for t in pushed_tensors.values())
    last = client.status().weight_push.last_update
    assert (last.version, last.outcome) == ("step-100", "committed")
    assert min(last.receive_s, last.validate_s, last.commit_s) > 0
    # The OpenAI API tells the same version, token by token.
    completion = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    status, _, body = request(daemon.http_url.removesuffix("/v1"), "/v1/completions", completion)
    assert status == 200
    assert json.loads(body)["choices"][0]["weights_versions"] == [
        {"version": "step-100", "num_tokens": 5}
    ]


def test_a_gloo_group_push_under_load_fails_nothing_and_every_token_is_its_versions(
    daemon, fresh, prompts, client, pushed_tensors
):
    if client.status().weights_version != "v1":
        list(client.stub.Rollback(admin_pb2.RollbackRequest(), metadata=client.metadata))
    assert client.status().weights_version == "v1"
    group = WeightGroup.create([client], backend="gloo", timeout_s=300)
    results = []

    def push() -> None:
        results.extend(group.push(pushed_tensors, version="step-200", bucket_bytes=32 * 2**20))

    records, _ = push_under_load(daemon, prompts, push)
    check_tokens(records, fresh, "v1", "step-200")
    assert [(r.transport, r.outcome) for r in results] == [("dist", "committed")]


def test_bad_pushes_are_rejected_by_name_while_serving_goes_on(daemon, prompts, client, smollm2):
    before = client.status().weights_version
    gate = smollm2.tensors[GATE]
    nan = gate.clone()
    nan.view(-1)[random.randrange(nan.numel())] = float("nan")
    bad = {
        "unknown": ({"model.layers.99.mlp.up_proj.weight": gate}, "model.layers.99.mlp.up_proj"),
        "shape": ({GATE: gate.T.contiguous()}, f"{GATE} has shape"),
        "dtype": ({GATE: gate.to(torch.int32)}, f"{GATE} has dtype int32"),
        "nan": ({GATE: nan}, f"{GATE} holds NaN or Inf"),
        "missing": ({GATE: gate}, "tensors missing"),  # not partial: every tensor is needed
    }
    load = StreamLoad(daemon.address, prompts, num_clients=4, max_tokens=(8, 16)).start()
    try:
        wait_for(lambda: len(load.in_flight(min_tokens=2)) >= 2, 120, "requests streaming")
        for kind, (tensors, reason) in bad.items():
            with pytest.raises(PushError) as error:
                client.push(tensors, version=f"bad-{kind}", partial=kind != "missing")
            assert error.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert reason in error.value.details
    finally:
        records = load.stop()
    assert all(r.ok for r in records), [r.status for r in records if not r.ok]
    assert set(v for r in records for v in r.versions) == {before}
    listed = client.stub.ListVersions(admin_pb2.ListVersionsRequest(), metadata=client.metadata)
    rejected = {
        v.version: v.reason for v in listed.versions if v.state == admin_pb2.VERSION_STATE_REJECTED
    }
    for kind, (_, reason) in bad.items():
        assert reason in rejected[f"bad-{kind}"]
