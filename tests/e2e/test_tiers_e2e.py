"""SLA tiers on the real daemon: refusal at once, tier status, and `sitsctl bench` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from sitsd.api.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from sitsd.api.v1 import inference_pb2 as pb
from tests.e2e.daemon_process import DaemonProcess, serving, tiers_file
from tests.e2e.test_daemon import wait_for

pytestmark = pytest.mark.slow

# One batch slot; bronze may wait 300 ms at most, the others are patient.
TIERS = """
tiers:
  gold: {max_queue_wait_ms: 600000, ttft_p99_ms: 5000, itl_p99_ms: 2000}
  silver: {max_queue_wait_ms: 600000}
  bronze: {max_queue_wait_ms: 300}
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    tiers = tiers_file(tmp_path_factory.mktemp("tiers"), TIERS)
    flags = ("--tiers", tiers, "--max-num-seqs", "1", "--kv-cache-memory", "128MiB")
    with serving(tmp_path_factory.mktemp("state"), *flags) as process:
        yield process


def tiers_of(daemon: DaemonProcess, channel: grpc.Channel) -> dict[str, admin_pb2.TierStatus]:
    metadata = [("authorization", f"Bearer {daemon.admin_token()}")]
    status = admin_pb2_grpc.AdminStub(channel).Status(
        admin_pb2.StatusRequest(), metadata=metadata, timeout=10
    )
    assert status.scheduling_policy == "tiers"
    return {t.tier: t for t in status.tiers}


def test_bronze_behind_a_long_gold_request_is_refused_at_once(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        hog = inference.Generate(
            pb.GenerateRequest(
                text="Once upon a time",
                ignore_eos=True,
                tier=pb.TIER_GOLD,
                sampling=pb.SamplingParams(max_tokens=400, temperature=0),
            ),
            timeout=300,
        )
        try:
            for _ in range(3):
                next(hog)  # running, and a few steps timed
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(
                    inference.Generate(
                        pb.GenerateRequest(text="Hi", tier=pb.TIER_BRONZE), timeout=60
                    )
                )
            elapsed = time.monotonic() - started
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "bronze tier's 300 ms" in info.value.details()
            # Refused, not shed: the answer comes before bronze's 300 ms queue limit could
            # even have passed (generously bounded: the machine may be busy).
            assert elapsed < 5.0
            # The API thread counted it; the status shows it from the engine's next turn.
            wait_for(lambda: tiers_of(daemon, channel)["bronze"].num_refused == 1)
            tiers = tiers_of(daemon, channel)
            assert tiers["gold"].num_running == 1
            assert tiers["bronze"].max_queue_wait_s == pytest.approx(0.3)
        finally:
            hog.cancel()
        wait_for(lambda: tiers_of(daemon, channel)["gold"].num_running == 0)


def test_sitsctl_bench_against_the_daemon_reports_every_request(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        wait_for(
            lambda: (
                sum(t.num_running + t.num_waiting for t in tiers_of(daemon, channel).values()) == 0
            )
        )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sitsd.ctl",
            "--address",
            daemon.address,
            "bench",
            "--concurrency",
            "1",
            "--num-requests",
            "4",
            "--prompt-tokens",
            "8:24",
            "--max-tokens",
            "2:6",
            "--tier-mix",
            "gold=1,bronze=1",
            "--json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=daemon.env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["total"]["sent"] == report["total"]["completed"] == 4
    assert report["settings"]["targets_from"] == "daemon"
    assert report["targets_ms"]["gold"] == [5000.0, 2000.0]
    assert report["total"]["ttft_ms"]["p50"] > 0
