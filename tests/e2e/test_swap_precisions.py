"""A swap across precisions under load on the real daemon with SmolLM2 (CPU): its 16-bit version
(the embedded model dequantized, written in bfloat16) and its INT4 version (the embedded Q4_1
GGUF as shipped, in a version directory) swap both ways under a steady load of streaming
requests (the 16-bit one with 2% noise, a stand-in for the 16-bit model the Q4_1 file was
made from, which is not available offline). No request fails; every token after a commit is
what a daemon started fresh on the new precision generates from the same prefix;
`Admin.Status` and `sitsctl versions` show each version's precision and weight bytes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from sitsd.api.v1 import admin_pb2, admin_pb2_grpc
from sitsd.weights.export import perturbed, write_version
from sitsd.weights.manifest import write_manifest
from tests.e2e.daemon_process import DaemonProcess, process_env
from tests.e2e.load import Record, StreamLoad
from tests.e2e.test_hot_swap_load import FLAGS, UNPACED_STAGING, generate_all
from tests.e2e.test_hot_swap_load import prompts as prompts  # a fixture
from tests.observability.tools import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # three daemons, two swaps


@pytest.fixture(scope="module")
def versions(smollm2, smollm2_path, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("smollm2-precisions")
    # The only SmolLM2 offline is the Q4_1 file: its dequantized weights with 2% noise (a
    # stand-in for the 16-bit model it came from) so that the two versions' tokens differ.
    noisy = perturbed(smollm2.tensors, 0.02, seed=7)
    dense = {n: t.to(torch.bfloat16) if t.dim() == 2 else t for n, t in noisy.items()}
    write_version(smollm2, root / "bf16", dense)
    (root / "int4").mkdir()
    shutil.copy(smollm2_path, root / "int4" / smollm2_path.name)
    write_manifest(root / "int4")
    return root


@pytest.fixture(scope="module")
def fresh(versions, tmp_path_factory) -> Iterator[dict[str, DaemonProcess]]:
    """A daemon started fresh on each version (the `prompts` fixture reads "v1")."""
    daemons = {
        name: DaemonProcess(
            tmp_path_factory.mktemp(f"fresh-{v}"), "--model", str(versions / v), *FLAGS
        )
        for name, v in (("v1", "bf16"), ("int4", "int4"))
    }
    try:
        for daemon in daemons.values():
            daemon.wait_until_serving()
        yield daemons
    finally:
        for daemon in daemons.values():
            assert daemon.terminate() == 0, daemon.log


def segments(record: Record) -> list[tuple[str, list[int]]]:
    """A request's tokens cut where the version that computed them changes."""
    out: list[tuple[str, list[int]]] = []
    for token, version in record.tokens:
        if not out or out[-1][0] != version:
            out.append((version, []))
        out[-1][1].append(token)
    return out


def test_the_16_bit_and_int4_versions_swap_both_ways_under_load_with_no_failed_request(
    fresh, versions, prompts, tmp_path
):
    daemon = DaemonProcess(tmp_path, "--model", str(versions / "bf16"), *FLAGS, *UNPACED_STAGING)
    stub_of = admin_pb2_grpc.AdminStub
    try:
        daemon.wait_until_serving()
        stub = stub_of(grpc.insecure_channel(daemon.address))
        meta = [("authorization", f"Bearer {daemon.admin_token()}")]
        list(stub.Deploy(admin_pb2.DeployRequest(path=str(versions / "int4")), metadata=meta,
                         timeout=300))  # fmt: skip
        load = StreamLoad(daemon.address, prompts, num_clients=4, max_tokens=(6, 14)).start()
        commits = []
        try:
            for target in ("int4", "bf16"):
                wait_for(lambda: len(load.in_flight(min_tokens=2)) >= 2, 180, "streaming")
                swap = admin_pb2.SwapRequest(version=target, policy=admin_pb2.SWAP_POLICY_MIGRATE)
                commits.append(list(stub.Swap(swap, metadata=meta, timeout=300))[-1])
                at = time.monotonic()
                try:
                    wait_for(lambda at=at: sum(r.ok and r.started > at for r in load.records) >= 2,
                             300, f"requests after the commit to {target}")  # fmt: skip
                except AssertionError as exc:  # say what the load and the daemon were doing
                    seen = [(r.ok, r.status, round(r.started - at, 1), len(r.token_ids))
                            for r in load.records]  # fmt: skip
                    raise AssertionError(
                        f"{exc}; (ok, status, started after the commit [s], "
                        f"tokens): {seen}\n{daemon.log[-6000:]}"
                    ) from None
        finally:
            records = load.stop()
        status = stub.Status(admin_pb2.StatusRequest(), metadata=meta, timeout=30)
        listed = subprocess.run(
            [sys.executable, "-m", "sitsd.ctl", "--address", daemon.address, "versions"],
            env=process_env(tmp_path), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        versions_seen = stub.ListVersions(admin_pb2.ListVersionsRequest(), metadata=meta,
                                          timeout=30).versions  # fmt: skip
    finally:
        assert daemon.terminate() == 0, daemon.log
    assert [c.stage for c in commits] == ["committed", "committed"]
    assert all(r.ok for r in records), [r.status for r in records if not r.ok]
    # Every segment against a fresh daemon on the version that computed it, from its prefix.
    queries: dict[str, list[tuple[list[int], int]]] = {"bf16": [], "int4": []}
    got: dict[str, list[list[int]]] = {"bf16": [], "int4": []}
    for record in records:
        prefix = list(record.prompt)
        for version, tokens in segments(record):
            queries[version].append((prefix, len(tokens)))
            got[version].append(tokens)
            prefix = prefix + tokens
    assert got["int4"], "no token was computed by the INT4 version"
    assert sum(len(segments(r)) > 1 for r in records) >= 1, "no request spanned a commit"
    assert generate_all(fresh["v1"], queries["bf16"]) == got["bf16"]
    # The INT4 layers compute in bfloat16 on the CPU, and torch's int4 kernel rounds differently
    # at another batch size, so a near-tie may flip a greedy token (seen in loaded runs: 1
    # segment of ~20 at its 5th token; once, 1 at its first; once 2 of 9, the load leaving fewer
    # segments). KV left from the 16-bit version would diverge at once in most segments: nearly
    # every segment starts as the fresh daemon's does, and most match whole (all but two, or a
    # fifth where there are more than ten: a count of flips, not a share of however many
    # segments the machine's speed left).
    want = generate_all(fresh["int4"], queries["int4"])
    first_differs = [i for i, (w, g) in enumerate(zip(want, got["int4"])) if w[:1] != g[:1]]
    assert len(first_differs) <= max(1, len(want) // 10), (first_differs, want, got["int4"])
    differ = sum(w != g for w, g in zip(want, got["int4"]))
    assert differ <= max(2, len(want) // 5), (want, got["int4"])
    assert generate_all(fresh["v1"], queries["int4"]) != got["int4"]  # the check tells apart
    # Precision and weight bytes: the active one in Status, each one in ListVersions.
    by_name = {v.version: v for v in versions_seen}
    assert status.weights_version == "bf16"
    assert status.weights_precision == by_name["bf16"].precision
    assert by_name["bf16"].precision.startswith("fp32")  # the CPU serves 16-bit in float32
    assert by_name["int4"].precision.startswith("int4-g32")  # Q4_1: 32 weights per scale
    assert by_name["int4"].weight_bytes * 3 < by_name["bf16"].weight_bytes == status.weight_bytes
    assert listed.returncode == 0, listed.stderr
    assert "int4-g32" in listed.stdout
    assert f"{by_name['int4'].weight_bytes / 2**20:.1f} MiB" in listed.stdout
