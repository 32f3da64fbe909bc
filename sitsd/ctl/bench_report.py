"""What `sitsctl bench` measured, summarised: per-tier percentiles, goodput, refusals, plots.

Input: one `RequestRecord` per request sent (times relative to the start of the run, in
seconds). Output: a JSON-ready dict (`summarize`), a text table (`format_report`) and a PNG of
latency percentiles over time per tier (`plot_reports`, matplotlib). Sending requests is
`sitsd.ctl.bench`'s business.

Goodput counts requests that completed and met their tier's targets: TTFT at most the tier's
TTFT target and mean inter-token latency at most its inter-token target (the per-request form
of the P99 targets, as in vLLM's and DistServe's goodput).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TIERS = ("gold", "silver", "bronze")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Draw:
    """One request of the plan, before it is sent (whatever the protocol)."""

    tier: str
    num_prompt_tokens: int
    max_tokens: int
    start: int  # where in the corpus the prompt starts


@dataclass
class RequestRecord:
    """One request of the run; times in seconds since the run started."""

    tier: str
    num_prompt_tokens: int
    max_tokens: int
    sent_at: float
    status: str = ""  # "OK" or a gRPC status code name; "" while in flight
    first_token_at: float | None = None
    ended_at: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival time of each token
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def e2e(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.sent_at

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def met_targets(self, ttft_target_s: float, itl_target_s: float) -> bool:
        """Completed, with TTFT and mean inter-token latency within the targets."""
        if self.status != "OK" or self.ttft is None or self.ttft > ttft_target_s:
            return False
        itls = self.itls
        return not itls or sum(itls) / len(itls) <= itl_target_s


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (the daemon's estimator uses the same rule); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def _percentiles_ms(values: Sequence[float]) -> dict[str, float | None]:
    out = {}
    for p in PERCENTILES:
        value = percentile(values, p)
        out[f"p{p}"] = None if value is None else round(value * 1000, 2)
    return out


def _group_stats(
    records: Sequence[RequestRecord], duration_s: float, targets: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    ok = [r for r in records if r.status == "OK"]
    statuses: dict[str, int] = {}
    for r in records:
        if r.status != "OK":
            statuses[r.status or "UNFINISHED"] = statuses.get(r.status or "UNFINISHED", 0) + 1
    good = sum(1 for r in ok if r.met_targets(*targets[r.tier]))
    output_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "sent": len(records),
        "completed": len(ok),
        "refused": statuses.get("RESOURCE_EXHAUSTED", 0),
        "failed": statuses,  # every non-OK ending by status, refusals included
        "good": good,
        "output_tokens": output_tokens,
        "ttft_ms": _percentiles_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _percentiles_ms([x for r in ok for x in r.itls]),
        "e2e_ms": _percentiles_ms([r.e2e for r in ok if r.e2e is not None]),
        "throughput_rps": round(len(ok) / duration_s, 3) if duration_s else 0.0,
        "output_tokens_per_s": round(output_tokens / duration_s, 1) if duration_s else 0.0,
        "goodput_rps": round(good / duration_s, 3) if duration_s else 0.0,
    }


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    targets: dict[str, tuple[float, float]],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The run's report: settings, per-tier and total statistics, and a latency timeline.

    Args:
        records: every request sent.
        duration_s: wall time from the first request sent to the last one ended.
        targets: tier -> (TTFT target, inter-token target), in seconds.
        settings: what the run was asked to do (echoed in the report).
    """
    per_tier = {
        tier: _group_stats([r for r in records if r.tier == tier], duration_s, targets)
        for tier in TIERS
        if any(r.tier == tier for r in records)
    }
    return {
        "settings": settings,
        "duration_s": round(duration_s, 3),
        "targets_ms": {
            t: [round(a * 1000, 1), round(b * 1000, 1)] for t, (a, b) in targets.items()
        },
        "tiers": per_tier,
        "total": _group_stats(records, duration_s, targets),
        "timeline": timeline(records, duration_s),
    }


def timeline(records: Sequence[RequestRecord], duration_s: float) -> dict[str, list[list[float]]]:
    """Per tier, `[t_mid, ttft_p50, ttft_p99, itl_p99, n]` (ms) over bins of completion time."""
    bin_s = max(1.0, duration_s / 30)
    num_bins = max(1, math.ceil(duration_s / bin_s))
    out: dict[str, list[list[float]]] = {}
    for tier in TIERS:
        ended = [
            (r.ended_at, r)
            for r in records
            if r.tier == tier and r.status == "OK" and r.ended_at is not None
        ]
        rows = []
        for i in range(num_bins):
            in_bin = [r for at, r in ended if i * bin_s <= at < (i + 1) * bin_s]
            if not in_bin:
                continue
            ttfts = [r.ttft for r in in_bin if r.ttft is not None]
            itls = [x for r in in_bin for x in r.itls]
            rows.append(
                [
                    round((i + 0.5) * bin_s, 2),
                    round((percentile(ttfts, 50) or 0) * 1000, 1),
                    round((percentile(ttfts, 99) or 0) * 1000, 1),
                    round((percentile(itls, 99) or 0) * 1000, 1),
                    len(in_bin),
                ]
            )
        if rows:
            out[tier] = rows
    return out


def _ms(value: object) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table: one row per tier and a total row."""
    header = (
        f"{'tier':<7}{'sent':>6}{'ok':>6}{'refused':>8}{'other':>6}"
        f"{'TTFT p50/p90/p99 ms':>22}{'ITL p50/p90/p99 ms':>21}{'E2E p50/p90/p99 ms':>22}"
        f"{'req/s':>7}{'good':>6}{'goodput/s':>10}"
    )
    lines = [header]
    rows = [*report["tiers"].items(), ("total", report["total"])]
    for name, s in rows:
        other = sum(s["failed"].values()) - s["refused"]
        triple = {
            k: "/".join(_ms(s[k][f"p{p}"]) for p in PERCENTILES)
            for k in ("ttft_ms", "itl_ms", "e2e_ms")
        }
        lines.append(
            f"{name:<7}{s['sent']:>6}{s['completed']:>6}{s['refused']:>8}{other:>6}"
            f"{triple['ttft_ms']:>22}{triple['itl_ms']:>21}{triple['e2e_ms']:>22}"
            f"{s['throughput_rps']:>7.2f}{s['good']:>6}{s['goodput_rps']:>10.2f}"
        )
    tokens_per_s = report["total"]["output_tokens_per_s"]
    targets = ", ".join(f"{t} {a:.0f}/{b:.0f} ms" for t, (a, b) in report["targets_ms"].items())
    lines.append(
        f"duration {report['duration_s']:.1f} s, {tokens_per_s:.0f} output tokens/s; good = "
        f"completed within its tier's TTFT and mean inter-token targets ({targets})"
    )
    return "\n".join(lines)


def plot_reports(reports: Sequence[tuple[str, dict[str, Any]]], path: str) -> None:
    """Draw TTFT P99 and ITL P99 over time per tier, one column per report, into a PNG.

    Raises:
        RuntimeError: matplotlib is not installed (`pip install 'sitsd[bench]'`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'sitsd[bench]'") from None
    colors = {"gold": "#c9a227", "silver": "#7f8c8d", "bronze": "#a0522d"}
    fig, axes = plt.subplots(2, len(reports), figsize=(6 * len(reports), 7), squeeze=False)
    for col, (label, report) in enumerate(reports):
        targets = report["targets_ms"]
        for row, (index, name) in enumerate(((2, "TTFT P99"), (3, "inter-token P99"))):
            ax = axes[row][col]
            for tier, rows in report["timeline"].items():
                ax.plot(
                    [r[0] for r in rows],
                    [r[index] for r in rows],
                    marker="o",
                    ms=3,
                    color=colors[tier],
                    label=tier,
                )
                ax.axhline(targets[tier][row], color=colors[tier], ls="--", lw=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{label}: {name} (ms; dashed = target)")
            ax.set_xlabel("time since start (s), by completion")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
