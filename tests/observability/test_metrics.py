"""The metrics registry: names, buckets, the swap and tier APIs, exposition and promtool lint."""

from __future__ import annotations

import ast
import random
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from sitsd.api.telemetry import ERROR_CLASSES as API_ERROR_CLASSES
from sitsd.api.telemetry import GENERATE, TelemetryInterceptor, sitsd_methods
from sitsd.http.errors import HttpError
from sitsd.http.telemetry import GENERATION_ROUTES, HttpTelemetry
from sitsd.observability.metrics import (
    ERROR_CLASSES,
    PUSH_OUTCOMES,
    PUSH_TRANSPORTS,
    SWAP_OUTCOMES,
    SWAP_STAGES,
    VERSION_EVENTS,
    Metrics,
    MetricsServer,
)
from sitsd.observability.swap import SwapTrace
from sitsd.observability.telemetry import EngineTelemetry
from sitsd.types import Tier
from tests.observability.tools import require_binary

REPO = Path(__file__).resolve().parents[2]

TIER_TARGETS = (0.08, 0.12, 0.2, 0.25, 0.5)  # gold/silver/bronze TTFT targets, queue timeouts
LATENCY_HISTOGRAMS = (
    "sitsd_time_to_first_token_seconds",
    "sitsd_inter_token_latency_seconds",
    "sitsd_e2e_request_latency_seconds",
    "sitsd_request_queue_time_seconds",
    "sitsd_request_prefill_time_seconds",
    "sitsd_request_decode_time_seconds",
)


def populated() -> Metrics:
    """A registry with a sample in every metric (and tier/swap series set through their APIs)."""
    m = Metrics("m")
    for family in m.registry.collect():
        if family.type == "info":
            continue
        metric = getattr(m, _attr_of(m, family.name))
        labels = [random.choice(["gold", "x", "stop"]) for _ in metric._labelnames]
        child = metric.labels(*labels) if labels else metric  # unlabelled: the loop lag
        if family.type == "histogram":
            child.observe(random.random(), {"trace_id": "ab" * 16})
        elif family.type == "counter":
            child.inc(random.randint(1, 5))
        else:
            child.set(random.random())
    m.set_weights_version("m@1")
    return m


def _attr_of(m: Metrics, family_name: str) -> str:
    for attr, value in vars(m).items():
        if getattr(value, "_name", None) == family_name:
            return attr
    raise AssertionError(f"no attribute for {family_name}")


def family_names(m: Metrics) -> list[str]:
    return [f.name for f in m.registry.collect()]


def test_every_metric_is_named_sitsd_without_colons():
    names = family_names(Metrics("m"))
    assert len(names) >= 25
    for name in names:
        assert re.fullmatch(r"sitsd_[a-z0-9_]+", name), name


@pytest.mark.parametrize("name", LATENCY_HISTOGRAMS)
def test_latency_histograms_have_every_tier_target_as_a_bucket(name):
    m = Metrics("m")
    (family,) = [f for f in m.registry.collect() if f.name == name]
    metric = getattr(m, _attr_of(m, name))
    assert set(TIER_TARGETS) <= set(metric._upper_bounds)
    assert family.type == "histogram"
    assert metric._labelnames == ("model", "tier")


def test_promtool_check_metrics_passes_on_the_text_exposition():
    promtool = require_binary("promtool")
    body = populated().exposition()
    result = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_openmetrics_exposition_carries_exemplars_and_text_does_not():
    m = Metrics("m")
    trace_id = random.randbytes(16).hex()
    m.time_to_first_token.labels("m", "gold").observe(0.07, {"trace_id": trace_id})
    assert f'# {{trace_id="{trace_id}"}} 0.07' in m.exposition(openmetrics=True).decode()
    assert trace_id not in m.exposition().decode()


def test_swap_trace_records_each_stage_and_the_outcome():
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    m = Metrics("m")
    m.set_weights_version("m@1")
    swap = SwapTrace(provider.get_tracer("t"), m, from_version="m@1", to_version="m@2")
    with swap.stage("stage"):
        pass
    with pytest.raises(ValueError, match="NaN"), swap.stage("validate"):
        raise ValueError("NaN in layer 3")
    swap.finish("committed")
    get = m.registry.get_sample_value
    for stage in ("stage", "validate"):
        labels = {"model": "m", "stage": stage}
        assert get("sitsd_swap_stage_duration_seconds_count", labels) == 1
        assert get("sitsd_swap_stage_duration_seconds_sum", labels) == pytest.approx(
            swap.stage_seconds[stage]
        )
    assert get("sitsd_swaps_total", {"model": "m", "outcome": "committed"}) == 1
    assert get("sitsd_weights_version_info", {"model": "m", "version": "m@2"}) == 1
    assert get("sitsd_weights_version_info", {"model": "m", "version": "m@1"}) is None
    finished = {s.name: s for s in spans.get_finished_spans()}
    root = finished["weights.swap"]
    assert root.parent is None
    assert root.attributes["sitsd.swap.outcome"] == "committed"
    for name in ("swap.stage", "swap.validate"):
        assert finished[name].parent.span_id == root.context.span_id
        assert finished[name].context.trace_id == root.context.trace_id
    assert finished["swap.validate"].status.status_code is StatusCode.ERROR
    assert finished["swap.stage"].status.status_code is StatusCode.UNSET


def test_tier_scheduler_gauges_are_set_through_their_hooks():
    m = Metrics("m")
    cap, p99 = random.randint(4, 32), random.random()
    m.set_tier_batch_cap("gold", cap)
    m.set_tier_p99_estimate("bronze", "ttft", p99)
    get = m.registry.get_sample_value
    assert get("sitsd_tier_batch_cap", {"model": "m", "tier": "gold"}) == cap
    labels = {"model": "m", "tier": "bronze", "kind": "ttft"}
    assert get("sitsd_tier_p99_estimate_seconds", labels) == p99


def test_metrics_server_serves_openmetrics_on_request_and_frees_its_port():
    m = populated()
    server = MetricsServer(m, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        plain = urllib.request.urlopen(url, timeout=10)
        assert plain.headers["Content-Type"].startswith("text/plain")
        assert b"sitsd_time_to_first_token_seconds_bucket" in plain.read()
        request = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
        om = urllib.request.urlopen(request, timeout=10)
        assert om.headers["Content-Type"].startswith("application/openmetrics-text")
        assert b'trace_id="' in om.read()
    finally:
        server.close()
    with pytest.raises(OSError, match="refused"):
        urllib.request.urlopen(url, timeout=2)


# ------------------------------------------------------------- every series exists from start


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"model": "m", **labels})


def test_every_known_label_set_is_a_series_at_zero_once_the_model_is_bound():
    m = Metrics()
    TelemetryInterceptor(m)
    HttpTelemetry(m)
    assert 'model=""' not in m.exposition().decode()  # nothing before the model is known
    EngineTelemetry(m).on_engine_started("m", "m@1")
    for outcome in SWAP_OUTCOMES:
        assert sample(m, "sitsd_swaps_total", outcome=outcome) == 0
    for stage in SWAP_STAGES:
        assert sample(m, "sitsd_swap_stage_duration_seconds_count", stage=stage) == 0
    for event in VERSION_EVENTS:
        assert sample(m, "sitsd_weight_versions_total", event=event) == 0
    for transport in PUSH_TRANSPORTS:
        assert sample(m, "sitsd_weight_update_bytes_total", transport=transport) == 0
        for outcome in PUSH_OUTCOMES:
            labels = {"transport": transport, "outcome": outcome}
            assert sample(m, "sitsd_weight_updates_total", **labels) == 0
    calls = [(GENERATE, tier.value, "grpc") for tier in Tier]
    calls += [(method, "", "grpc") for method in sitsd_methods() if method != GENERATE]
    calls += [(route, tier.value, "http") for route in GENERATION_ROUTES for tier in Tier]
    for method, tier, protocol in calls:
        labels = {"method": method, "tier": tier, "protocol": protocol}
        assert sample(m, "sitsd_requests_total", **labels) == 0
        for error_class in ERROR_CLASSES:
            errors = sample(m, "sitsd_request_errors_total", **labels, error_class=error_class)
            assert errors == 0, (labels, error_class)
    for tier in Tier:
        for reason in ("blocks", "tier", "swap"):
            assert sample(m, "sitsd_num_preemptions_total", tier=tier.value, reason=reason) == 0
    assert sample(m, "sitsd_step_duration_seconds_count") == 0


def test_the_first_error_and_the_first_swap_are_an_increase_from_zero():
    m = Metrics()
    TelemetryInterceptor(m)
    m.bind_model("m")
    before = m.exposition().decode()
    m.count_rpc(GENERATE, "gold", "internal")
    m.record_swap("committed")
    errors = {"method": GENERATE, "tier": "gold", "protocol": "grpc", "error_class": "internal"}
    assert sample(m, "sitsd_request_errors_total", **errors) == 1
    assert sample(m, "sitsd_swaps_total", outcome="committed") == 1
    line = 'sitsd_swaps_total{model="m",outcome="committed"} 0.0'
    assert line in before  # scraped at 0 before: increase() counts the 1


def test_the_front_ends_error_classes_are_all_created_at_zero():
    grpc_classes = set(API_ERROR_CLASSES.values()) | {"internal"}
    http_classes = {HttpError(status, "").error_class for status in range(400, 600)}
    assert grpc_classes | http_classes <= set(ERROR_CLASSES)


def literals_passed_to(names: set[str], *, keyword: str = "") -> set[str]:
    """String constants the weights code passes to calls of `names` (first argument, or the
    `keyword` argument and parameter defaults of that name)."""
    found: set[str] = set()
    for path in (REPO / "sitsd" / "weights").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            values: list[ast.AST] = []
            if isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else ""
                if callee in names and node.args:
                    values.append(node.args[0])
                values += [k.value for k in node.keywords if keyword and k.arg == keyword]
            elif isinstance(node, ast.arguments) and keyword:
                named = node.args[len(node.args) - len(node.defaults) :] + node.kwonlyargs
                defaults = [*node.defaults, *(d for d in node.kw_defaults if d is not None)]
                values += [d for a, d in zip(named, defaults, strict=False) if a.arg == keyword]
            for value in values:
                found |= {
                    c.value
                    for c in ast.walk(value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
    return found


def test_every_swap_outcome_stage_and_version_event_the_weights_code_records_is_known():
    outcomes = literals_passed_to({"finish"}, keyword="outcome")
    assert {"committed", "rolled_back", "rejected", "failed", "staged"} <= outcomes
    assert outcomes <= set(SWAP_OUTCOMES)
    stages = literals_passed_to({"stage", "record_swap_stage"})
    assert {"verify", "commit", "pause"} <= stages
    assert stages <= set(SWAP_STAGES)
    events = literals_passed_to({"_count"})
    assert {"detected", "committed"} <= events
    assert events <= set(VERSION_EVENTS)


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/", "/metricsx", "/metrics/extra"])
def test_the_metrics_port_answers_only_metrics_and_404_elsewhere(path):
    server = MetricsServer(populated(), "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert urllib.request.urlopen(base + "/metrics", timeout=10).status == 200
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(base + path, timeout=10)
        assert caught.value.code == 404
        body = caught.value.read()
        assert b"sitsd_" not in body  # no metrics text a client could mistake for an answer
    finally:
        server.close()


def test_a_scrape_carries_no_created_series():
    # Half of every scrape's series, rendered while the engine waits for the interpreter.
    m = Metrics()
    m.bind_model("m")
    m.count_rpc(GENERATE, "gold", "internal")
    m.record_swap_stage("stage", 1.0)
    for text in (m.exposition().decode(), m.exposition(openmetrics=True).decode()):
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                 if line and not line.startswith("#")}  # fmt: skip
        assert "sitsd_request_errors_total" in names
        assert not [n for n in names if n.endswith("_created")]
