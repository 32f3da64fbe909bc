"""Writes deploy/prometheus/rules/sitsd-slo.rules.yml: the SLO rules, from the scheduler's tiers.

    python scripts/build_slo_rules.py                  # the shipped rules, from the defaults
    python scripts/build_slo_rules.py --tiers FILE -o rules.yml   # a daemon's own --tiers file

Each tier's TTFT objective is its scheduler target (`sitsd.config.TiersConfig`, or the tiers
file the daemon runs with): one source for what the scheduler aims at and what the SLO counts,
so the two cannot disagree. A target must be a bucket boundary of
`sitsd_time_to_first_token_seconds` (`sitsd.observability.metrics.TTFT_BUCKETS`), or the
ratio read at it would not be exact: this script refuses one that is not. A test checks that
the shipped file is what this script writes (`tests/deploy`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prometheus_client.utils import floatToGoString

from sitsd.config import TiersConfig
from sitsd.observability.metrics import TTFT_BUCKETS
from sitsd.tiers_file import load_tiers_file
from sitsd.types import TIER_ORDER

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "rules"
OUT = RULES / "sitsd-slo.rules.yml"
WINDOWS = ("5m", "30m", "1h", "6h", "3d", "30d")  # the SLI windows; 30d: the budget's
OBJECTIVE_ERRORS = "0.01"  # 99% of requests: an error budget of 1%
SERVER_ERRORS = "internal|unavailable|resource_exhausted|deadline"
GENERATE = 'method="Inference/Generate"'
# (name suffix, long window, short window, burn rate, for, severity, days the budget lasts)
BURN_ALERTS = (
    ("Critical", "1h", "5m", "14.4", "2m", "page", "2.08"),
    ("High", "6h", "30m", "6", "15m", "page", "5"),
    ("Low", "3d", "6h", "1", "1h", "ticket", "30"),
)
RUNBOOK = "README.md#a-slow-request-from-the-alert-to-its-trace-and-logs"


def ttft_targets(tiers: TiersConfig) -> dict[str, str]:
    """Each tier's TTFT target as the histogram's `le` label writes it.

    Raises:
        ValueError: a target is not a bucket boundary of the TTFT histogram.
    """
    targets = {}
    for tier in TIER_ORDER:
        target = tiers.tier(tier.value).ttft_p99_s
        if target not in TTFT_BUCKETS:
            raise ValueError(
                f"the {tier.value} tier's TTFT target {target} s is not a bucket boundary of "
                f"sitsd_time_to_first_token_seconds ({', '.join(map(str, TTFT_BUCKETS))})"
            )
        targets[tier.value] = floatToGoString(target)
    return targets


def render(tiers: TiersConfig) -> str:
    """The rules file for `tiers` (see the module docstring)."""
    targets = ttft_targets(tiers)
    named = ", ".join(f"{tier} {float(le):g} s" for tier, le in targets.items())
    header = f"""\
# sitsd SLO rules: SLIs per tier as recording rules, multiwindow multi-burn-rate alerts.
# Written by scripts/build_slo_rules.py from the scheduler's tier targets: edit those, not this.
#
# SLOs (objective 99% of requests, i.e. an error budget of 1%, per tier):
#   - TTFT: a request is good when its time to first token is within its tier's target
#     ({named}: the scheduler's targets, bucket boundaries of the
#     histogram, so exact);
#   - availability: a Generate call is bad when it fails for the server's reasons
#     (internal, unavailable, resource_exhausted, deadline); client errors do not count.
# Alerts follow the SRE Workbook (table 5-8): page at 14.4x burn over 1h and 5m, page at 6x
# over 6h and 30m, ticket at 1x over 3d and 6h. Names: level:metric:operations, where the level
# `tier` means "by model and tier". Unit tests: ../tests/sitsd-slo.rules.test.yml.
groups:
  - name: sitsd-slo-sli
    rules:
"""
    parts = [header, *(_ttft_sli(targets, w) for w in WINDOWS)]
    parts += [_availability_sli(w) for w in WINDOWS]
    parts.append(_budgets())
    parts.append(LATENCY_GROUP)
    parts.append("  - name: sitsd-slo-alerts\n    rules:\n")
    parts += [_burn_alert("ttft", "TTFT", a) for a in BURN_ALERTS]
    parts += [_burn_alert("availability", "Availability", a) for a in BURN_ALERTS]
    parts.append(DOWN_ALERT)
    return "".join(parts)


def _ttft_sli(targets: dict[str, str], window: str) -> str:
    metric = "sitsd_time_to_first_token_seconds"
    good = "\n          or\n".join(
        f'          sum by (model, tier) (rate({metric}_bucket{{tier="{tier}", le="{le}"}}'
        f"[{window}]))"
        for tier, le in targets.items()
    )
    return f"""\
      - record: tier:sitsd_ttft_slo_errors:ratio_rate{window}
        expr: |
          1 - (
{good}
          )
          / sum by (model, tier) (rate({metric}_count[{window}]))
"""


def _availability_sli(window: str) -> str:
    errors = f'sitsd_request_errors_total{{{GENERATE}, error_class=~"{SERVER_ERRORS}"}}'
    calls = f"sitsd_requests_total{{{GENERATE}}}"
    return f"""\
      - record: tier:sitsd_availability_slo_errors:ratio_rate{window}
        expr: |
          (
            sum by (model, tier) (rate({errors}[{window}]))
            or
            0 * sum by (model, tier) (rate({calls}[{window}]))
          )
          / sum by (model, tier) (rate({calls}[{window}]))
"""


def _budgets() -> str:
    return "".join(
        f"""\
      - record: tier:sitsd_{slo}_slo_error_budget:remaining_30d
        expr: 1 - tier:sitsd_{slo}_slo_errors:ratio_rate30d / {OBJECTIVE_ERRORS}
"""
        for slo in ("ttft", "availability")
    )


def _burn_alert(slo: str, title: str, alert: tuple[str, ...]) -> str:
    suffix, long_window, short_window, burn, wait, severity, days = alert
    what = (
        "of requests over their tier's time-to-first-token target"
        if slo == "ttft"
        else "of Generate calls failing for server-side reasons"
    )
    return f"""\
      - alert: Sitsd{title}BudgetBurn{suffix}
        expr: |
          tier:sitsd_{slo}_slo_errors:ratio_rate{long_window} > ({burn} * {OBJECTIVE_ERRORS})
          and
          tier:sitsd_{slo}_slo_errors:ratio_rate{short_window} > ({burn} * {OBJECTIVE_ERRORS})
        for: {wait}
        labels:
          severity: {severity}
          slo: {slo}
        annotations:
          summary: "sitsd {{{{ $labels.tier }}}} tier burns its {slo} error budget {burn}x too fast"
          description: >-
            {{{{ $value | humanizePercentage }}}} {what} over the last {long_window}
            (tier {{{{ $labels.tier }}}}, model {{{{ $labels.model }}}}); the objective allows 1%.
            At this rate the 30-day budget lasts {days} days.
          dashboard: /d/sitsd-slo/sitsd-slo-overview?var-tier={{{{ $labels.tier }}}}
          runbook: {RUNBOOK}
"""


def _quantiles() -> str:
    out = []
    for metric in ("time_to_first_token", "inter_token_latency", "e2e_request_latency",
                   "request_queue_time"):  # fmt: skip
        for q, name in (("0.5", "p50"), ("0.99", "p99")):
            out.append(
                f"      - record: tier:sitsd_{metric}_seconds:{name}_rate5m\n"
                f"        expr: histogram_quantile({q}, sum by (le, model, tier) "
                f"(rate(sitsd_{metric}_seconds_bucket[5m])))\n"
            )
    return "".join(out)


def _ratio(record: str, by: str, numerator: str, denominator: str) -> str:
    return (
        f"      - record: {record}\n"
        f"        expr: sum by ({by}) (rate({numerator}[5m])) / sum by ({by}) "
        f"(rate({denominator}[5m]))\n"
    )


LATENCY_GROUP = (
    "  - name: sitsd-latency\n    rules:\n"
    + _quantiles()
    + _ratio("model:sitsd_batch_size:avg_rate5m", "model", "sitsd_batch_size_sum",
             "sitsd_batch_size_count")
    + _ratio("tier:sitsd_prefix_cache_hit:ratio_rate5m", "model, tier",
             "sitsd_prefix_cache_hits_total", "sitsd_prefix_cache_queries_total")
)  # fmt: skip
DOWN_ALERT = """\
      - alert: SitsdDown
        expr: up{job="sitsd"} == 0
        for: 2m
        labels:
          severity: page
        annotations:
          summary: "sitsd {{ $labels.instance }} is not scraped"
          description: "Prometheus cannot scrape {{ $labels.instance }} for 2 minutes."
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", help="a --tiers file (default: the scheduler's defaults)")
    parser.add_argument("-o", "--output", default=str(OUT), help=f"default: {OUT}")
    args = parser.parse_args(argv)
    tiers = load_tiers_file(args.tiers) if args.tiers else TiersConfig()
    try:
        text = render(tiers)
    except ValueError as exc:
        print(f"build_slo_rules: {exc}", file=sys.stderr)
        return 1
    Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
