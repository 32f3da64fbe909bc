"""Writes grafana/dashboards/*.json: sitsd's four dashboards, from the panel lists below.

    python grafana/build_dashboards.py     # after editing; a test checks the JSON is current

Classic dashboard JSON (top-level `panels`, `templating.list`, integer `schemaVersion`), every
datasource named by the fixed uids provisioned in `provisioning/datasources/datasources.yaml`
(prometheus, loki, jaeger). Latency panels show exemplars (trace ids, linked to Jaeger).
"""

from __future__ import annotations

import json
from pathlib import Path

PROM = {"type": "prometheus", "uid": "prometheus"}
LOKI = {"type": "loki", "uid": "loki"}
JAEGER = {"type": "jaeger", "uid": "jaeger"}
SEL = 'model=~"$model", tier=~"$tier"'
GEN = 'method="Inference/Generate"'
RI = "$__rate_interval"
OUT = Path(__file__).resolve().parent / "dashboards"


def target(expr: str, legend: str = "", exemplar: bool = False, ref: str = "A") -> dict:
    return {
        "datasource": PROM,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "exemplar": exemplar,
        "refId": ref,
    }


def quantiles(metric: str, by: str = "", sel: str = SEL) -> list[dict]:
    """P50/P90/P99 of a histogram (with exemplars) plus its mean."""
    by_labels = f"le, {by}" if by else "le"
    targets = [
        target(
            f"histogram_quantile({q}, sum by ({by_labels}) (rate({metric}_bucket{{{sel}}}[{RI}])))",
            f"p{int(float(q) * 100)}" + (f" {{{{{by}}}}}" if by else ""),
            exemplar=True,
            ref=chr(ord("A") + i),
        )
        for i, q in enumerate(("0.5", "0.9", "0.99"))
    ]
    targets.append(
        target(
            f"sum(rate({metric}_sum{{{sel}}}[{RI}])) / sum(rate({metric}_count{{{sel}}}[{RI}]))",
            "mean",
            ref="D",
        )
    )
    return targets


class Board:
    """A dashboard under construction: panels laid out two per row."""

    def __init__(self, uid: str, title: str, description: str) -> None:
        self.uid, self.title, self.description = uid, title, description
        self.panels: list[dict] = []
        self.annotations: list[dict] = []
        self._y = 0
        self._x = 0

    def panel(self, title: str, targets: list[dict], **options) -> None:
        width = options.pop("width", 12)
        if self._x + width > 24:
            self._x, self._y = 0, self._y + 8
        panel = {
            "id": len(self.panels) + 1,
            "type": options.pop("type", "timeseries"),
            "title": title,
            "description": options.pop("description", ""),
            "datasource": options.pop("datasource", PROM),
            "gridPos": {"h": 8, "w": width, "x": self._x, "y": self._y},
            "targets": targets,
            "fieldConfig": {
                "defaults": {"unit": options.pop("unit", "short"), **options.pop("defaults", {})},
                "overrides": [],
            },
            "options": options.pop("panel_options", {}),
        }
        assert not options, options
        self.panels.append(panel)
        self._x += width

    def json(self) -> dict:
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["sitsd"],
            "timezone": "browser",
            "schemaVersion": 39,
            "version": 1,
            "editable": True,
            "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"},
            "links": [
                {
                    "title": "sitsd dashboards",
                    "type": "dashboards",
                    "tags": ["sitsd"],
                    "asDropdown": True,
                }
            ],
            "annotations": {"list": self.annotations},
            "templating": {"list": variables()},
            "panels": self.panels,
        }


def variables() -> list[dict]:
    return [
        {
            "name": "model",
            "label": "model",
            "type": "query",
            "datasource": PROM,
            "query": {"query": "label_values(sitsd_requests_total, model)", "refId": "model"},
            "definition": "label_values(sitsd_requests_total, model)",
            "includeAll": True,
            "multi": True,
            "current": {"text": "All", "value": "$__all"},
            "allValue": ".*",
            "refresh": 2,
        },
        {
            "name": "tier",
            "label": "tier",
            "type": "custom",
            "query": "gold,silver,bronze",
            "includeAll": True,
            "multi": True,
            "current": {"text": "All", "value": "$__all"},
            "allValue": ".*",
            "options": [],
        },
    ]


def thresholds(*steps: tuple[str, float | None]) -> dict:
    return {
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": c, "value": v} for c, v in steps],
        }
    }


def slo_overview() -> Board:
    b = Board(
        "sitsd-slo",
        "sitsd / SLO overview",
        "Per tier: error budget left over 30 days and how fast it burns (TTFT within the tier "
        "target: gold 80 ms, silver 200 ms, bronze 500 ms; availability of Generate).",
    )
    for sli, what in (("ttft", "TTFT"), ("availability", "Availability")):
        b.panel(
            f"{what}: error budget left (30d)",
            [target(f"tier:sitsd_{sli}_slo_error_budget:remaining_30d{{{SEL}}}", "{{tier}}")],
            type="stat",
            unit="percentunit",
            width=6,
            defaults=thresholds(("red", None), ("orange", 0.25), ("green", 0.5)),
        )
    b.panel(
        "TTFT P99 by tier (targets: 80 / 200 / 500 ms)",
        [target(f"tier:sitsd_time_to_first_token_seconds:p99_rate5m{{{SEL}}}", "{{tier}}")],
        unit="s",
        defaults=thresholds(("green", None), ("red", 0.5)),
    )
    for sli, what in (("ttft", "TTFT"), ("availability", "Availability")):
        b.panel(
            f"{what}: burn rate by tier (page at 14.4 and 6, ticket at 1)",
            [
                target(f"tier:sitsd_{sli}_slo_errors:ratio_rate1h{{{SEL}}} / 0.01", "1h {{tier}}"),
                target(
                    f"tier:sitsd_{sli}_slo_errors:ratio_rate5m{{{SEL}}} / 0.01",
                    "5m {{tier}}",
                    ref="B",
                ),
                target(
                    f"tier:sitsd_{sli}_slo_errors:ratio_rate6h{{{SEL}}} / 0.01",
                    "6h {{tier}}",
                    ref="C",
                ),
            ],
            defaults=thresholds(("green", None), ("orange", 6), ("red", 14.4)),
        )
    b.panel(
        "Generate calls by tier",
        [target(f"sum by (tier) (rate(sitsd_requests_total{{{GEN}, {SEL}}}[{RI}]))", "{{tier}}")],
        unit="reqps",
    )
    b.panel(
        "Failed calls by error class",
        [
            target(
                f"sum by (error_class, tier) (rate(sitsd_request_errors_total{{{SEL}}}[{RI}]))",
                "{{error_class}} {{tier}}",
            )
        ],
        unit="reqps",
    )
    b.panel(
        "Tier scheduler: batch cap by tier",
        [target(f"sitsd_tier_batch_cap{{{SEL}}}", "{{tier}}")],
        description="Set by the tier scheduler's dynamic batching policy.",
    )
    b.panel(
        "Tier scheduler: live P99 estimates",
        [target(f"sitsd_tier_p99_estimate_seconds{{{SEL}}}", "{{tier}} {{kind}}")],
        unit="s",
    )
    return b


def latency() -> Board:
    b = Board(
        "sitsd-latency",
        "sitsd / Latency investigation",
        "Why was a request slow? TTFT, inter-token and end-to-end quantiles with exemplars "
        "(click one for its trace), queue time, preemptions, batch sizes, failures in the logs.",
    )
    for metric, title in (
        ("sitsd_time_to_first_token_seconds", "Time to first token"),
        ("sitsd_inter_token_latency_seconds", "Inter-token latency"),
        ("sitsd_e2e_request_latency_seconds", "End-to-end latency"),
        ("sitsd_request_queue_time_seconds", "Queue time"),
        ("sitsd_request_prefill_time_seconds", "Prefill time"),
        ("sitsd_request_decode_time_seconds", "Decode time"),
    ):
        b.panel(title, quantiles(metric), unit="s")
    b.panel(
        "Preemptions by tier",
        [target(f"sum by (tier) (rate(sitsd_num_preemptions_total{{{SEL}}}[{RI}]))", "{{tier}}")],
        unit="ops",
    )
    b.panel(
        "Requests running / waiting",
        [
            target(f"sum by (tier) (sitsd_num_requests_running{{{SEL}}})", "running {{tier}}"),
            target(
                f"sum by (tier) (sitsd_num_requests_waiting{{{SEL}}})", "waiting {{tier}}", ref="B"
            ),
        ],
    )
    step_sel = 'model=~"$model"'
    b.panel(
        "Batch size per step",
        [
            target(
                f"sum(rate(sitsd_batch_size_sum{{{step_sel}}}[{RI}])) "
                f"/ sum(rate(sitsd_batch_size_count{{{step_sel}}}[{RI}]))",
                "mean",
            ),
            target(
                "histogram_quantile(0.9, sum by (le) "
                f"(rate(sitsd_batch_size_bucket{{{step_sel}}}[{RI}])))",
                "p90",
                ref="B",
            ),
        ],
    )
    b.panel("Step duration", quantiles("sitsd_step_duration_seconds", sel=step_sel), unit="s")
    b.panel(
        "Failed calls in the logs (click a trace id)",
        [
            {
                "datasource": LOKI,
                "expr": '{service_name="sitsd"} |= "rpc failed"',
                "refId": "A",
            }
        ],
        type="logs",
        datasource=LOKI,
        width=24,
    )
    return b


def kv_cache() -> Board:
    b = Board(
        "sitsd-kv",
        "sitsd / KV cache and prefix cache",
        "KV block usage, prefix-cache hit rate, preemptions (blocks ran out) and token throughput.",
    )
    m = 'model=~"$model"'
    b.panel(
        "KV cache usage",
        [target(f"sitsd_kv_cache_usage_perc{{{m}}}", "{{model}}")],
        unit="percentunit",
        defaults={"max": 1, "min": 0},
    )
    b.panel(
        "Prefix cache hit rate by tier",
        [
            target(
                f"sum by (tier) (rate(sitsd_prefix_cache_hits_total{{{SEL}}}[{RI}])) "
                f"/ sum by (tier) (rate(sitsd_prefix_cache_queries_total{{{SEL}}}[{RI}]))",
                "{{tier}}",
            )
        ],
        unit="percentunit",
    )
    b.panel(
        "Preemptions (KV blocks ran out)",
        [target(f"sum(rate(sitsd_num_preemptions_total{{{SEL}}}[{RI}]))", "preemptions")],
        unit="ops",
    )
    b.panel(
        "Token throughput",
        [
            target(f"sum(rate(sitsd_prompt_tokens_total{{{SEL}}}[{RI}]))", "prompt"),
            target(
                f"sum(rate(sitsd_generation_tokens_total{{{SEL}}}[{RI}]))", "generation", ref="B"
            ),
        ],
        unit="short",
    )
    b.panel(
        "Tokens per step",
        quantiles("sitsd_step_tokens", sel=m),
    )
    b.panel(
        "Requests running / waiting",
        [
            target(f"sum(sitsd_num_requests_running{{{SEL}}})", "running"),
            target(f"sum(sitsd_num_requests_waiting{{{SEL}}})", "waiting", ref="B"),
        ],
    )
    return b


def hot_swap() -> Board:
    b = Board(
        "sitsd-swap",
        "sitsd / Hot-swap timeline",
        "Weight swaps: which version served when, each stage's duration, outcomes, and the "
        "latency around each swap (annotations mark them; each swap is a trace of its own).",
    )
    m = 'model=~"$model"'
    b.annotations.append(
        {
            "name": "weight swaps",
            "datasource": PROM,
            "enable": True,
            "iconColor": "purple",
            "expr": f"sum by (outcome) (increase(sitsd_swaps_total{{{m}}}[1m])) > 0",
            "titleFormat": "swap {{outcome}}",
            "step": "30s",
        }
    )
    b.panel(
        "Weights version serving",
        [target(f"sitsd_weights_version_info{{{m}}}", "{{model}} {{version}}")],
        type="state-timeline",
        width=24,
    )
    b.panel(
        "Swap stage durations (p99)",
        [
            target(
                "histogram_quantile(0.99, sum by (le, stage) "
                f"(rate(sitsd_swap_stage_duration_seconds_bucket{{{m}}}[{RI}])))",
                "{{stage}}",
            )
        ],
        unit="s",
    )
    b.panel(
        "Swaps by outcome",
        [target(f"sum by (outcome) (increase(sitsd_swaps_total{{{m}}}[{RI}]))", "{{outcome}}")],
        type="barchart",
    )
    b.panel(
        "TTFT p99 around swaps",
        [target(f"tier:sitsd_time_to_first_token_seconds:p99_rate5m{{{SEL}}}", "{{tier}}")],
        unit="s",
    )
    b.panel(
        "Inter-token latency p99 around swaps",
        [target(f"tier:sitsd_inter_token_latency_seconds:p99_rate5m{{{SEL}}}", "{{tier}}")],
        unit="s",
    )
    b.panel(
        "Swap traces",
        [
            {
                "datasource": JAEGER,
                "queryType": "search",
                "service": "sitsd",
                "operation": "weights.swap",
                "refId": "A",
            }
        ],
        type="table",
        datasource=JAEGER,
        width=24,
    )
    return b


BOARDS = {
    "slo-overview": slo_overview,
    "latency": latency,
    "kv-cache": kv_cache,
    "hot-swap": hot_swap,
}


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        f"sitsd-{name}.json": json.dumps(make().json(), indent=2) + "\n"
        for name, make in BOARDS.items()
    }


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
