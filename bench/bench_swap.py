"""Hot-swap benchmark: weight swaps on the real daemon under steady streaming load, ITL per phase.

1. Write two versions as Hugging Face directories with manifests: CPU: SmolLM2 (the embedded
   weights) and a copy with 1% relative noise; `--device cuda`: random bf16 weights in
   Llama-3-8B shapes and a copy with 1% relative noise (about 16 GB each on disk, under
   `--work-dir`).
2. For each stream count (`--clients`, default 32 and 128): start `sitsd serve` on v1 (fcfs,
   two weight slots, a canary file) and keep that many greedy streams going (a new request as
   soon as one ends).
3. For each policy (`--policies`, default migrate, drain, restart), one swap: `--steady`
   seconds of load, `Admin.Deploy` of the other version under a fresh id (so every swap stages:
   verify, validate, stage, canary), a second of load, `Admin.Swap` with the policy, the load
   until the swap's effect is over (migrate: its commit, once the shadows caught up; drain: the
   last request that ran on the old weights ends; restart: every request in flight has a
   token from the new weights, or ended), then `--after` seconds more.
4. Report, from the clients' token arrival times, for every phase of every swap: the
   inter-token latency P50 / P99 / max and their ratios to that swap's steady P99; the swap's
   wall time (deploy to the end of its effect) and serving pause; the largest gaps with the
   phase they fell in (where to look when a phase stalls), and the daemon's own account of
   them (it runs with slow-step, loop-stall and collection warnings at 1.5x the recent median
   step: what each slow step carried, placed in its phase). The worst ratios come last, against
   the targets (GPU: P99 at most 1.3x steady, max at most 3x steady P99; CPU: 1.5x and 4x).

`--second int4`: the other version is v1 quantized by `sitsd quantize --method rtn` (INT4, groups
of 128 on the GPU, 64 on the CPU: SmolLM2's 576 inputs), so the swaps alternate between the
16-bit version and its INT4 version; after them, a third version (the INT4 one with every scale
off by a random factor in [1/8, 8): well formed, finite, badly quantized) is deployed and must be
rejected by the canary while the streams go on (its phases reported like a swap's, up to the
rejection, then after). Every deploy's canary KL is printed beside its bound.

Phases, in order: steady, verify, validate, stage (the copy into the standby slot), canary,
staged (the second between deploy and swap); then migrate (the swap call to its commit) | commit
and drain (requests that started on the old weights finishing there) | restart (requests in
flight taken back and recomputed until each has a token from the new weights); then after. A
token belongs to the phase its arrival falls in. Never part of the test run; on the CPU about
10 minutes per stream count.

    .venv/bin/python -m bench.bench_swap [--clients 32,128] [--policies migrate,drain,restart]
    python3 -m bench.bench_swap --device cuda --work-dir /scratch/swap   # the GPU machine
    ... --second int4 --policies migrate,migrate   # 16-bit -> INT4 -> 16-bit, then a bad INT4
    ... --profile-daemon DIR   # which daemon threads hold the interpreter, and where (py-spy)

At each phase mark the benchmark fetches the daemon's step histogram alone: the whole /metrics
would hold the daemon's interpreter while it renders, which is a stall of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import grpc
import torch

from bench.daemon import (
    BenchDaemon,
    bucket_quantile,
    host_parts,
    parse_histograms,
    profiler_wrap,
)
from bench.load import LoadSpec, Stream, StreamLoad, arrival_gaps
from bench.shapes import LLAMA3_8B, SMOLLM2
from bench.timing import now, percentile
from sitsd.api.v1 import admin_pb2, admin_pb2_grpc

SLOT_COST = re.compile(r"the standby slot costs (\d+) MiB")
STAGES = ("verify", "validate", "stage", "canary")
POLICY = {"migrate": admin_pb2.SWAP_POLICY_MIGRATE, "drain": admin_pb2.SWAP_POLICY_DRAIN,
          "restart": admin_pb2.SWAP_POLICY_RESTART}  # fmt: skip
REJECTED = "rejected"  # the row of the badly quantized version's deploy (--second int4)
TARGETS = {"cuda": (1.3, 3.0), "cpu": (1.5, 4.0)}  # P99 / steady P99, max / steady P99
STEP_HISTOGRAM = "sitsd_step_duration_seconds"
STEP_SAMPLES = tuple(f"{STEP_HISTOGRAM}{suffix}" for suffix in ("_bucket", "_count", "_sum"))
CANARY = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colours are",
]
KV_TOKENS_PER_STREAM = 320  # a prompt of up to 160 tokens and up to 128 outputs, and slack
INT4_GROUP = {"cuda": 128, "cpu": 64}  # SmolLM2's 576 inputs are not a multiple of 128
# The daemon's --canary-max-kl (nats) by --second and device: loose where the other version is
# a 1% noisy copy; with int4, between what the INT4 version and the badly quantized one measure
# (CPU: SmolLM2's RTN version measured 0.46 from the 16-bit one and 0.54 back; random weights
# in 8B shapes have logits of std ~1.3 (unit RMS after the last norm, 0.02 x sqrt(4096)): an
# unrelated model measures ~1.6; their RTN INT4 copy measured 0.84 on an H100, session 22,
# where the first bound, 0.5, rejected it).
CANARY_MAX_KL = {"noise": {"cpu": 5.0, "cuda": 5.0}, "int4": {"cpu": 1.5, "cuda": 1.2}}
BAD_SCALE_RANGE = 8.0  # the bad version's scales are off by factors log-uniform in [1/8, 8)


# ------------------------------------------------------------------------------- versions


def write_cpu_versions(work: Path, noisy: bool) -> tuple[Path, Path]:
    """SmolLM2 in float32 (v1) and, if `noisy`, a copy with 1% relative noise (v2)."""
    from sitsd.weights import load_checkpoint, resolve_model_path
    from sitsd.weights.export import perturbed, write_version

    # Dequantized: a version is a float32 Hugging Face directory (the GGUF's Q4_1 bytes are not).
    ckpt = load_checkpoint(resolve_model_path("default"), keep_quantized=False)
    write_version(ckpt, work / "v1")
    if noisy:
        write_version(ckpt, work / "v2", perturbed(ckpt.tensors, 0.01, seed=1))
    return work / "v1", work / "v2"


def write_gpu_versions(work: Path, noisy: bool) -> tuple[Path, Path]:
    """Random bf16 weights in Llama-3-8B shapes (about 16 GB each on disk), generated on the GPU:
    v1, and if `noisy` v2 = v1 with 1% relative noise; written once (reused when their
    manifests exist)."""
    from bench.make_random_model import write
    from sitsd.weights.manifest import write_manifest

    for name, noise in (("v1", 0.0), ("v2", 0.01))[: 2 if noisy else 1]:
        if not (work / name / "manifest.json").exists():
            started = now()
            write(work / name, "llama-3-8b", seed=0, noise=noise)
            write_manifest(work / name, workers=8)
            print(f"wrote {name} in {now() - started:.0f} s", flush=True)
    return work / "v1", work / "v2"


def write_int4_versions(work: Path, v1: Path, device: str) -> tuple[Path, Path]:
    """v1 quantized as `sitsd quantize --method rtn --scale-search none` does (no calibration:
    each group's full range), and a badly quantized copy of it: every scale off by a random
    factor in [1/8, 8) (finite, non-zero, well formed: only the canary can tell). Written
    once."""
    from safetensors.torch import load_file, save_file

    from sitsd.weights import load_checkpoint
    from sitsd.weights.manifest import write_manifest
    from sitsd.weights.quantize import QuantizeConfig, quantize_checkpoint

    int4, bad = work / "v1-int4", work / "v1-int4-bad"
    if not (int4 / "manifest.json").exists():
        started = now()
        config = QuantizeConfig(method="rtn", group_size=INT4_GROUP[device], scale_search="none")
        quantize_checkpoint(load_checkpoint(v1), config, "", int4)
        print(f"wrote {int4.name} in {now() - started:.0f} s", flush=True)
    if not (bad / "manifest.json").exists():
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(int4, bad, ignore=shutil.ignore_patterns("manifest.json"))
        gen = torch.Generator().manual_seed(2)
        for shard in sorted(bad.glob("*.safetensors")):
            tensors = load_file(str(shard))
            for name, t in tensors.items():
                if name.endswith(".scales"):
                    exponent = 2 * torch.rand(t.shape, generator=gen) - 1  # [-1, 1)
                    factor = BAD_SCALE_RANGE**exponent
                    tensors[name] = (t.float() * factor).to(t.dtype)
            save_file(tensors, str(shard))
        write_manifest(bad)
    return int4, bad


# ----------------------------------------------------------------------------------- load


def effect_end(load: StreamLoad, policy: str, swap: float, committed: float,
               timeout_s: float) -> float:  # fmt: skip
    """When the swap's effect on requests in flight is over (see the module docstring)."""
    if policy == "migrate":
        return committed
    deadline = now() + timeout_s
    while now() < deadline:
        streams = load.streams(since=swap, times_from=committed)
        if policy == "drain":  # the requests that had tokens before the flip ran on v-old
            old = [s for s in streams if s.first_token is not None and s.first_token < committed]
            if all(s.ended is not None for s in old):
                return max([committed, *(s.ended for s in old if s.ended is not None)])
        else:  # restart: each request in flight at the swap has a token from the new weights
            inflight = [s for s in streams if s.started < swap]
            # A first token after the commit is the new weights' (no token yet: no old KV).
            after = [s.first_token if s.first_token is not None and s.first_token > committed
                     else s.switched or s.ended for s in inflight]  # fmt: skip
            if all(t is not None for t in after):
                return max([committed, *(t for t in after if t is not None)])
        time.sleep(0.2)
    raise RuntimeError(f"the {policy} swap's effect did not end in {timeout_s:.0f} s")


def stats(gaps: list[float], steady_p99: float | None = None) -> dict[str, float]:
    """Count, P50, P99 (nearest rank), max of `gaps` in ms; and ratios to `steady_p99`."""
    if len(gaps) < 2:
        out = {"n": len(gaps), "p50_ms": float("nan"), "p99_ms": float("nan"),
               "max_ms": max(gaps, default=0.0) * 1e3}  # fmt: skip
    else:
        out = {"n": len(gaps), "p50_ms": percentile(gaps, 50) * 1e3,
               "p99_ms": percentile(gaps, 99) * 1e3, "max_ms": max(gaps) * 1e3}  # fmt: skip
    if steady_p99:
        out["p99_ratio"] = out["p99_ms"] / steady_p99
        out["max_ratio"] = out["max_ms"] / steady_p99
    return out


# ----------------------------------------------------------------------------- one swap


def daemon_flags(args: argparse.Namespace, work: Path, v1: Path, clients: int) -> list[str]:
    flags = ["--model", str(v1), "--served-model-name", "bench", "--device", args.device,
             "--scheduling-policy", "fcfs", "--max-num-seqs", str(2 * clients),
             "--weight-slots", "2"]  # fmt: skip
    for flag in ("swap_step_share", "staging_share", "migration_tokens_per_step",
                 "migration_deadline"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            flags += [f"--{flag.replace('_', '-')}", str(value)]
    if args.canary:
        (work / "canary.txt").write_text("\n".join(CANARY) + "\n")
        flags += ["--canary-file", str(work / "canary.txt"), "--canary-max-kl",
                  str(args.canary_max_kl)]  # fmt: skip
    # The daemon's account of a slow inter-token gap: steps 1.5x their recent median (and
    # past a floor a little under a steady step), event-loop stalls and garbage collections,
    # each logged with what it carried (`daemon_account` places them in the swap's phases).
    floor_ms = "50" if args.device == "cpu" else "8"
    flags += ["--slow-step-ms", floor_ms, "--slow-step-factor", "1.5", "--loop-lag-warn-ms",
              floor_ms, "--stall-warn-every-s", "0.02", "--gil-hold-warn-ms", floor_ms]  # fmt: skip
    if args.device == "cpu":  # float32 KV for every stream
        a = SMOLLM2
        per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4
        mib = max(256, clients * KV_TOKENS_PER_STREAM * per_token // 2**20)
        flags += ["--kv-cache-memory", f"{mib}MiB"]
    return flags


def admin(daemon: BenchDaemon) -> tuple[admin_pb2_grpc.AdminStub, list[tuple[str, str]]]:
    """The daemon's Admin service and the metadata its calls need (the admin token)."""
    stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(daemon.address))
    return stub, [("authorization", f"Bearer {daemon.token()}")]


class Marks:
    """The times one swap's phases start (`now()`), each with the daemon's step histogram as
    it stood then (parsed once the load has stopped)."""

    def __init__(self, daemon: BenchDaemon) -> None:
        self.daemon = daemon
        self.snapshots: dict[float, str] = {}

    def __call__(self) -> float:
        # Fetching is I/O; it holds the GIL no longer than a token's arrival. Only that
        # histogram: rendering the whole /metrics holds the daemon's interpreter for
        # milliseconds, which its engine's steps wait for (a step 3-6x its median at every
        # phase's start on an H200).
        t = now()
        self.snapshots[t] = self.daemon.metrics_text(STEP_SAMPLES)
        return t


def deploy(args: argparse.Namespace, path: Path, version: str, mark: Marks) -> dict:
    """Steady load, then `Admin.Deploy` of `path` as `version` to its end: the marks (each
    stage's start, the canary's KL; `staged`: when it staged or was rejected, `rejected`: the
    status that rejected it, absent when it staged)."""
    stub, metadata = admin(mark.daemon)
    mark()
    time.sleep(args.steady)  # the load runs meanwhile: nothing is timed by this
    marks: dict = {"deploy": mark(), "stages": {}, "metrics": mark.snapshots, "canary_kl": None}
    request = admin_pb2.DeployRequest(path=str(path), version=version)
    try:
        for progress in stub.Deploy(request, metadata=metadata, timeout=3600):
            if progress.stage not in marks["stages"]:
                marks["stages"][progress.stage] = mark()
            if progress.stage == "canary" and progress.canary_kl:
                marks["canary_kl"] = progress.canary_kl
    except grpc.RpcError as exc:
        marks["staged"] = mark()
        marks["rejected"] = f"{exc.code().name}: {exc.details()}"
        return marks
    assert progress.stage == "staged", progress
    marks["staged"] = mark()
    return marks


def one_swap(
    args: argparse.Namespace, daemon: BenchDaemon, load: StreamLoad, path: Path, version: str,
    policy: str,
) -> dict:  # fmt: skip
    """Steady load, deploy, a second, swap with `policy`, its effect, after; the marks."""
    stub, metadata = admin(daemon)
    mark = Marks(daemon)
    marks = deploy(args, path, version, mark)
    if "rejected" in marks:
        raise RuntimeError(f"the deploy of {version} failed: {marks['rejected']}")
    time.sleep(1.0)  # a second of plain load between staging and the commit
    marks["swap"] = mark()
    swap = admin_pb2.SwapRequest(version=version, policy=POLICY[policy])
    events = list(stub.Swap(swap, metadata=metadata, timeout=3600))
    marks["committed"], last = mark(), events[-1]
    assert last.stage == "committed", last
    marks.update(pause_ms=last.pause_ms, flip_ms=last.flip_ms, num_migrating=last.num_migrating,
                 num_restarted=last.num_restarted, num_draining=last.num_draining)  # fmt: skip
    marks["effect_end"] = effect_end(load, policy, marks["swap"], marks["committed"], 1800)
    mark()  # just after the effect's end (the end is known only once it is over)
    time.sleep(args.after)
    marks["end"] = mark()
    return marks


def one_rejection(args: argparse.Namespace, daemon: BenchDaemon, path: Path,
                  version: str) -> dict:  # fmt: skip
    """Steady load, the deploy of a version the canary must reject, after; the marks (those of
    a swap that ends, with no pause, where the deploy was refused)."""
    mark = Marks(daemon)
    marks = deploy(args, path, version, mark)
    marks.setdefault("rejected", None)  # None: it staged (it should not have)
    marks.update(effect_end=marks["staged"], pause_ms=0.0, flip_ms=0.0, num_migrating=0,
                 num_restarted=0, num_draining=0)  # fmt: skip
    time.sleep(args.after)
    marks["end"] = mark()
    return marks


def step_stats(snapshots: dict[float, str], start: float, end: float) -> dict[str, float]:
    """The daemon's engine steps between the snapshots nearest `start` and `end`: how many,
    and the upper bounds of the step-time buckets holding their median, P99 and maximum
    (ms; the histogram's buckets, not exact times)."""
    times = sorted(snapshots)
    first, last = (min(times, key=lambda t: abs(t - x)) for x in (start, end))
    rows = [parse_histograms(snapshots[t], STEP_HISTOGRAM).get("", []) for t in (first, last)]
    before, after = rows
    if not after:
        return {"steps": 0}
    steps = after[-1][1] - (before[-1][1] if before else 0.0)
    out = {"steps": steps}
    for key, q in (("step_p50_ms", 0.5), ("step_p99_ms", 0.99), ("step_max_ms", 1.0)):
        bound = bucket_quantile(after, q, before)
        if bound is not None:
            out[key] = bound * 1e3
    return out


def phases_of(args: argparse.Namespace, marks: dict, policy: str) -> list[tuple[str, float, float]]:
    """(name, start, end) of every phase of one swap, in order, end to end: the first stage
    from the deploy (the time until the daemon's first word of it counts in that stage; a
    gap there once fell in no phase)."""
    staged = sorted(((s, t) for s, t in marks["stages"].items() if s in STAGES),
                    key=lambda st: st[1])  # fmt: skip
    bounds = [t for _, t in staged] + [marks["staged"]]
    bounds[0] = marks["deploy"]
    phases = [("steady", marks["deploy"] - args.steady, marks["deploy"])]
    phases += [(name, bounds[i], bounds[i + 1]) for i, (name, _) in enumerate(staged)]
    if policy == REJECTED:  # up to the refusal, then after
        return [*phases, ("after", marks["staged"], marks["end"])]
    phases.append(("staged", marks["staged"], marks["swap"]))
    swap, committed, effect = marks["swap"], marks["committed"], marks["effect_end"]
    if policy == "drain":
        phases += [("commit", swap, committed), ("drain", committed, effect)]
    else:
        phases.append((policy, swap, effect))
    phases.append(("after", effect, marks["end"]))
    return phases


def first_tokens(streams: list[Stream], start: float, end: float) -> dict[str, float]:
    """The time to first token of the requests sent in [start, end) that got one: its median
    and longest (ms). A swap may hold arrivals' prompts back (a drain's hold, the chunks of
    steps serving two versions) to keep the running streams' gaps: this is what they pay."""
    waits = sorted(s.first_token - s.started for s in streams
                   if start <= s.started < end and s.first_token is not None)  # fmt: skip
    if not waits:
        return {}
    return {"ttft_n": len(waits), "ttft_p50_ms": statistics.median(waits) * 1e3,
            "ttft_max_ms": waits[-1] * 1e3}  # fmt: skip


def summarize(args: argparse.Namespace, streams: list[Stream], marks: dict, policy: str,
              clients: int) -> dict:  # fmt: skip
    phases = phases_of(args, marks, policy)
    steady = stats([g for g, _ in arrival_gaps(streams, phases[0][1], phases[0][2])])
    by_phase = {name: stats([g for g, _ in arrival_gaps(streams, a, b)], steady["p99_ms"])
                | {"s": b - a}
                | first_tokens(streams, a, b)
                | step_stats(marks["metrics"], a, b) for name, a, b in phases}  # fmt: skip
    gaps = sorted(arrival_gaps(streams, phases[0][1], marks["end"]), reverse=True)[:5]
    largest = []
    for gap, at in gaps:
        name, start, _ = max((p for p in phases if p[1] <= at), key=lambda p: p[1])
        largest.append({"ms": gap * 1e3, "phase": name, "into_phase_s": at - start})
    started = [s for s in streams if phases[0][1] <= s.started < marks["end"]]
    return {
        "clients": clients,
        "policy": policy,
        "phases": by_phase,
        "swap_s": marks["effect_end"] - marks["deploy"],
        "pause_ms": marks["pause_ms"],
        "flip_ms": marks["flip_ms"],
        "in_flight": {k: marks[k] for k in ("num_migrating", "num_restarted", "num_draining")},
        "requests": len(started),
        "failed": sum(
            s.failed
            for s in streams
            if s.ended is not None and phases[0][1] <= s.ended <= marks["end"]
        ),
        "largest_gaps": largest,
        "canary_kl": marks["canary_kl"],
        "canary_max_kl": args.canary_max_kl if args.canary else None,
        "rejected": marks.get("rejected"),
    }


def daemon_account(
    log_text: str,
    marks: dict,
    phases: list[tuple[str, float, float]],
    wall_minus_perf: float,
    most: int = 12,
) -> list[str]:
    """The daemon's warnings during one swap (slow steps with what they carried, event-loop
    stalls, garbage collections), the `most` longest, each placed in its phase (at the end of
    the stall it reports; seconds into the phase): which part of the swap a long gap was."""
    found: list[tuple[float, float, str]] = []  # (ms, perf time, what)
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        stamp = entry.get("timestamp", "")
        if not stamp or not any(k in entry for k in ("step_ms", "lag_ms", "gc_ms", "gil_wait_ms")):
            continue
        at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - wall_minus_perf
        if not phases[0][1] <= at < marks["end"]:
            continue
        if "step_ms" in entry:
            work = entry["swap_work_tokens"]
            limit = entry.get("swap_work_limit", "")  # what set the piece's size
            if limit and entry.get("swap_work_token_ms"):
                limit += f" at {entry['swap_work_token_ms']:.3g} ms a token"
            if limit and entry.get("swap_work_smallest_ms"):
                limit += f", the smallest piece {entry['swap_work_smallest_ms']:.3g} ms"
            what = (f"step {entry['step_ms']:.0f} ms ({entry['num_tokens']} tokens, "
                    f"{entry['num_requests']} requests, {entry['serving_versions']} versions, "
                    f"{work} of a swap's{' alone' if entry['swap_work_alone'] else ''}"
                    f"{f' ({limit})' if limit else ''}, "
                    f"{entry['num_migrated']} migrated; {entry.get('device_wait_ms', 0):.0f} "
                    f"ms waiting for the device{host_parts(entry)})")  # fmt: skip
            ms = entry["step_ms"]
        elif "gil_wait_ms" in entry:
            what, ms = f"interpreter held {entry['gil_wait_ms']:.0f} ms", entry["gil_wait_ms"]
        elif "lag_ms" in entry:
            what, ms = f"event loop late {entry['lag_ms']:.0f} ms", entry["lag_ms"]
        else:
            what, ms = f"gc gen {entry['gc_generation']} {entry['gc_ms']:.0f} ms", entry["gc_ms"]
        found.append((ms, at, what))
    out = []
    for _, at, what in sorted(found, reverse=True)[:most]:
        name, start, _ = next((p for p in phases if p[1] <= at < p[2]), ("after", at, at))
        out.append(f"    {name} +{at - start:.1f} s: {what}")
    return out


def run_streams(args: argparse.Namespace, work: Path, versions: tuple[Path, Path],
                bad: Path | None, clients: int) -> list[dict]:  # fmt: skip
    """One daemon, one swap per policy under `clients` streams (then the deploy of `bad`, if
    given, which the canary must reject)."""
    v1, v2 = versions
    # A fresh daemon each run: a state directory kept from a run before in the same work
    # directory remembers its version ids, and this run's deploys of the same ids are refused.
    state = work / f"state-{clients}"
    shutil.rmtree(state, ignore_errors=True)
    wrap = profiler_wrap(args.profile_daemon / f"daemon-{clients}.txt") if args.profile_daemon \
        else []  # fmt: skip
    daemon = BenchDaemon(state, daemon_flags(args, work, v1, clients),
                         log_path=work / f"daemon-{clients}.log", wrap=wrap)  # fmt: skip
    results = []
    wall_minus_perf = time.time() - now()  # the daemon's log has wall-clock times
    try:
        daemon.wait_until_serving()
        slot_mib = float(SLOT_COST.search(daemon.log_text()).group(1))
        rng = random.Random(args.seed)
        vocab = (SMOLLM2 if args.device == "cpu" else LLAMA3_8B).vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 160))]
                   for _ in range(64)]  # fmt: skip
        load = StreamLoad(LoadSpec(daemon.address, prompts, clients, args.seed))
        load.start()
        time.sleep(args.warmup)
        swaps = []
        for i, policy in enumerate(args.policies):
            path = v2 if i % 2 == 0 else v1
            swaps.append((policy, one_swap(args, daemon, load, path,
                                           f"{path.name}-{policy}-{i}", policy)))  # fmt: skip
            print(f"{clients} streams, {policy}: done", flush=True)
        if bad is not None:
            swaps.append((REJECTED, one_rejection(args, daemon, bad, f"{bad.name}-{clients}")))
            print(f"{clients} streams, the badly quantized version: done", flush=True)
        streams = load.stop(1800)
        print(f"{clients} streams, the versions: {versions_line(daemon)}", flush=True)
        for policy, marks in swaps:
            result = summarize(args, streams, marks, policy, clients)
            result["second_slot_mib"] = slot_mib
            account = daemon_account(daemon.log_text(), marks, phases_of(args, marks, policy),
                                     wall_minus_perf)  # fmt: skip
            result["daemon_account"] = account
            results.append(result)
            print(table(result, args.device), flush=True)
            print("\n".join(["the daemon's slowest steps, loop stalls and collections:",
                             *account]), flush=True)  # fmt: skip
    finally:
        daemon.stop()
    return results


# --------------------------------------------------------------------------------- report


def versions_line(daemon: BenchDaemon) -> str:
    """Each version the daemon knows: its precision and weight bytes (`Admin.ListVersions`)."""
    stub, metadata = admin(daemon)
    listed = stub.ListVersions(admin_pb2.ListVersionsRequest(), metadata=metadata, timeout=60)
    return "; ".join(f"{v.version}: {v.precision}, {v.weight_bytes / 2**20:.0f} MiB"
                     if v.precision else f"{v.version}: never in a slot"
                     for v in listed.versions)  # fmt: skip


def table(r: dict, device: str) -> str:
    p99_target, max_target = TARGETS[device]
    kl = "no canary" if r["canary_max_kl"] is None else \
        f"canary KL {r['canary_kl'] or float('nan'):.4f} (bound {r['canary_max_kl']})"  # fmt: skip
    if r["policy"] == REJECTED:
        outcome = f"rejected ({r['rejected']})" if r["rejected"] else "NOT REJECTED: it staged"
        head = (f"\n{r['clients']} streams, the badly quantized version: {outcome} "
                f"{r['swap_s']:.1f} s after its deploy; {kl}; {r['requests']} requests, "
                f"{r['failed']} failed")  # fmt: skip
    else:
        head = (f"\n{r['clients']} streams, {r['policy']}: swap {r['swap_s']:.1f} s (deploy to "
                f"the end of its effect), pause {r['pause_ms']:.2f} ms, "
                f"{r['in_flight']['num_migrating']} migrated / {r['in_flight']['num_restarted']} "
                f"restarted / {r['in_flight']['num_draining']} draining, {r['requests']} "
                f"requests, {r['failed']} failed; {kl}")  # fmt: skip
    lines = [
        head,
        f"{'phase':<9} {'s':>6} {'n':>7} {'P50':>8} {'P99':>8} {'max':>8}  "
        f"{'P99/steady':>10} {'max/steadyP99':>13}   (ms; targets {p99_target}x, {max_target}x)"
        f" | {'steps':>6} {'P50<=':>6} {'P99<=':>6} {'max<=':>6}  (engine steps, ms buckets)"
        f" | {'TTFT P50':>8} {'max':>8} (ms)",
    ]
    for name, p in r["phases"].items():
        buckets = " ".join(f"{p[k]:>6.0f}" if k in p else f"{'-':>6}"
                           for k in ("step_p50_ms", "step_p99_ms", "step_max_ms"))  # fmt: skip
        ttft = " ".join(f"{p[k]:>8.0f}" if k in p else f"{'-':>8}"
                        for k in ("ttft_p50_ms", "ttft_max_ms"))  # fmt: skip
        lines.append(
            f"{name:<9} {p['s']:>6.1f} {p['n']:>7} {p['p50_ms']:>8.1f} {p['p99_ms']:>8.1f} "
            f"{p['max_ms']:>8.1f}  {p['p99_ratio']:>9.2f}x {p['max_ratio']:>12.2f}x"
            f"{'':<31} | {p.get('steps', 0):>6.0f} {buckets} | {ttft}"
        )
    gaps = ", ".join(f"{g['ms']:.0f} ms in {g['phase']} (+{g['into_phase_s']:.1f} s)"
                     for g in r["largest_gaps"])  # fmt: skip
    lines.append(f"largest gaps: {gaps}")
    return "\n".join(lines)


def worst(results: list[dict], key: str) -> tuple[float, str]:
    """The largest ratio over every phase but steady (phases with at least 20 gaps)."""
    found = [(p[key], f"{r['clients']} streams, {r['policy']}, {name}")
             for r in results for name, p in r["phases"].items()
             if name != "steady" and p["n"] >= 20]  # fmt: skip
    return max(found, default=(float("nan"), "no phase"))


def wait_for_quiet(max_load: float, timeout_s: float) -> float:
    """Wait (up to `timeout_s`) for the 1-minute load average to fall under `max_load`."""
    deadline = now() + timeout_s
    while os.getloadavg()[0] > max_load and now() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--policies", default="migrate,drain,restart",
                        type=lambda t: [p for p in t.split(",") if p],
                        help="swap policies, one swap each (default: %(default)s)")  # fmt: skip
    parser.add_argument("--clients", default="32,128",
                        type=lambda t: [int(c) for c in t.split(",") if c],
                        help="stream counts, one daemon each (default: %(default)s)")  # fmt: skip
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before the first swap")
    parser.add_argument("--steady", type=float, default=15.0, help="steady seconds before a swap")
    parser.add_argument("--after", type=float, default=8.0, help="seconds after a swap's effect")
    for flag, help_text in (("--swap-step-share", "FRACTION"), ("--staging-share", "FRACTION"),
                            ("--migration-tokens-per-step", "N"),
                            ("--migration-deadline", "SECONDS")):  # fmt: skip
        parser.add_argument(flag, default=None, metavar=help_text,
                            help=f"the daemon's {flag} (default: the daemon's)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None, help="where versions are written")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--profile-daemon", type=Path, default=None, metavar="DIR",
                        help="record which of the daemon's threads hold the interpreter, and "
                             "where (py-spy), one file per stream count in DIR")  # fmt: skip
    parser.add_argument("--no-canary", dest="canary", action="store_false",
                        help="stage without a canary file")  # fmt: skip
    parser.add_argument("--second", choices=tuple(CANARY_MAX_KL), default="noise",
                        help="the version swapped with v1: v1 with 1%% noise, or v1 in INT4 "
                             "(then a badly quantized one must be rejected)")  # fmt: skip
    parser.add_argument("--canary-max-kl", type=float, default=None,
                        help="the daemon's --canary-max-kl (default: 5 with --second noise; "
                             "with int4 1.5 on the CPU, 0.5 on the GPU)")  # fmt: skip
    parser.add_argument(
        "--max-load",
        type=float,
        default=0.5,
        help="wait (up to 3 min) for the load average to fall below this first",
    )
    args = parser.parse_args()
    unknown = set(args.policies) - set(POLICY)
    if unknown:
        parser.error(f"--policies: unknown {sorted(unknown)} (choose from {sorted(POLICY)})")
    if args.second == "int4" and not args.canary:
        parser.error("--second int4 needs the canary (it must reject the bad version)")
    if args.canary_max_kl is None:
        args.canary_max_kl = CANARY_MAX_KL[args.second][args.device]
    return args


def main() -> int:
    args = parse_args()
    if args.profile_daemon is not None:
        args.profile_daemon.mkdir(parents=True, exist_ok=True)
    load_before = wait_for_quiet(args.max_load, 180.0)
    print(f"load average before: {load_before:.2f}", flush=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sitsd-swap-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        write = write_gpu_versions if args.device == "cuda" else write_cpu_versions
        versions, bad = write(work, noisy=args.second == "noise"), None
        if args.second == "int4":
            int4, bad = write_int4_versions(work, versions[0], args.device)
            versions = (versions[0], int4)
        for clients in args.clients:
            results += run_streams(args, work, versions, bad, clients)
    load_after = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "load_average": [load_before,
                                         load_after], "runs": results}, indent=2))  # fmt: skip
    p99_target, max_target = TARGETS[args.device]
    print(f"\nload average before / after: {load_before:.2f} / {load_after:.2f}; "
          f"failed requests: {sum(r['failed'] for r in results)}; longest swap: "
          f"{max(r['swap_s'] for r in results):.1f} s")  # fmt: skip
    max_ratio, where_max = worst(results, "max_ratio")
    p99_ratio, where_p99 = worst(results, "p99_ratio")
    print(f"worst max ITL / steady P99: {max_ratio:.2f}x ({where_max}; target {max_target}x)")
    print(f"worst phase ITL P99 / steady P99: {p99_ratio:.2f}x ({where_p99}; target "
          f"{p99_target}x)")  # fmt: skip
    staged_bad = [r["clients"] for r in results if r["policy"] == REJECTED and not r["rejected"]]
    if staged_bad:
        print(f"the badly quantized version was NOT rejected with {staged_bad} streams")
    return 1 if staged_bad else 0


if __name__ == "__main__":
    sys.exit(main())
