"""Every PromQL expression sitsd ships (rules, dashboards, datasource links) and their metrics."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import promql_parser
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules" / "sitsd-slo.rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "tests" / "sitsd-slo.rules.test.yml"
DASHBOARDS = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
DATASOURCES = REPO / "grafana" / "provisioning" / "datasources" / "datasources.yaml"

# Grafana variables -> values that make the expression plain PromQL.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$__tags": 'tier="gold"',
    "${model}": "m",
    "$model": "m",
    "${tier}": "gold",
    "$tier": "gold",
}
LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,")


@dataclass(frozen=True)
class Expression:
    where: str  # file and place, for messages
    promql: str  # with Grafana variables substituted


def substitute(expr: str) -> str:
    # Longest names first, so $__rate_interval is not read as $__r... of a shorter one.
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def rule_expressions() -> list[Expression]:
    doc = yaml.safe_load(RULES.read_text())
    return [
        Expression(f"{RULES.name}: {r.get('record') or r.get('alert')}", r["expr"])
        for group in doc["groups"]
        for r in group["rules"]
    ]


def recorded_names() -> set[str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def dashboard_expressions() -> list[Expression]:
    found = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for t in panel["targets"]:
                if t["datasource"]["type"] == "prometheus":
                    found.append(
                        Expression(f"{path.name}: {panel['title']}", substitute(t["expr"]))
                    )
        for a in board["annotations"]["list"]:
            if a["datasource"]["type"] == "prometheus":
                found.append(Expression(f"{path.name}: annotation", substitute(a["expr"])))
    return found


def variable_metrics() -> set[str]:
    """Metrics named by `label_values(metric, label)` template variables."""
    names = set()
    for path in DASHBOARDS:
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] == "query":
                names |= set(LABEL_VALUES.findall(var["definition"]))
    return names


def datasource_expressions() -> list[Expression]:
    doc = yaml.safe_load(DATASOURCES.read_text())
    found = []
    for ds in doc["datasources"]:
        for q in ds.get("jsonData", {}).get("tracesToMetrics", {}).get("queries", []):
            # `$$` is provisioning's escape for a literal `$`.
            found.append(
                Expression(
                    f"{DATASOURCES.name}: {q['name']}", substitute(q["query"].replace("$$", "$"))
                )
            )
    return found


def all_expressions() -> list[Expression]:
    return rule_expressions() + dashboard_expressions() + datasource_expressions()


def metric_names(promql: str) -> set[str]:
    """The metric names an expression selects (parsed with promql-parser)."""
    names: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {promql!r}"
            names.add(node.name)
            return
        for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None:
                walk(child)
        for arg in getattr(node, "args", None) or ():
            walk(arg)

    walk(promql_parser.parse(promql))
    return names


SERIES_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count", "_created"), "counter": ("_created",)}


def exported_names(exposition: str) -> set[str]:
    """Series names of a text exposition, and those its TYPE lines declare (even without samples:
    a labelled family shows no series before its first observation)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()[:4]
            names.add(family)
            names |= {family + suffix for suffix in SERIES_SUFFIXES.get(kind, ())}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def unknown_metrics(exposition: str) -> dict[str, set[str]]:
    """Expression place -> metric names it uses that neither the exposition nor a rule has."""
    known = exported_names(exposition) | recorded_names() | {"up"}
    missing = {}
    for e in all_expressions():
        unknown = metric_names(e.promql) - known
        if unknown:
            missing[e.where] = unknown
    unknown_vars = variable_metrics() - known
    if unknown_vars:
        missing["template variables"] = unknown_vars
    return missing
