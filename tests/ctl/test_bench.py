"""`sitsctl bench` against the in-process fake-engine server: counts, percentiles, plot."""

from __future__ import annotations

import json

import pytest

from sitsd.ctl.bench_report import RequestRecord, percentile, summarize
from tests.api.harness import ADMIN_TOKEN

SMALL = ("--prompt-tokens", "8:20", "--max-tokens", "4:10", "--no-progress")


@pytest.fixture
def bench(run_ctl, ctl_env):
    env = {**ctl_env, "SITSD_ADMIN_TOKEN": ADMIN_TOKEN}

    def run(*args):
        result = run_ctl("bench", *args, env=env)
        assert result.returncode == 0, result.stderr
        return result

    return run


def check_percentiles_ordered(stats):
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        p50, p90, p99 = (stats[key][p] for p in ("p50", "p90", "p99"))
        assert p50 is not None
        assert p50 <= p90 <= p99, (key, stats[key])


def test_open_loop_run_reports_counts_that_add_up_and_ordered_percentiles(engine, bench):
    engine.completion = "abcdefghijklmnopqrstuvwxyz"
    report = json.loads(
        bench("--rate", "400", "--num-requests", "60", "--seed", "7", "--json", *SMALL).stdout
    )

    total, tiers = report["total"], report["tiers"]
    assert total["sent"] == 60 == sum(t["sent"] for t in tiers.values())
    assert len(engine.requests) == total["sent"] - total["refused"]
    for stats in [*tiers.values(), total]:
        assert stats["completed"] + sum(stats["failed"].values()) == stats["sent"]
        assert stats["good"] <= stats["completed"]
        if stats["completed"]:
            check_percentiles_ordered(stats)
    assert set(tiers) <= {"gold", "silver", "bronze"}
    assert report["settings"]["targets_from"] == "daemon"
    assert report["targets_ms"]["gold"] == [80.0, 80.0]  # the fake daemon's Admin.Status
    for recorded in engine.requests.values():
        assert 8 <= len(recorded.prompt_token_ids) <= 20
        assert 4 <= recorded.params.max_tokens <= 10
        assert recorded.params.ignore_eos
        assert recorded.tier is not None


def test_refusals_are_counted_by_status_per_tier(engine, bench):
    engine.refuse_with = "overloaded: test"
    report = json.loads(
        bench("--concurrency", "3", "--num-requests", "12", "--json", *SMALL).stdout
    )
    assert report["total"]["refused"] == 12
    assert report["total"]["failed"] == {"RESOURCE_EXHAUSTED": 12}
    assert report["total"]["completed"] == report["total"]["good"] == 0
    assert sum(t["refused"] for t in report["tiers"].values()) == 12


def test_same_seed_sends_the_same_requests(engine, bench):
    bench("--concurrency", "1", "--num-requests", "5", "--seed", "11", *SMALL)
    first = [(r.prompt_token_ids, r.params.max_tokens, r.tier) for r in engine.requests.values()]
    engine.requests.clear()
    bench("--concurrency", "1", "--num-requests", "5", "--seed", "11", *SMALL)
    again = [(r.prompt_token_ids, r.params.max_tokens, r.tier) for r in engine.requests.values()]
    assert first == again


def test_table_plot_and_progress_bar(engine, run_ctl, ctl_env, tmp_path):
    plot = tmp_path / "latency.png"
    env = {**ctl_env, "SITSD_ADMIN_TOKEN": ADMIN_TOKEN}
    result = run_ctl(
        "bench",
        "--rate",
        "300",
        "--num-requests",
        "30",
        "--plot",
        str(plot),
        "--prompt-tokens",
        "8:20",
        "--max-tokens",
        "4:10",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines()]
    assert rows[0] == "tier"
    assert "total" in rows
    assert "30/30" in result.stderr  # tqdm's bar
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 10_000


def test_goodput_judges_each_request_by_its_own_tier_targets():
    def record(tier, ttft, gaps, status="OK"):
        times = [ttft]
        for gap in gaps:
            times.append(times[-1] + gap)
        return RequestRecord(tier, 10, 5, 0.0, status, ttft, times[-1], times, len(times))

    records = [
        record("gold", 0.05, [0.05, 0.07]),  # good
        record("gold", 0.09, [0.01]),  # TTFT over 80 ms
        record("gold", 0.01, [0.2, 0.01]),  # mean ITL 105 ms over 80 ms
        record("bronze", 0.9, [0.5]),  # good for bronze
        record("bronze", 0.1, [], status="RESOURCE_EXHAUSTED"),
    ]
    targets = {"gold": (0.08, 0.08), "silver": (0.2, 0.2), "bronze": (1.0, 1.0)}
    report = summarize(records, duration_s=2.0, targets=targets, settings={})
    assert report["tiers"]["gold"]["good"] == 1
    assert report["tiers"]["bronze"]["good"] == 1
    assert report["tiers"]["bronze"]["refused"] == 1
    assert report["total"]["goodput_rps"] == 1.0
    assert report["tiers"]["gold"]["ttft_ms"]["p50"] == 50.0
    assert percentile([3, 1, 2], 50) == 2
