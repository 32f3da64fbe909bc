"""Traces of the requests that do not finish well, from the real daemon over real OTLP: a
request refused at admission, one shed from the queue and one preempted for a gold request
each keep their queue span, tier, ids and what happened (`sitsd.finish_reason`).

The scenario, on three batch slots and 32-token steps (so a long prompt's prefill takes the
whole budget of many steps); gold and silver may wait as long as they need, bronze 1 ms, so
what happens does not depend on how fast the machine is:

    W  silver, long decode          running
    X  silver, 320-token prompt     running: its prefill takes every step's budget
    Y  bronze                       admitted to the free slot (nothing ahead, so no expected
                                    wait), finds no budget in the next step: shed
    Z  silver, long decode          running once X decodes: the batch is full
    R  bronze                       the batch is full for thousands of steps: refused
    G  gold                         preempts the newest silver request (Z), runs, finishes
    then Z is recomputed, and W, X, Z are cancelled.

With `SITSD_TEST_TRACE_OUT=<file>` the test writes the three traces there, trimmed, as JSON.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from sitsd.api.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.testing.otlp_receiver import OtlpReceiver, attributes
from tests.e2e.daemon_process import DaemonProcess, serving, tiers_file
from tests.observability.tools import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a loaded 2-core machine is slow

TIERS = """
tiers:
  gold: {max_queue_wait_ms: 600000}
  silver: {max_queue_wait_ms: 600000}
  bronze: {max_queue_wait_ms: 1}
"""
RUN_ID = os.urandom(3).hex()  # request ids of this run


def rid(name: str) -> str:
    return f"{name}-{RUN_ID}"


class Stream:
    """A streaming Generate call on its own thread: its responses, and how it ended."""

    def __init__(self, stub, request: pb.GenerateRequest) -> None:
        self.responses: list[pb.GenerateResponse] = []
        self.code: grpc.StatusCode | None = None
        self.call = stub.Generate(request, timeout=600)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.append(response)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code = exc.code()

    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in list(self.responses))

    def cancel(self) -> None:
        self.call.cancel()
        self._thread.join(60)


def request(name: str, tier: int, max_tokens: int, prompt: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid(name),
        token_ids=pb.TokenIds(ids=prompt),
        tier=tier,
        ignore_eos=True,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0),
    )


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.stop()


@dataclass
class Scenario:
    daemon: DaemonProcess
    receiver: OtlpReceiver
    ended: dict[str, object]  # request name -> its gRPC status, or gold's finish reason


@pytest.fixture(scope="module")
def traced(tmp_path_factory, receiver) -> Iterator[Scenario]:
    """Runs the scenario of the module docstring on a daemon exporting to `receiver`."""
    tiers = tiers_file(tmp_path_factory.mktemp("tiers"), TIERS)
    flags = ("--tiers", tiers, "--max-num-seqs", "3", "--max-num-batched-tokens", "32",
             "--kv-cache-memory", "512MiB", "--otlp-endpoint", receiver.endpoint)  # fmt: skip
    with serving(tmp_path_factory.mktemp("state"), *flags) as daemon:
        with grpc.insecure_channel(daemon.address) as channel:
            ended = run_scenario(daemon, channel)
        yield Scenario(daemon, receiver, ended)


def run_scenario(daemon: DaemonProcess, channel: grpc.Channel) -> dict[str, object]:
    stub = inference_pb2_grpc.InferenceStub(channel)
    admin = admin_pb2_grpc.AdminStub(channel)
    token = [("authorization", f"Bearer {daemon.admin_token()}")]

    def num_running() -> int:
        return admin.Status(admin_pb2.StatusRequest(), metadata=token, timeout=30).num_running

    (card,) = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
    long = card.max_model_len - 16  # decodes that outlast the test: cancelled at its end
    short_prompt = [42, 43, 44, 45]
    ended: dict[str, object] = {}
    w = Stream(stub, request("w", pb.TIER_SILVER, long, short_prompt))
    wait_for(lambda: w.tokens() > 0, 600, "W streaming")
    x = Stream(stub, request("x", pb.TIER_SILVER, 16, list(range(100, 420))))
    wait_for(lambda: num_running() == 2, 600, "X admitted")
    with pytest.raises(grpc.RpcError) as shed:  # X's prefill holds every step's budget
        list(stub.Generate(request("y", pb.TIER_BRONZE, 4, short_prompt), timeout=600))
    ended["y"] = shed.value.code()
    z = Stream(stub, request("z", pb.TIER_SILVER, long, [50, 51, 52, 53, 54]))
    wait_for(lambda: z.tokens() > 0, 600, "Z streaming (X's prefill done)")
    with pytest.raises(grpc.RpcError) as refused:  # three slots busy for thousands of steps
        list(stub.Generate(request("r", pb.TIER_BRONZE, 4, short_prompt), timeout=600))
    ended["r"] = refused.value.code()
    before = z.tokens()
    gold = list(stub.Generate(request("g", pb.TIER_GOLD, 4, [60, 61, 62]), timeout=600))
    ended["g"] = gold[-1].finish_reason
    wait_for(lambda: z.tokens() > before + 1, 600, "Z recomputed and streaming again")
    for stream in (w, x, z):
        stream.cancel()
    wait_for(lambda: num_running() == 0, 300, "every request gone")
    return ended


def server_span(receiver: OtlpReceiver, name: str):
    for span in receiver.spans:
        attrs = attributes(span.attributes)
        if span.name.endswith("Inference/Generate") and attrs.get("sitsd.request_id") == rid(name):
            return span
    return None


def children(receiver: OtlpReceiver, parent) -> list:
    kids = [s for s in receiver.spans if s.parent_span_id == parent.span_id]
    return sorted(kids, key=lambda s: s.start_time_unix_nano)


def finished_server_span(receiver: OtlpReceiver, name: str, **counts: int):
    """The server span of `name` once it and `counts[kind]` children of each kind are
    exported (the exporter sends in batches, the last ones when the request ends)."""

    def ready():
        span = server_span(receiver, name)
        if span is None:
            return None
        names = [s.name for s in children(receiver, span)]
        return span if all(names.count(k) >= n for k, n in counts.items()) else None

    return wait_for(ready, 120, f"{name}'s spans ({counts})")


def test_a_refused_request_has_its_queue_span_tier_ids_and_reason(traced):
    daemon, receiver, ended = traced.daemon, traced.receiver, traced.ended
    assert ended["r"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    span = finished_server_span(receiver, "r", queue=1)
    attrs = attributes(span.attributes)
    assert attrs["sitsd.finish_reason"] == "refused"
    assert attrs["sitsd.tier"] == "bronze"
    assert attrs["gen_ai.request.model"] != ""
    assert attrs["error.type"] == "resource_exhausted"
    (queue,) = children(receiver, span)
    q = attributes(queue.attributes)
    assert q["sitsd.queue.outcome"] == "refused"
    assert q["sitsd.queue.num_running"] == 3
    assert q["sitsd.queue.expected_wait_s"] > q["sitsd.queue.max_wait_s"] == 0.001
    assert_logged(daemon, "r", "refused")


def test_a_shed_request_has_its_queue_span_and_reason(traced):
    daemon, receiver, ended = traced.daemon, traced.receiver, traced.ended
    assert ended["y"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    span = finished_server_span(receiver, "y", queue=1)
    attrs = attributes(span.attributes)
    assert attrs["sitsd.finish_reason"] == "shed"
    assert attrs["sitsd.tier"] == "bronze"
    (queue,) = children(receiver, span)
    q = attributes(queue.attributes)
    assert q["sitsd.queue.outcome"] == "shed"
    assert q["sitsd.queue.num_running"] == 2
    assert queue.end_time_unix_nano - queue.start_time_unix_nano > 1e6  # over bronze's 1 ms
    assert_logged(daemon, "y", "shed")


def test_a_preempted_request_says_why_for_whom_and_decodes_around_it(traced):
    receiver, ended = traced.receiver, traced.ended
    assert ended["g"] == pb.FINISH_REASON_LENGTH
    # Before and after the preemption: preempted time is never decode time.
    span = finished_server_span(receiver, "z", queue=1, preemption=1, decode=2)
    kids = children(receiver, span)
    (preemption,) = [s for s in kids if s.name == "preemption"]
    p = attributes(preemption.attributes)
    assert p["sitsd.preemption.reason"] == "tier"
    assert p["sitsd.preemption.for_request_id"] == rid("g")
    assert p["sitsd.preemption.for_tier"] == "gold"
    decodes = [s for s in kids if s.name == "decode"]
    assert len(decodes) == 2
    for decode in decodes:
        assert (
            decode.end_time_unix_nano <= preemption.start_time_unix_nano
            or decode.start_time_unix_nano >= preemption.end_time_unix_nano
        )
    prefills = [attributes(s.attributes) for s in kids if s.name == "prefill"]
    assert any(a["sitsd.recompute"] for a in prefills)
    assert attributes(span.attributes)["sitsd.finish_reason"] == "cancelled"
    write_traces(receiver)


def assert_logged(daemon: DaemonProcess, name: str, reason: str) -> None:
    lines = [json.loads(x) for x in daemon.log.splitlines() if x.startswith("{")]
    (line,) = [
        x for x in lines if x.get("event") == "request finished" and x.get("req_id") == rid(name)
    ]
    assert line["finish_reason"] == reason
    assert len(line["trace_id"]) == 32


def trimmed(receiver: OtlpReceiver, span) -> dict[str, object]:
    """A span and its children as JSON: names, times from the server span's start, attributes."""
    t0 = span.start_time_unix_nano

    def one(s) -> dict[str, object]:
        return {
            "name": s.name,
            "span_id": s.span_id.hex(),
            "start_ms": round((s.start_time_unix_nano - t0) / 1e6, 1),
            "duration_ms": round((s.end_time_unix_nano - s.start_time_unix_nano) / 1e6, 1),
            "attributes": {
                k: v for k, v in attributes(s.attributes).items() if k != "sitsd.step.indexes"
            },
        }

    return {"trace_id": span.trace_id.hex(), **one(span),
            "children": [one(c) for c in children(receiver, span)]}  # fmt: skip


def write_traces(receiver: OtlpReceiver) -> None:
    out = os.environ.get("SITSD_TEST_TRACE_OUT")
    if out:
        traces = {n: trimmed(receiver, server_span(receiver, n)) for n in ("r", "y", "z")}
        Path(out).write_text(json.dumps(traces, indent=1, default=str))
