"""`sitsctl status`: the daemon's state, requests, KV cache, weights version, tiers (Admin.Status).

Human-readable by default, `--json` for scripts. Needs the admin token (`sitsd.ctl.client`).
"""

from __future__ import annotations

import argparse

from sitsd.api.v1 import admin_pb2
from sitsd.ctl.client import Client, to_json


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "status",
        help="show the daemon's state (needs the admin token)",
        description="Show the daemon's state (Admin.Status).",
    )
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    parser.set_defaults(run=run_status)


def run_status(args: argparse.Namespace, client: Client) -> int:
    response = client.admin.Status(
        admin_pb2.StatusRequest(), metadata=client.admin_metadata(), timeout=client.unary_timeout
    )
    if args.json:
        print(to_json(response))
    else:
        print(format_status(response))
    return 0


def _weights(precision: str, nbytes: int) -> str:
    """`int4-g128; lm_head bf16, embedding bf16 (117.2 MiB)`, or "-" when unknown."""
    return f"{precision} ({nbytes / 2**20:.1f} MiB)" if precision else "-"


def format_status(status: admin_pb2.StatusResponse) -> str:
    """The status as aligned `name  value` lines."""
    state = admin_pb2.DaemonState.Name(status.state).removeprefix("DAEMON_STATE_").lower()
    used, total = status.num_blocks_used, status.num_blocks_total
    queries, hits = status.prefix_cache_queries, status.prefix_cache_hits
    rows = [
        ("state", state),
        ("model", status.model or "-"),
        ("weights version", status.weights_version or "-"),
        ("weights", _weights(status.weights_precision, status.weight_bytes)),
        ("requests", f"{status.num_running} running, {status.num_waiting} waiting"),
        (
            "kv cache",
            f"{used}/{total} blocks used ({_percent(used, total)}), "
            f"{status.block_size} tokens per block",
        ),
        ("prefix cache", f"{hits}/{queries} prompt tokens hit ({_percent(hits, queries)})"),
        ("preemptions", str(status.num_preemptions)),
        ("scheduling", status.scheduling_policy or "-"),
        *(_tier_row(tier) for tier in status.tiers),
        *_push_rows(status.weight_push),
        ("engine steps", str(status.num_steps)),
        ("uptime", _duration(status.uptime_s)),
        ("sitsd version", status.version),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _tier_row(tier: admin_pb2.TierStatus) -> tuple[str, str]:
    """`tier gold  cap 32, 1 running, 0 waiting, TTFT P99 95/80 ms, ITL P99 41/80 ms, ...`."""

    def p99(field: str, target_s: float) -> str:
        value = f"{getattr(tier, field) * 1000:.0f}" if tier.HasField(field) else "-"
        return f"{value}/{target_s * 1000:.0f} ms"

    return (
        f"tier {tier.tier}",
        f"cap {tier.batch_cap}, {tier.num_running} running, {tier.num_waiting} waiting, "
        f"TTFT P99 {p99('ttft_p99_s', tier.ttft_p99_target_s)}, "
        f"ITL P99 {p99('itl_p99_s', tier.itl_p99_target_s)}, "
        f"refused {tier.num_refused}, shed {tier.num_shed}, preempted {tier.num_preempted}",
    )


def _push_rows(push: admin_pb2.WeightPushStatus) -> list[tuple[str, str]]:
    """`last weight push  step-9 over grpc: committed in 3.41 s (receive 2.9 s, ...)`."""
    if not push.HasField("last_update"):
        return []
    u = push.last_update
    stages = ", ".join(f"{name} {getattr(u, name + '_s'):.2f} s"
                       for name in ("receive", "validate", "canary", "commit"))  # fmt: skip
    outcome = f"{u.outcome}: {u.message}" if u.message else u.outcome
    pause = f", pause {u.pause_ms:.2f} ms" if u.outcome == "committed" else ""
    return [("last weight push", f"{u.version} over {u.transport}: {outcome} in {u.total_s:.2f} s "
                                 f"({stages}{pause})")]  # fmt: skip


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    return f"{minutes}m {secs}s" if minutes else f"{seconds:.1f}s"
