"""The real daemon under load, observed the way an operator would: a real Prometheus (Debian's
2.42) scraping /metrics with the SLO rules loaded, and an OTLP/gRPC receiver standing in for the
collector. One daemon, one Prometheus and one receiver are shared by the module."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml

from sitsd.api.v1 import inference_pb2 as pb
from sitsd.api.v1 import inference_pb2_grpc
from sitsd.testing.otlp_receiver import OtlpReceiver, attributes
from tests.deploy.exprs import RULES, all_expressions, dashboard_expressions, unknown_metrics
from tests.e2e.daemon_process import LAST_GUARD_S, DaemonProcess, serving
from tests.observability.tools import free_port, require_binary, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * LAST_GUARD_S)]  # a loaded machine is slow

METRICS_LINE = re.compile(r"metrics on http://(\S+):(\d+)/metrics")
TIERS = {"gold": pb.TIER_GOLD, "silver": pb.TIER_SILVER, "bronze": pb.TIER_BRONZE}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, receiver) -> Iterator[DaemonProcess]:
    flags = (
        "--model", "default", "--kv-cache-memory", "256MiB", "--max-num-seqs", "8",
        "--otlp-endpoint", receiver.endpoint,
        # The tier scheduler would refuse part of this burst on a CPU (the SITS targets are
        # GPU targets); this test is about telemetry, so every request must be served.
        "--scheduling-policy", "fcfs",
    )  # fmt: skip
    with serving(tmp_path_factory.mktemp("state"), *flags) as process:
        match = wait_for(lambda: METRICS_LINE.search(process.log), 30, "a 'metrics on' line")
        process.metrics_url = f"http://127.0.0.1:{match.group(2)}/metrics"
        yield process


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen
    log: Path

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, daemon) -> Iterator[Prometheus]:
    binary = require_binary("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    target = urllib.parse.urlparse(daemon.metrics_url).netloc
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "sitsd", "static_configs": [{"targets": [target]}]}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = work / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_for(lambda: ready(prom), LAST_GUARD_S, f"prometheus ready ({log})")
        yield prom
    finally:
        proc.terminate()
        proc.wait(30)


def ready(prom: Prometheus) -> bool:
    assert prom.proc.poll() is None, prom.log.read_text()
    try:
        with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Load:
    trace_id: str  # the caller's trace, continued by the gold request
    parent_span_id: str
    responses: dict[str, list] = field(default_factory=dict)


def generate(stub, tier: str, max_tokens: int, metadata=()) -> list:
    request = pb.GenerateRequest(
        text=f"Tell me about the {tier} tier.",
        tier=TIERS[tier],
        ignore_eos=True,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0),
    )
    return list(stub.Generate(request, metadata=metadata, timeout=LAST_GUARD_S))


@pytest.fixture(scope="module")
def load(daemon, prometheus) -> Load:
    """A traced gold request among concurrent silver and bronze ones, and one bad request.

    The silver and bronze requests start first and run four times longer, and the traced one
    starts once they stream, so it shares its steps with them even on a slow two-core machine."""
    load = Load(os.urandom(16).hex(), os.urandom(8).hex())
    streaming = threading.Event()
    with grpc.insecure_channel(daemon.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        traceparent = [("traceparent", f"00-{load.trace_id}-{load.parent_span_id}-01")]

        def background(name: str, tier: str) -> None:
            request = pb.GenerateRequest(
                text=f"Tell me about the {tier} tier.",
                tier=TIERS[tier],
                ignore_eos=True,
                sampling=pb.SamplingParams(max_tokens=4 * MAX_TOKENS, temperature=0),
            )
            responses = []
            for response in stub.Generate(request, timeout=LAST_GUARD_S):
                responses.append(response)
                streaming.set()
            load.responses[name] = responses

        threads = [
            threading.Thread(target=background, args=(f"{tier}-{i}", tier))
            for tier in ("silver", "bronze")
            for i in range(2)
        ]
        for t in threads:
            t.start()
        assert streaming.wait(LAST_GUARD_S), "no background request streamed"
        load.responses["traced"] = generate(stub, "gold", MAX_TOKENS, traceparent)
        for t in threads:
            t.join(LAST_GUARD_S)
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(pb.GenerateRequest(text=""), timeout=30))
    assert len(load.responses) == 5
    return load


def server_spans(receiver: OtlpReceiver, trace_id: str) -> list:
    return [
        s
        for s in receiver.spans
        if s.trace_id.hex() == trace_id and s.name == "sitsd.api.v1.Inference/Generate"
    ]


def children(receiver: OtlpReceiver, parent) -> list:
    return [s for s in receiver.spans if s.parent_span_id == parent.span_id]


def test_callers_trace_is_continued_with_queue_prefill_and_decode_children(receiver, load):
    (server,) = wait_for(
        lambda: server_spans(receiver, load.trace_id), LAST_GUARD_S, "the server span"
    )
    assert server.parent_span_id.hex() == load.parent_span_id
    kids = wait_for(
        lambda: (
            (k := children(receiver, server)) and {"queue", "decode"} <= {s.name for s in k} and k
        ),
        LAST_GUARD_S,
        "queue and decode spans",
    )
    names = [s.name for s in sorted(kids, key=lambda s: s.start_time_unix_nano)]
    assert names[0] == "queue"
    assert "prefill" in names
    assert names[-1] == "decode"
    for kid in kids:
        assert server.start_time_unix_nano <= kid.start_time_unix_nano
        assert kid.end_time_unix_nano <= server.end_time_unix_nano
    attrs = attributes(server.attributes)
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] != ""
    assert attrs["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.usage.input_tokens"] == load.responses["traced"][-1].usage.prompt_tokens
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["sitsd.tier"] == "gold"
    assert attrs["sitsd.weights_version"] == load.responses["traced"][-1].weights_version
    assert "sitsd.prefix_cache.hit_tokens" in attrs
    resources = receiver.span_resources()
    assert all(r["service.name"] == "sitsd" for r in resources)


def test_engine_steps_are_spans_linked_to_the_requests_they_served(receiver, load):
    (server,) = wait_for(
        lambda: server_spans(receiver, load.trace_id), LAST_GUARD_S, "the server span"
    )

    def linked_steps() -> list:
        return [
            s
            for s in receiver.spans
            if s.name == "engine.step" and any(lk.span_id == server.span_id for lk in s.links)
        ]

    # One step per output token at least (the first token comes with the last prefill chunk).
    steps = wait_for(
        lambda: len(linked_steps()) >= MAX_TOKENS and linked_steps(), LAST_GUARD_S, "steps"
    )
    for step in steps:
        attrs = attributes(step.attributes)
        assert attrs["sitsd.batch_size"] == len(step.links) >= 1
        assert attrs["sitsd.num_tokens"] >= attrs["sitsd.batch_size"]
        assert not step.parent_span_id
    assert max(attributes(s.attributes)["sitsd.batch_size"] for s in steps) > 1  # it was batched


def test_request_log_records_carry_the_request_trace_id(receiver, daemon, load):
    def finished_records() -> list:
        return [
            r
            for r in receiver.logs
            if r.trace_id.hex() == load.trace_id and r.body.string_value == "request finished"
        ]

    (record,) = wait_for(finished_records, LAST_GUARD_S, "the request's log record over OTLP")
    attrs = attributes(record.attributes)
    assert attrs["tier"] == "gold"
    assert attrs["output_tokens"] == MAX_TOKENS
    lines = [json.loads(x) for x in daemon.log.splitlines() if x.startswith("{")]
    (line,) = [x for x in lines if x.get("trace_id") == load.trace_id]
    assert line["event"] == "request finished"
    assert line["span_id"] == record.span_id.hex()


def test_a_refused_request_is_logged_with_its_error_class(daemon, load):
    def failures() -> list[dict]:
        lines = [json.loads(x) for x in daemon.log.splitlines() if x.startswith("{")]
        return [x for x in lines if x.get("event") == "rpc failed"]

    # The client has its status before the daemon's line has come through its stdout pipe.
    failed = wait_for(failures, LAST_GUARD_S, "an 'rpc failed' line")
    assert [x["error_class"] for x in failed] == ["invalid_argument"]
    assert re.fullmatch(r"[0-9a-f]{32}", failed[0]["trace_id"])


def test_recording_rules_return_values_for_every_tier(daemon, prometheus, load):
    rules = (
        "tier:sitsd_ttft_slo_errors:ratio_rate5m",
        "tier:sitsd_availability_slo_errors:ratio_rate5m",
        "tier:sitsd_time_to_first_token_seconds:p99_rate5m",
    )

    def tiers_with_values() -> set[str]:
        tiers = set(TIERS)
        for rule in rules:
            tiers &= {r["metric"]["tier"] for r in prometheus.query(rule) if r["value"][1] != "NaN"}
        return tiers

    # A series born between two scrapes shows no increase yet: keep a little traffic going.
    with grpc.insecure_channel(daemon.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        def until_every_tier_has_values() -> bool:
            if tiers_with_values() == set(TIERS):
                return True
            for tier in TIERS:
                generate(stub, tier, 2)
            return False

        wait_for(
            until_every_tier_has_values, LAST_GUARD_S, "recording rules with values", interval=0.5
        )
    (ratio,) = prometheus.query('tier:sitsd_availability_slo_errors:ratio_rate5m{tier="gold"}')
    assert float(ratio["value"][1]) == 0.0  # the empty prompt is the client's error


def test_exemplars_carry_trace_ids_of_exported_request_spans(receiver, prometheus, load):
    end = time.time() + 60
    start = end - 3600

    def exemplar_trace_ids() -> set[str]:
        data = prometheus.api(
            "query_exemplars",
            query="sitsd_time_to_first_token_seconds_bucket",
            start=str(start),
            end=str(end),
        )
        return {e["labels"]["trace_id"] for series in data for e in series["exemplars"]}

    trace_ids = wait_for(exemplar_trace_ids, LAST_GUARD_S, "exemplars in Prometheus")
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in trace_ids)

    def request_trace_ids() -> set[str]:
        return {
            s.trace_id.hex() for s in receiver.spans if s.name == "sitsd.api.v1.Inference/Generate"
        }

    wait_for(
        lambda: trace_ids <= request_trace_ids(), LAST_GUARD_S, "a request span for every exemplar"
    )


def test_promtool_check_metrics_passes_on_the_live_scrape(daemon, load):
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as r:
        body = r.read()
    result = subprocess.run(
        [require_binary("promtool"), "check", "metrics"], input=body, capture_output=True
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_rules_and_dashboards_name_only_metrics_the_live_daemon_exports(daemon, load):
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as r:
        assert unknown_metrics(r.read().decode()) == {}
    assert len(all_expressions()) > 60


def test_live_prometheus_evaluates_every_dashboard_expression(prometheus, load):
    for expression in dashboard_expressions():
        prometheus.query(expression.promql)  # raises on a parse or evaluation error


def test_the_event_loop_lag_is_measured_on_the_live_daemon(daemon, load):
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as r:
        body = r.read().decode()
    (count,) = re.findall(r"^sitsd_event_loop_lag_seconds_count (\S+)$", body, re.M)
    assert float(count) > 10  # a wake-up every 50 ms since start-up
    (under,) = re.findall(r'^sitsd_event_loop_lag_seconds_bucket\{le="0\.25"\} (\S+)$', body, re.M)
    # How late is the machine's business (a busy CI runner makes it late): only that the
    # wake-ups are sorted into buckets is checked here (bench.bench_tiers reports the lag).
    assert 0 < float(under) <= float(count)
