"""The shipped configs: rules and their unit tests (promtool), dashboards, datasources, the
collector pipelines, the compose stack and the Kubernetes manifests, all checked offline."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from sitsd.config import TiersConfig
from sitsd.observability.metrics import TTFT_BUCKETS, Metrics
from sitsd.types import Tier
from tests.deploy.exprs import (
    DASHBOARDS,
    DATASOURCES,
    REPO,
    RULE_TESTS,
    RULES,
    all_expressions,
    metric_names,
    unknown_metrics,
)
from tests.observability.tools import require_binary


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_slo_rules = _load_script("build_slo_rules")
COLLECTOR = REPO / "otel-collector.yaml"
COMPOSE = REPO / "deploy" / "compose.yaml"
K8S = REPO / "deploy" / "k8s" / "sitsd.yaml"


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [require_binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


# --------------------------------------------------------------------------- Prometheus rules


def test_promtool_check_rules_passes():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_pass_and_fire_every_alert():
    result = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {
        r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
        if "alert" in r
    }  # fmt: skip
    fired = {
        t["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in test.get("alert_rule_test", [])
        if t["exp_alerts"]
    }
    assert alerts == fired, f"alerts no test fires: {alerts - fired}"


def test_each_tier_reads_its_scheduler_target_bucket_in_every_window():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    slis = [r for r in rules if r["record"].startswith("tier:sitsd_ttft_slo_errors:ratio_rate")]
    assert len(slis) == 6
    tiers = TiersConfig()  # what the scheduler aims at (bronze: 1 s) is what the SLO counts
    for sli in slis:
        buckets = dict(re.findall(r'tier="(\w+)", le="([\d.]+)"', sli["expr"]))
        assert {t: float(le) for t, le in buckets.items()} == {
            t.value: tiers.tier(t.value).ttft_p99_s for t in Tier
        }
        for le in buckets.values():
            assert float(le) in TTFT_BUCKETS  # a bucket boundary: the ratio is exact


def test_the_shipped_slo_rules_are_what_build_slo_rules_writes_from_the_tier_targets():
    assert RULES.read_text() == build_slo_rules.render(TiersConfig()), (
        "run: python scripts/build_slo_rules.py"
    )


def test_rules_built_from_a_tiers_file_follow_its_targets(tmp_path):
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text("tiers:\n  bronze: {ttft_p99_ms: 2500}\n  gold: {ttft_p99_ms: 100}\n")
    out = tmp_path / "rules.yml"
    assert build_slo_rules.main(["--tiers", str(tiers), "-o", str(out)]) == 0
    text = out.read_text()
    assert 'tier="bronze", le="2.5"' in text
    assert 'tier="gold", le="0.1"' in text
    assert promtool("check", "rules", str(out)).returncode == 0


def test_a_tier_target_off_the_bucket_boundaries_is_refused(tmp_path, capsys):
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text("tiers:\n  silver: {ttft_p99_ms: 333}\n")
    assert build_slo_rules.main(["--tiers", str(tiers), "-o", str(tmp_path / "r.yml")]) == 1
    assert "silver tier's TTFT target 0.333 s is not a bucket boundary" in capsys.readouterr().err
    assert not (tmp_path / "r.yml").exists()


def test_prometheus_keeps_more_than_the_longest_slo_window():
    rules = RULES.read_text()
    longest_days = max(int(d) for d in re.findall(r"\[(\d+)d\]", rules))
    assert longest_days == 30
    command = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]["command"]
    (retention,) = [c for c in command if c.startswith("--storage.tsdb.retention.time=")]
    value = retention.split("=", 1)[1]
    assert value.endswith("d"), "retention in days"
    assert int(value[:-1]) > longest_days  # the default 15d would cut the 30d windows in half


# ------------------------------------------------------------------------------- dashboards


def test_dashboards_are_generated_from_build_dashboards():
    sys.path.insert(0, str(REPO / "grafana"))
    try:
        import build_dashboards
    finally:
        sys.path.remove(str(REPO / "grafana"))
    rendered = build_dashboards.render()
    assert sorted(rendered) == sorted(p.name for p in DASHBOARDS)
    for path in DASHBOARDS:
        assert path.read_text() == rendered[path.name], f"run grafana/build_dashboards.py: {path}"


def provisioned_uids() -> dict[str, str]:
    return {ds["uid"]: ds["type"] for ds in yaml.safe_load(DATASOURCES.read_text())["datasources"]}


def test_every_datasource_a_dashboard_names_is_provisioned():
    uids = provisioned_uids()
    assert set(uids) == {"prometheus", "loki", "jaeger"}
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        refs = [p["datasource"] for p in board["panels"]]
        refs += [t["datasource"] for p in board["panels"] for t in p["targets"]]
        refs += [a["datasource"] for a in board["annotations"]["list"]]
        refs += [v["datasource"] for v in board["templating"]["list"] if "datasource" in v]
        for ref in refs:
            assert uids.get(ref["uid"]) == ref["type"], f"{path.name}: {ref} is not provisioned"


def test_dashboards_have_unique_uids_and_exemplars_on_latency_panels():
    boards = [json.loads(p.read_text()) for p in DASHBOARDS]
    assert len({b["uid"] for b in boards}) == len(boards) == 4
    (latency,) = [b for b in boards if b["uid"] == "sitsd-latency"]
    ttft = next(p for p in latency["panels"] if p["title"] == "Time to first token")
    assert any(t["exemplar"] for t in ttft["targets"])


def test_datasource_cross_links_name_provisioned_uids():
    uids = provisioned_uids()
    by_uid = {d["uid"]: d for d in yaml.safe_load(DATASOURCES.read_text())["datasources"]}
    prom = by_uid["prometheus"]["jsonData"]
    assert prom["exemplarTraceIdDestinations"][0]["name"] == "trace_id"  # the exemplar label
    links = [d["datasourceUid"] for d in prom["exemplarTraceIdDestinations"]]
    loki = by_uid["loki"]["jsonData"]["derivedFields"]
    assert loki[0]["matcherRegex"] == "trace_id"
    links += [d["datasourceUid"] for d in loki]
    jaeger = by_uid["jaeger"]["jsonData"]
    links += [jaeger["tracesToLogsV2"]["datasourceUid"], jaeger["tracesToMetrics"]["datasourceUid"]]
    assert set(links) == {"jaeger", "loki", "prometheus"}
    assert set(links) <= set(uids)


def test_every_promql_expression_parses_with_promtool(tmp_path):
    expressions = all_expressions()
    assert len(expressions) > 60
    rules = {
        "groups": [
            {
                "name": "shipped-expressions",
                "rules": [
                    {"record": f"check:expression_{i}", "expr": e.promql}
                    for i, e in enumerate(expressions)
                ],
            }
        ]
    }
    path = tmp_path / "expressions.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_expressions_name_only_metrics_sitsd_defines():
    # The live scrape check is in tests/e2e/test_observability_stack.py; this one needs no daemon.
    assert unknown_metrics(Metrics("m").exposition().decode()) == {}
    assert metric_names('rate(sitsd_a_total{x="y"}[5m]) / on() sum(b:c)') == {
        "sitsd_a_total",
        "b:c",
    }


# ----------------------------------------------------------------------- collector pipeline

KNOWN_COMPONENT_TYPES = {
    "receivers": {"otlp", "prometheus"},
    "processors": {"memory_limiter", "batch", "resource", "attributes", "filter"},
    "exporters": {"otlp_grpc", "otlp_http", "prometheus", "prometheusremotewrite", "debug"},
    "extensions": {"health_check"},
}


def test_collector_pipelines_name_only_defined_components():
    config = yaml.safe_load(COLLECTOR.read_text())
    for kind, known in KNOWN_COMPONENT_TYPES.items():
        for name in config.get(kind, {}):
            assert name.split("/")[0] in known, f"{kind}.{name}: unknown component type"
    service = config["service"]
    assert set(service["extensions"]) <= set(config["extensions"])
    assert set(service["pipelines"]) == {"traces", "logs", "metrics"}
    for name, pipeline in service["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            undefined = set(pipeline[kind]) - set(config.get(kind) or {})
            assert not undefined, f"pipeline {name}: undefined {kind} {undefined}"
        assert pipeline["processors"][0] == "memory_limiter"
        assert pipeline["processors"][-1] == "batch"
    assert service["pipelines"]["traces"]["exporters"] == ["otlp_grpc/jaeger"]
    assert service["pipelines"]["logs"]["exporters"] == ["otlp_http/loki"]
    assert service["pipelines"]["metrics"]["exporters"] == ["prometheus"]


def test_collector_listens_on_all_interfaces_and_points_at_the_backends():
    config = yaml.safe_load(COLLECTOR.read_text())
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    exporters = config["exporters"]
    assert exporters["otlp_grpc/jaeger"]["endpoint"] == "jaeger:4317"
    assert exporters["otlp_http/loki"]["endpoint"] == "http://loki:3100/otlp"


# -------------------------------------------------------------------------- compose stack


def test_compose_brings_up_every_part_with_files_that_exist():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"sitsd", "otel-collector", "jaeger", "loki", "prometheus", "grafana"}
    for name, service in services.items():
        assert set(service.get("depends_on", [])) <= set(services), name
        for volume in service.get("volumes", []):
            source = (COMPOSE.parent / volume.split(":")[0]).resolve()
            assert source.exists(), f"{name}: {source} does not exist"
    assert (COMPOSE.parent / services["sitsd"]["build"]["context"] / "pyproject.toml").exists()
    assert "--otlp-endpoint=http://otel-collector:4317" in services["sitsd"]["command"]
    assert "--metrics-port=9464" in services["sitsd"]["command"]
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    scrape = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in scrape["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    }
    assert "sitsd:9464" in targets
    assert all(t.split(":")[0] in services for t in targets)


# ---------------------------------------------------------------------------- Kubernetes


def k8s_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


def test_kubernetes_manifests_validate_offline_against_the_1_37_schemas():
    docs = k8s_docs()
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "ServiceMonitor"}
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue  # a CRD: no schema offline; checked structurally below
        kubernetes_validate.validate(doc, "1.37", strict=True)


def test_kubernetes_manifests_are_wired_together():
    docs = {d["kind"]: d for d in k8s_docs()}
    deployment, service, monitor = docs["Deployment"], docs["Service"], docs["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"]  # grpc.health.v1
    assert "--metrics-port=9464" in container["args"]
    assert ports["metrics"] == 9464 == int(service["metadata"]["annotations"]["prometheus.io/port"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    shutdown = next(a for a in container["args"] if a.startswith("--shutdown-grace="))
    assert grace > float(shutdown.split("=")[1])


@pytest.mark.parametrize("bad", [{"containerPort": "grpc"}, {"name": "x"}])
def test_the_offline_validator_rejects_a_broken_container_port(bad):
    (deployment,) = [d for d in k8s_docs() if d["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"] = [bad]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37", strict=True)
