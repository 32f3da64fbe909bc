"""Overload benchmark: SLA tiers vs FCFS on the real daemon, same offered load, same seed.

1. Capacity: start `sitsd serve --scheduling-policy fcfs` and saturate it with
   `sitsctl bench --concurrency <max-num-seqs>`: the requests/s it completes is its capacity
   for these length distributions.
2. Offer `--overload` (2x) that rate as Poisson arrivals with the tier mix 20% gold / 30% silver
   / 50% bronze, once with `--scheduling-policy fcfs` and once with `tiers` (a fresh daemon
   each, same `--seed`, so the same requests arrive at the same times).
3. Print per tier: TTFT P99 against its target, goodput (requests that met their tier's TTFT
   and mean inter-token targets), refusals; and total goodput. Draw both runs' latency
   percentiles over time into one PNG.

Goodput and targets come from `--tiers` (default `bench/tiers-cpu.yaml`, the SITS table scaled
to this CPU, see that file). Never part of the test run; it takes about 3-4 minutes.

    .venv/bin/python -m bench.bench_tiers [--duration 60] [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.daemon import BenchDaemon, bucket_quantile
from sitsd.ctl.bench_report import plot_reports

REPO_ROOT = Path(__file__).resolve().parents[1]


def start(state_dir: str, policy: str, serve: list[str]) -> BenchDaemon:
    daemon = BenchDaemon(Path(state_dir), ["--scheduling-policy", policy, *serve])
    return daemon.wait_until_serving()


def sitsctl_bench(daemon: BenchDaemon, args: list[str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "sitsd.ctl", "--address", daemon.address, "bench", "--json", *args],
        env=daemon.env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"sitsctl bench failed:\n{result.stderr}")
    return json.loads(result.stdout)


def on_off(flag: str, value: bool | None) -> list[str]:
    """A boolean flag passed on to the daemon: [flag], [--no-flag], or [] (its default)."""
    if value is None:
        return []
    return [flag] if value else [f"--no-{flag.removeprefix('--')}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of offered load")
    parser.add_argument("--capacity-duration", type=float, default=30.0)
    parser.add_argument(
        "--capacity",
        type=float,
        default=0.0,
        help="skip the capacity run and use this many requests/s",
    )
    parser.add_argument("--overload", type=float, default=2.0, help="offered load / capacity")
    parser.add_argument(
        "--tiers",
        default=str(REPO_ROOT / "bench" / "tiers-cpu.yaml"),
        help="tiers file; 'builtin' = the daemon's default (the SITS table, GPU targets)",
    )
    parser.add_argument("--model", default="default", help="the daemon's --model")
    parser.add_argument("--device", default="cpu", help="the daemon's --device")
    parser.add_argument("--prompt-tokens", default="32:128")
    parser.add_argument("--max-tokens", default="16:64")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    for flag in ("--mixed-graphs", "--async-scheduling"):  # CUDA; default: the daemon's
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                            help=f"the daemon's {flag} (default: the daemon's)")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=60.0, help="gRPC deadline per request")
    parser.add_argument(
        "--policies",
        default="fcfs,tiers",
        help="which policies to run, comma-separated (default: both; one alone re-measures it "
        "against an earlier run of the same seed and --capacity)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = ["--prompt-tokens", args.prompt_tokens, "--max-tokens", args.max_tokens]
    tiers = [] if args.tiers == "builtin" else ["--tiers", args.tiers]
    serve = [
        *tiers,
        "--model",
        args.model,
        "--device",
        args.device,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        *on_off("--mixed-graphs", args.mixed_graphs),
        *on_off("--async-scheduling", args.async_scheduling),
    ]
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as state_dir:
        capacity = args.capacity
        if not capacity:
            daemon = start(state_dir, "fcfs", serve)
            try:
                saturated = sitsctl_bench(
                    daemon,
                    [
                        "--concurrency",
                        str(args.max_num_seqs),
                        "--duration",
                        str(args.capacity_duration),
                        "--no-progress",
                        "--seed",
                        str(args.seed),
                        *tiers,
                        *lengths,
                    ],
                )
            finally:
                daemon.stop()
            capacity = saturated["total"]["throughput_rps"]
        rate = args.overload * capacity
        print(f"capacity {capacity:.2f} req/s; offering {rate:.2f} req/s", flush=True)
        reports = {}
        policies = [p for p in ("fcfs", "tiers") if p in args.policies.split(",")]
        for policy in policies:
            daemon = start(state_dir, policy, serve)
            try:
                before = daemon_histograms(daemon)
                reports[policy] = sitsctl_bench(
                    daemon,
                    [
                        "--rate",
                        f"{rate:.3f}",
                        "--duration",
                        str(args.duration),
                        "--seed",
                        str(args.seed),
                        *tiers,
                        "--deadline",
                        str(args.deadline),
                        "--no-progress",
                        *lengths,
                    ],
                )
                reports[policy]["daemon"] = daemon_side(daemon, before)
            finally:
                daemon.stop()
            (out / f"{policy}.json").write_text(json.dumps(reports[policy], indent=2))
            print(f"{policy}: done, load average {os.getloadavg()[0]:.2f}", flush=True)
    plot_reports([(p, reports[p]) for p in policies], str(out / "tiers-overload.png"))
    print(comparison_table(reports, capacity, rate))
    for policy in policies:
        d = reports[policy]["daemon"]
        ttft = ", ".join(f"{t} {ms(v)}" for t, v in sorted(d["ttft_p99_s"].items()))
        print(f"daemon side, {policy} (histogram buckets' upper bounds, ms): TTFT P99 {ttft}; "
              f"step P99 {ms(d['step_p99_s'])}; event-loop lag P99 {ms(d['loop_lag_p99_s'])}, "
              f"max {ms(d['loop_lag_max_s'])}")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}; plot: {out / 'tiers-overload.png'}")
    return 0


DAEMON_HISTOGRAMS = {  # what bench_tiers reads back: key -> (histogram, label)
    "ttft": ("sitsd_time_to_first_token_seconds", "tier"),
    "step": ("sitsd_step_duration_seconds", ""),
    "loop_lag": ("sitsd_event_loop_lag_seconds", ""),
}


def daemon_histograms(daemon: BenchDaemon) -> dict:
    return {key: daemon.histograms(*spec) for key, spec in DAEMON_HISTOGRAMS.items()}


def daemon_side(daemon: BenchDaemon, before: dict) -> dict:
    """What the daemon measured itself during the load, beside what the client saw: its TTFT
    (arrival at the API to the first token, before delivery) P99 per tier, the step time and
    the event-loop lag, each the upper bound of its histogram bucket (seconds)."""
    after = daemon_histograms(daemon)

    def quantile(key: str, q: float) -> dict[str, float | None]:
        return {label: bucket_quantile(rows, q, before[key].get(label))
                for label, rows in after[key].items()}  # fmt: skip

    return {
        "ttft_p99_s": quantile("ttft", 0.99),
        "step_p99_s": quantile("step", 0.99).get(""),
        "loop_lag_p99_s": quantile("loop_lag", 0.99).get(""),
        "loop_lag_max_s": quantile("loop_lag", 1.0).get(""),
    }


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def comparison_table(reports: dict[str, dict], capacity: float, rate: float) -> str:
    """Per tier and policy: TTFT P99 vs target, goodput, refusals; then the totals."""
    targets = next(iter(reports.values()))["targets_ms"]
    lines = [
        f"offered {rate:.2f} req/s = {rate / capacity:.1f} x capacity {capacity:.2f} req/s",
        f"{'tier':<8}{'policy':<7}{'sent':>6}{'done':>6}{'refused':>8}{'other':>6}"
        f"{'TTFT p99 ms':>12}{'target':>8}{'met':>5}{'good':>6}{'goodput/s':>10}",
    ]
    for tier in ("gold", "silver", "bronze", "total"):
        for policy in reports:
            r = reports[policy]
            s = r["total"] if tier == "total" else r["tiers"].get(tier)
            if s is None:
                continue
            p99 = s["ttft_ms"]["p99"]
            target = targets[tier][0] if tier != "total" else None
            met = "-" if target is None or p99 is None else ("yes" if p99 <= target else "NO")
            other = sum(s["failed"].values()) - s["refused"]
            lines.append(
                f"{tier:<8}{policy:<7}{s['sent']:>6}{s['completed']:>6}{s['refused']:>8}"
                f"{other:>6}{'-' if p99 is None else f'{p99:.0f}':>12}"
                f"{'' if target is None else f'{target:.0f}':>8}{met:>5}{s['good']:>6}"
                f"{s['goodput_rps']:>10.2f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
