"""The metrics registry: names, buckets, the swap and tier APIs, exposition and promtool lint."""

from __future__ import annotations

import random
import re
import subprocess
import urllib.error
import urllib.request

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from sitsd.observability.metrics import Metrics, MetricsServer
from sitsd.observability.swap import SwapTrace
from tests.observability.tools import require_binary

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
