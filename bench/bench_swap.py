"""Hot-swap benchmark: a weight swap on the real daemon under a steady streaming load.

1. Write two versions as Hugging Face directories with manifests: CPU: SmolLM2 (the embedded
   weights) and a copy with 1% relative noise; `--device cuda`: random bf16 weights in
   Llama-3-8B shapes and a copy with 1% relative noise (about 16 GB each on disk, under
   `--work-dir`).
2. Start `sitsd serve` on v1 (fcfs, two weight slots, a canary file) and keep `--clients`
   streaming greedy requests going (a new one as soon as one ends).
3. After `--steady` seconds, `Admin.Swap` to v2 (staged, validated, canary, committed with
   `--policy`); keep the load `--after` seconds more.
4. Report, from the client's token arrival times: inter-token latency P50/P99/max in steady
   state, while staging, and in the seconds around the commit (target: P99 within 1.5x of
   steady); from the daemon: the serving pause at the commit (the longest gap between two
   engine steps around the flip) and the flip itself, each stage's time (/metrics), the memory
   the second slot costs (the start-up log, and the daemon's RSS before and after staging on
   the CPU). The load average is printed before and after; a table comes last.

Never part of the test run; about 1 minute on the CPU.

    .venv/bin/python -m bench.bench_swap [--policy migrate] [--clients 8] [--json out.json]
    python3 -m bench.bench_swap --device cuda --work-dir /scratch/swap   # the GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from bench.daemon import BenchDaemon
from bench.shapes import LLAMA3_8B, SMOLLM2
from bench.timing import now, percentile
from sitsd.api.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    inference_pb2_grpc,
)
from sitsd.api.v1 import inference_pb2 as pb

SLOT_COST = re.compile(r"the standby slot costs (\d+) MiB")
TYPICAL_GAP = re.compile(r"steps are ([\d.]+) ms apart otherwise")
STAGES = ("verify", "validate", "stage", "canary", "commit", "pause")
CANARY = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colours are",
]


# ------------------------------------------------------------------------------- versions


def write_cpu_versions(work: Path) -> tuple[Path, Path]:
    from sitsd.weights import load_checkpoint, resolve_model_path
    from sitsd.weights.export import perturbed, write_version

    ckpt = load_checkpoint(resolve_model_path("default"))
    write_version(ckpt, work / "v1")
    write_version(ckpt, work / "v2", perturbed(ckpt.tensors, 0.01, seed=1))
    return work / "v1", work / "v2"


def write_gpu_versions(work: Path) -> tuple[Path, Path]:
    """Random bf16 weights in Llama-3-8B shapes (about 16 GB each on disk), generated on the GPU:
    v1, and v2 = v1 with 1% relative noise; written once (reused when their manifests exist)."""
    from bench.make_random_model import write
    from sitsd.weights.manifest import write_manifest

    for name, noise in (("v1", 0.0), ("v2", 0.01)):
        if not (work / name / "manifest.json").exists():
            started = now()
            write(work / name, "llama-3-8b", seed=0, noise=noise)
            write_manifest(work / name, workers=8)
            print(f"wrote {name} in {now() - started:.0f} s", flush=True)
    return work / "v1", work / "v2"


# --------------------------------------------------------------------------------- daemon


class Daemon(BenchDaemon):
    """The bench's daemon: its log in `work/daemon.log`, state in `work/state`."""

    def __init__(self, work: Path, flags: list[str]) -> None:
        super().__init__(work / "state", flags, log_path=work / "daemon.log")

    def stage_seconds(self) -> dict[str, float]:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        found = {}
        for stage in STAGES:
            m = re.search(
                rf'sitsd_swap_stage_duration_seconds_sum{{[^}}]*stage="{stage}"[^}}]*}}'
                rf" (\S+)",
                text,
            )
            if m:
                found[stage] = float(m.group(1))
        return found


# ----------------------------------------------------------------------------------- load


class Load:
    """`clients` streaming greedy requests, one after another each; token arrival times."""

    def __init__(self, address: str, prompts: list[list[int]], clients: int, seed: int) -> None:
        self.address, self.prompts, self.clients = address, prompts, clients
        self.rng = random.Random(seed)
        self.streams: list[list[float]] = []  # token arrival times (`bench.timing.now`) per request
        self.failed = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            await asyncio.gather(*(self._client(stub) for _ in range(self.clients)))

    async def _client(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        while not self.stop_event.is_set():
            times: list[float] = []
            self.streams.append(times)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=self.rng.choice(self.prompts)),
                ignore_eos=True,
                sampling=pb.SamplingParams(max_tokens=self.rng.randint(64, 128), temperature=0),
            )
            try:
                async for response in stub.Generate(request, timeout=600):
                    times += [now()] * len(response.token_ids)
            except grpc.aio.AioRpcError:
                self.failed += 1

    def itls(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive tokens of a request, for tokens arriving in [start, end)."""
        streams = list(self.streams)
        return [b - a for s in streams for a, b in itertools.pairwise(s) if start <= b < end]


def percentiles(values: list[float]) -> dict[str, float]:
    """Count, P50 and P99 (nearest rank) and max of `values` seconds, in milliseconds."""
    if len(values) < 2:
        return {"n": len(values), "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": 0}
    return {
        "n": len(values),
        "p50_ms": percentile(values, 50) * 1e3,
        "p99_ms": percentile(values, 99) * 1e3,
        "max_ms": max(values) * 1e3,
    }


# ----------------------------------------------------------------------------------- main


def daemon_flags(args: argparse.Namespace, work: Path, v1: Path) -> list[str]:
    flags = [
        "--model",
        str(v1),
        "--served-model-name",
        "bench",
        "--device",
        args.device,
        "--scheduling-policy",
        "fcfs",
        "--max-num-seqs",
        str(2 * args.clients),
        "--weight-slots",
        "2",
        "--swap-policy",
        args.policy,
    ]
    if args.staging_cpu_share is not None:
        flags += ["--staging-cpu-share", str(args.staging_cpu_share)]
    if args.migration_tokens_per_step is not None:
        flags += ["--migration-tokens-per-step", str(args.migration_tokens_per_step)]
    if args.canary:
        (work / "canary.txt").write_text("\n".join(CANARY) + "\n")
        flags += ["--canary-file", str(work / "canary.txt"), "--canary-max-kl", "5"]
    return flags + (["--kv-cache-memory", "256MiB"] if args.device == "cpu" else [])


def deploy_and_swap(daemon: Daemon, v2: Path, after_s: float) -> dict:
    """Deploy v2 (timing each stage's start), wait a second, swap to it; the marks."""
    stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(daemon.address))
    metadata = [("authorization", f"Bearer {daemon.token()}")]
    marks: dict = {"deploy": now(), "rss_before": daemon.rss_mib(), "stages": {}}
    request = admin_pb2.DeployRequest(path=str(v2), version="v2")
    for progress in stub.Deploy(request, metadata=metadata, timeout=3600):
        marks["stages"].setdefault(progress.stage, now())
    assert progress.stage == "staged", progress
    marks["staged"], marks["rss_staged"] = now(), daemon.rss_mib()
    time.sleep(1.0)  # a second of plain load between staging and the commit
    marks["swap"] = now()
    swap = list(stub.Swap(admin_pb2.SwapRequest(version="v2"), metadata=metadata, timeout=3600))
    marks["committed"], marks["last"] = now(), swap[-1]
    assert marks["last"].stage == "committed", marks["last"]
    time.sleep(after_s)
    return marks


def run(args: argparse.Namespace, work: Path) -> dict:
    v1, v2 = write_gpu_versions(work) if args.device == "cuda" else write_cpu_versions(work)
    daemon = Daemon(work, daemon_flags(args, work, v1))
    try:
        daemon.wait_until_serving()
        slot_mib = float(SLOT_COST.search(daemon.log_text()).group(1))
        rng = random.Random(args.seed)
        vocab = (SMOLLM2 if args.device == "cpu" else LLAMA3_8B).vocab_size
        prompts = [
            [rng.randrange(3, vocab) for _ in range(rng.randint(32, 160))] for _ in range(32)
        ]
        load = Load(daemon.address, prompts, args.clients, args.seed)
        load.thread.start()
        time.sleep(args.warmup + args.steady)  # the load runs meanwhile; nothing is timed by this
        marks = deploy_and_swap(daemon, v2, args.after)
        load.stop_event.set()
        load.thread.join(600)
        stages = daemon.stage_seconds()
        gap = TYPICAL_GAP.search(daemon.log_text())
        marks["typical_gap_ms"] = float(gap.group(1)) if gap else float("nan")
    finally:
        daemon.stop()
    return summarize(args, load, marks, stages, slot_mib)


def summarize(
    args: argparse.Namespace, load: Load, marks: dict, stages: dict, slot_mib: float
) -> dict:
    steady = percentiles(load.itls(marks["deploy"] - args.steady, marks["deploy"]))
    staging = percentiles(load.itls(marks["deploy"], marks["staged"]))
    around = percentiles(load.itls(marks["swap"], marks["committed"] + args.window))
    bounds = [*sorted(marks["stages"].items(), key=lambda kv: kv[1]), ("", marks["staged"])]
    by_stage = {
        name: percentiles(load.itls(start, bounds[i + 1][1]))
        for i, (name, start) in enumerate(bounds[:-1])
        if name != "staged"
    }
    last = marks["last"]
    return {
        "device": args.device,
        "policy": args.policy,
        "clients": args.clients,
        "canary": args.canary,
        "failed_requests": load.failed,
        "requests": len(load.streams),
        "itl_steady": steady,
        "itl_staging": staging,
        "itl_by_stage": by_stage,
        "itl_around_commit": around,
        "p99_ratio_around_commit": around["p99_ms"] / steady["p99_ms"],
        "p99_ratio_staging": staging["p99_ms"] / steady["p99_ms"],
        "pause_ms": last.pause_ms,
        "flip_ms": last.flip_ms,
        "typical_gap_ms": marks["typical_gap_ms"],
        "num_migrating": last.num_migrating,
        "num_restarted": last.num_restarted,
        "num_draining": last.num_draining,
        "stage_s": stages,
        "second_slot_mib": slot_mib,
        "rss_growth_mib": marks["rss_staged"] - marks["rss_before"],
    }


def wait_for_quiet(max_load: float, timeout_s: float) -> float:
    """Wait (up to `timeout_s`) for the 1-minute load average to fall under `max_load`."""
    deadline = now() + timeout_s
    while os.getloadavg()[0] > max_load and now() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def table(r: dict, load_before: float, load_after: float) -> str:
    rows = [("measure", "value", "target")]
    for key, name in (
        ("itl_steady", "ITL steady"),
        ("itl_staging", "ITL while staging"),
        ("itl_around_commit", "ITL around the commit"),
    ):
        p = r[key]
        rows.append(
            (
                f"{name} P50 / P99 / max (n={p['n']})",
                f"{p['p50_ms']:.1f} / {p['p99_ms']:.1f} / {p['max_ms']:.1f} ms",
                "",
            )
        )
    rows += [
        ("P99 around the commit / steady", f"{r['p99_ratio_around_commit']:.2f}x", "<= 1.5x"),
        ("P99 while staging / steady", f"{r['p99_ratio_staging']:.2f}x", "<= 1.5x"),
        (
            "serving pause at the commit",
            f"{r['pause_ms']:.3f} ms",
            "< 1 ms (GPU)" if r["device"] == "cuda" else "",
        ),
        ("the step gap otherwise (median)", f"{r['typical_gap_ms']:.3f} ms", ""),
        ("the flip itself", f"{r['flip_ms']:.3f} ms", ""),
        (
            f"requests in flight ({r['policy']})",
            f"{r['num_migrating']} migrated, "
            f"{r['num_restarted']} restarted, {r['num_draining']} draining",
            "",
        ),
        *((f"stage {s}", f"{v * 1e3:.0f} ms", "") for s, v in r["stage_s"].items()),
        ("second weight slot", f"{r['second_slot_mib']:.0f} MiB", ""),
        ("daemon RSS growth while staging", f"{r['rss_growth_mib']:.0f} MiB", ""),
        ("requests served / failed", f"{r['requests']} / {r['failed_requests']}", "0 failed"),
        ("load average before / after", f"{load_before:.2f} / {load_after:.2f}", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--policy", default="migrate", choices=("migrate", "drain", "restart"))
    parser.add_argument("--clients", type=int, default=8, help="concurrent streams (default 8)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--steady", type=float, default=15.0, help="steady-state seconds")
    parser.add_argument("--after", type=float, default=8.0, help="load seconds after the commit")
    parser.add_argument(
        "--window",
        type=float,
        default=3.0,
        help="seconds after the commit counted as around it (default 3)",
    )
    parser.add_argument(
        "--migration-tokens-per-step",
        type=int,
        default=None,
        help="the daemon's --migration-tokens-per-step (default: the daemon's)",
    )
    parser.add_argument(
        "--staging-cpu-share",
        type=float,
        default=None,
        help="the daemon's --staging-cpu-share (CPU; default: the daemon's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None, help="where versions are written")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--no-canary", dest="canary", action="store_false", help="stage without a canary file"
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=0.5,
        help="wait (up to 3 min) for the load average to fall below this first",
    )
    args = parser.parse_args()
    load_before = wait_for_quiet(args.max_load, 180.0)
    print(f"load average before: {load_before:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="sitsd-swap-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(args, work)
    load_after = os.getloadavg()[0]
    result["load_average"] = [load_before, load_after]
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    canary = "with a canary" if args.canary else "no canary"
    print(f"\nhot-swap under load ({args.device}, {args.clients} streams, {args.policy}, {canary})")
    print(table(result, load_before, load_after))
    for name, p in result["itl_by_stage"].items():
        print(f"  while {name}: ITL P50 {p['p50_ms']:.1f} P99 {p['p99_ms']:.1f} ms (n={p['n']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
