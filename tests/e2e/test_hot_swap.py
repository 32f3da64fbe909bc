"""Hot-swap on the real daemon (the tiny Llama): the watched directory under load, bad drops,
the admin token, rollback, and a restart after SIGKILL.

Exact-output checks run one request alone on a daemon without prefix caching, so the same
version computes the same thing bitwise; the under-load output checks against fresh daemons
are in `test_hot_swap_load.py` (SmolLM2: the tiny random model has float32 near-ties).
"""

from __future__ import annotations

import random
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sitsd.api.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.weights.manifest import write_manifest
from tests.e2e.daemon_process import DaemonProcess
from tests.e2e.load import StreamLoad
from tests.observability.tools import wait_for
from tests.weights.tiny_versions import BAD_DROPS, write_bad_version, write_version

pytestmark = pytest.mark.slow

MODEL = "tiny"
REJECTED = admin_pb2.VERSION_STATE_REJECTED
CANARY = 'Hello, world! How are you today?\n{"prompt": "The quick brown fox"}\n'
METRICS_LINE = re.compile(r"metrics on http://(\S+):(\d+)/metrics")


@pytest.fixture(scope="module")
def drops(tmp_path_factory) -> Path:
    """Versions written outside the watched directory, to be renamed (or copied) into it."""
    root = tmp_path_factory.mktemp("drops")
    write_version(root / "v1")
    write_version(root / "v2", noise_seed=1)
    write_version(root / "v3", noise_seed=2)
    write_version(root / "far", seed=9)  # fails the canary
    return root


def tiny_daemon(state_dir: Path, model: Path, *flags: str) -> DaemonProcess:
    process = DaemonProcess(
        state_dir,
        "--model",
        str(model),
        "--served-model-name",
        MODEL,
        "--scheduling-policy",
        "fcfs",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory",
        "16MiB",
        *flags,
    )
    process.wait_until_serving()
    return process


@pytest.fixture(scope="module")
def watched(tmp_path_factory, drops) -> Iterator[DaemonProcess]:
    """A daemon watching a directory, with a canary gate."""
    work = tmp_path_factory.mktemp("watched")
    canary = work / "canary.txt"
    canary.write_text(CANARY)
    (work / "watch" / MODEL).mkdir(parents=True)
    process = tiny_daemon(
        work / "state",
        drops / "v1",
        "--watch-dir",
        str(work / "watch"),
        "--canary-file",
        str(canary),
        "--canary-max-kl",
        "0.01",
        "--log-level",
        "debug",
    )
    process.watch_dir = work / "watch" / MODEL
    try:
        yield process
    finally:
        assert process.terminate() == 0, process.log


def admin(daemon: DaemonProcess, token: str | None = None):
    channel = grpc.insecure_channel(daemon.address)
    metadata = [("authorization", f"Bearer {token or daemon.admin_token()}")]
    return admin_pb2_grpc.AdminStub(channel), metadata


def versions_of(daemon: DaemonProcess) -> admin_pb2.ListVersionsResponse:
    stub, metadata = admin(daemon)
    return stub.ListVersions(admin_pb2.ListVersionsRequest(), metadata=metadata, timeout=10)


def version(daemon: DaemonProcess, name: str) -> admin_pb2.WeightVersion | None:
    return next((v for v in versions_of(daemon).versions if v.version == name), None)


def prompts(n: int = 12) -> list[list[int]]:
    return [[random.randrange(1, 300) for _ in range(random.randrange(4, 40))] for _ in range(n)]


def greedy(daemon: DaemonProcess, prompt: list[int], n: int = 12) -> tuple[list[int], set[str]]:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            ignore_eos=True,
            sampling=pb.SamplingParams(max_tokens=n, temperature=0),
        )
        tokens, seen = [], set()
        for response in stub.Generate(request, timeout=60):
            tokens += response.token_ids
            seen.add(response.weights_version)
        return tokens, seen


def metric(daemon: DaemonProcess, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when it is not there yet)."""
    port = METRICS_LINE.search(daemon.log).group(2)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_weight_rpcs_without_the_admin_token_are_unauthenticated_and_change_nothing(watched, drops):
    before = versions_of(watched)
    stub, _ = admin(watched)
    calls = [
        lambda md: list(stub.Deploy(admin_pb2.DeployRequest(path=str(drops / "v2")), metadata=md)),
        lambda md: list(
            stub.Swap(admin_pb2.SwapRequest(version=before.active_version), metadata=md)
        ),
        lambda md: list(stub.Rollback(admin_pb2.RollbackRequest(), metadata=md)),
        lambda md: stub.ListVersions(admin_pb2.ListVersionsRequest(), metadata=md),
    ]
    for call in calls:
        for metadata in ([], [("authorization", "Bearer wrong-token")]):
            with pytest.raises(grpc.RpcError) as info:
                call(metadata)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    after = versions_of(watched)
    assert [v.version for v in after.versions] == [v.version for v in before.versions]
    assert after.active_version == before.active_version


def test_bad_drops_are_rejected_with_their_reason_under_load_then_a_good_one_commits(
    watched, drops, tmp_path
):
    active = versions_of(watched).active_version
    load = StreamLoad(watched.address, prompts(), num_clients=4).start()
    try:
        wait_for(lambda: load.in_flight(min_tokens=2), 120, "streaming requests")
        reasons = dict(BAD_DROPS)
        for kind in BAD_DROPS:  # written aside, renamed into place: a version appears whole
            staged = write_bad_version(kind, tmp_path / kind, tmp_path / "outside")
            staged.rename(watched.watch_dir / kind)
        shutil.copytree(drops / "far", watched.watch_dir / "far")
        reasons["far"] = "canary: mean KL"
        shutil.copytree(drops / "v2", watched.watch_dir.parent / "other-model" / "v9")
        reasons["v9"] = "is not the served model 'tiny'"
        for name, reason in reasons.items():
            # The watcher takes the drops one at a time (the canary's among them), so the first
            # wait may cover all of them on a busy machine: a generous last guard.
            record = wait_for(
                lambda name=name: (v := version(watched, name)) and v.state == REJECTED and v,
                300,
                f"{name} rejected",
            )
            assert reason in record.reason, (name, record.reason)
        assert versions_of(watched).active_version == active
        shutil.copytree(drops / "v2", watched.watch_dir / "v2")
        wait_for(lambda: versions_of(watched).active_version == "v2", 300, "v2 committed")
        after = len(load.records)
        wait_for(lambda: any(r.ok for r in load.records[after:]), 120, "a request on v2")
    finally:
        records = load.stop()
    assert all(r.ok for r in records), [r.status for r in records if not r.ok]
    assert {v for r in records[after:] for v in r.versions} == {"v2"}
    assert metric(watched, "sitsd_weight_versions_total", event="rejected") == len(reasons)
    assert metric(watched, "sitsd_weight_versions_total", event="committed") == 1
    # The watcher's own check refuses a pickle, a symlink out and another model's directory;
    # staging refuses the rest (checksums, loading, validation, canary), each a rejected swap.
    in_staging = len(reasons) - len({"pickle", "symlink", "v9"})
    assert metric(watched, "sitsd_swaps_total", outcome="rejected") == in_staging


def test_a_version_copied_file_by_file_is_taken_only_once_its_last_byte_is_there(watched, drops):
    target = watched.watch_dir / "v3"
    target.mkdir()
    shutil.copy(drops / "v3" / "manifest.json", target)  # the manifest first
    for f in (drops / "v3").iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, target)
    data = (drops / "v3" / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2])  # still being copied
    wait_for(
        lambda: re.search(r"version v3 is not complete yet: model.safetensors has", watched.log),
        120,
        "the watcher to see v3 incomplete",
    )
    assert version(watched, "v3") is None  # neither detected nor rejected
    for f in (drops / "v3").iterdir():
        shutil.copy(f, target)  # the rest, and the whole weights file
    wait_for(lambda: versions_of(watched).active_version == "v3", 300, "v3 committed")
    assert greedy(watched, prompts(1)[0])[1] == {"v3"}


def sitsctl(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "sitsd.ctl", "--address", daemon.address, *args],
        capture_output=True,
        text=True,
        env=daemon.env,
        timeout=120,
    )
    return result


def test_rollback_restores_old_outputs_and_a_sigkilled_daemon_restarts_on_the_committed_one(
    drops, tmp_path
):
    state = tmp_path / "state"
    daemon = tiny_daemon(state, drops / "v1", "--no-prefix-caching")
    some = prompts(3)  # three: v2 may greedily agree with v1 on one short run
    try:
        old = [greedy(daemon, p)[0] for p in some]
        deployed = sitsctl(daemon, "deploy", str(drops / "v2"), "--no-progress")
        assert deployed.returncode == 0, deployed.stderr
        assert "staged v2" in deployed.stdout
        swapped = sitsctl(daemon, "swap", "v2", "--policy", "restart", "--no-progress")
        assert swapped.returncode == 0, swapped.stderr
        assert swapped.stdout.startswith("committed v2 (restart)")
        runs = [greedy(daemon, p) for p in some]
        assert {v for _, seen in runs for v in seen} == {"v2"}
        assert [tokens for tokens, _ in runs] != old
        rolled = sitsctl(daemon, "rollback", "--no-progress")
        assert rolled.returncode == 0, rolled.stderr
        assert [greedy(daemon, p)[0] for p in some] == old
        assert sitsctl(daemon, "swap", "v2", "--no-progress").returncode == 0
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(30)
    finally:
        daemon.terminate()
    daemon = tiny_daemon(state, drops / "v1", "--no-prefix-caching")
    try:
        listed = versions_of(daemon)
        assert listed.active_version == "v2"
        assert listed.previous_version == "v1"  # the start-up version directory, persisted
        assert [greedy(daemon, p) for p in some] == runs
        assert "restoring weights version v2" in daemon.log
        rolled = sitsctl(daemon, "rollback", "--no-progress")
        assert rolled.returncode == 0, rolled.stderr
        assert [greedy(daemon, p)[0] for p in some] == old
        table = sitsctl(daemon, "versions")
        # VERSION STATE SLOT PRECISION WEIGHTS SOURCE ...: v2 retired, in the standby slot.
        v2 = r"^v2\s+retired\s+standby\s+fp32;.*\sMiB\s+restored\s"
        assert re.search(v2, table.stdout, re.M), table.stdout
    finally:
        assert daemon.terminate() == 0, daemon.log


def test_sitsctl_reports_a_refused_swap_and_an_unknown_version_as_errors(drops, tmp_path):
    daemon = tiny_daemon(tmp_path / "state", drops / "v1", "--weight-slots", "1")
    try:
        assert versions_of(daemon).num_weight_slots == 1
        assert "weight slots: 1" in daemon.log
        missing = sitsctl(daemon, "swap", "nope", "--no-progress")
        assert missing.returncode == 1
        assert "NOT_FOUND" in missing.stderr
        assert sitsctl(daemon, "deploy", str(drops / "v2"), "--no-progress").returncode == 0
        drain = sitsctl(daemon, "swap", "v2", "--policy", "drain", "--no-progress")
        assert drain.returncode == 1
        assert "FAILED_PRECONDITION: drain needs two weight slots" in drain.stderr
        done = sitsctl(daemon, "swap", "v2", "--no-progress")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("committed v2 (restart)")
        nothing = sitsctl(daemon, "--token-file", str(tmp_path / "absent"), "rollback")
        assert nothing.returncode == 1
        assert "admin token" in nothing.stderr
    finally:
        assert daemon.terminate() == 0, daemon.log


def test_sitsctl_manifest_writes_what_the_daemon_verifies(drops, tmp_path):
    target = shutil.copytree(drops / "v2", tmp_path / "v2")
    (target / "manifest.json").unlink()
    result = subprocess.run(
        [sys.executable, "-m", "sitsd.ctl", "manifest", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {target}/manifest.json")
    assert (target / "manifest.json").read_text() != ""
    assert write_manifest(target).digest  # and it reads back
