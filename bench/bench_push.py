"""Live weight pushes benchmark: a trainer's tensors pushed into the real daemon under load.

1. v1, the daemon's start-up weights: `--device cuda`: random bf16 weights in Llama-3-8B shapes
   written once as a version directory under `--work-dir` (about 16 GB); CPU: the embedded
   SmolLM2 dequantized (a push is refused into quantized weights). The daemon serves it
   (fcfs, two weight slots, `--gpu-memory-utilization 0.6` so the trainer's tensors fit beside
   it on the same GPU).
2. This process is the trainer: the pushed tensors are v1's with 1% relative noise, made on the
   GPU (bf16, 16 GB; a host copy for the gRPC stream). With a second GPU the weight group's
   copy lives there (NCCL needs one GPU per rank). `--ipc-flatten`: the trainer keeps its
   tensors as views of one flat buffer (made once, as trainers with contiguous parameter
   buffers do), so an IPC push sends one allocation for the daemon to map, not one per tensor.
3. `--clients` streaming greedy requests keep going, from a process of their own (`bench.load`).
   After `--steady` seconds, one push per transport (`--transports`: grpc, ipc, dist; the ones that
   cannot run here are skipped), `--gap` seconds apart, each reporting: the time from the call to
   the commit (the client's clock) and the daemon's stages (receive, validate, canary, commit), the
   serving pause at the commit, inter-token latency P99 while receiving (the call to staged) and
   while committing against steady, the bytes per second received against the device copy
   bandwidth measured first (bench.floors), and from the daemon's /metrics the slowest engine
   step and the event loop's latest wake-up from before the gap to the commit (which of the
   two a long inter-token gap came from; scraped before the gap, since making the /metrics
   text holds the daemon's interpreter, which its engine step waits for). The control: the
   steady seconds cut into windows as long as the push's receive window, their ITL P99 against
   steady (median and worst): a short window's P99 is about its slowest step, push or not.
4. Throughput: output tokens/s over `--period` seconds with no push, then over as long with a
   full push every `--push-every` seconds (over IPC where it runs, else the first transport),
   for each policy of `--throughput-policies`, and their ratios; and the ITL P99 while
   receiving of each of those pushes against steady (their median and worst).
5. The peer: a bare gRPC server in this process taking the same chunks over loopback (nothing
   done with them), before the daemon starts: what one Python gRPC stream moves on this host,
   against which the daemon's receive rate is read.
6. The daemon's own account, printed before the table: its slow-step and loop-stall warnings
   and each IPC push's parts (open, copy, let go) with their times, from its log; and per IPC
   push a timeline: its parts, the clients' longest gaps and the daemon's warnings around it
   (the daemon runs with `--slow-step-ms 8 --slow-step-factor 1.5 --loop-lag-warn-ms 4
   --stall-warn-every-s 0.02`, so that short stalls are logged too).

Targets (GPU): IPC call to commit < 0.25 s with a pause < 1 ms and ITL P99 within 1.5x of
steady (with throughput pushes, the median over every IPC push of the run: one push's window
is about its slowest step, which host noise alone takes past 1.5x now and then, as the steady
windows show); gRPC >= 1 GB/s over loopback; throughput with a push every 10 s >= 0.95 of none. With
`--policy migrate` (the default) the commit waits for the requests in flight to migrate:
`--policy drain` times the transfer and the flip alone. Never part of the test run.

    python -m bench.bench_push --device cuda --work-dir /scratch/push [--json out.json]
    .venv/bin/python -m bench.bench_push --clients 4 --transports grpc,dist   # CPU smoke run
    .venv/bin/python -m bench.bench_push --clients 2 --transports grpc --staging-share 1 \
        --policy drain --period 0   # the gRPC receive rate on a CPU, copies unpaced
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import torch

from bench.bench_swap import stats
from bench.daemon import BenchDaemon, bucket_quantile, host_parts, parse_histograms
from bench.load import LoadSpec, Stream, StreamLoad, arrival_gaps, arrivals
from bench.shapes import LLAMA3_8B, SMOLLM2
from bench.timing import now
from sitsd.client import PushResult, WeightGroup, WeightsClient
from sitsd.client.tensors import flat_views
from sitsd.client.weights import DEFAULT_CHUNK_BYTES

TRANSPORTS = ("grpc", "ipc", "dist")


# ---------------------------------------------------------------------------------- weights


def write_v1(work: Path, device: str) -> Path:
    """The start-up version directory (written once; reused when its manifest is there)."""
    directory = work / "v1"
    if (directory / "manifest.json").exists():
        return directory
    if device == "cuda":
        from bench.make_random_model import write
        from sitsd.weights.manifest import write_manifest

        write(directory, "llama-3-8b", seed=0)
        write_manifest(directory, workers=8)
    else:
        from sitsd.weights import load_checkpoint, resolve_model_path
        from sitsd.weights.export import write_version

        dense = load_checkpoint(resolve_model_path("default"), keep_quantized=False)
        write_version(dense, directory)  # float32: a push writes 16/32-bit weights in place
    return directory


def trainer_tensors(
    v1: Path, device: torch.device, seed: int, flat: bool = False
) -> dict[str, torch.Tensor]:
    """v1's tensors with 1% relative noise, on `device` (the trainer's update); `flat`: as
    views of one buffer (`flat_views`), each written in place, so the update never takes its
    size twice (an 80 GB card holds the daemon, 16 GB of update, and little more)."""
    from safetensors.torch import load_file

    v1_tensors: dict[str, torch.Tensor] = {}  # memory-mapped: read as each is moved
    for shard in sorted(v1.glob("*.safetensors")):
        v1_tensors |= load_file(str(shard))
    into = dict(flat_views(list(v1_tensors.items()), device)) if flat else {}
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, t in v1_tensors.items():
        t = t.to(device)
        noise = torch.empty(t.shape, device=device).normal_(0.0, 0.01, generator=gen)
        noisy = (t.float() * (1 + noise)).to(t.dtype)
        out[name] = into[name].copy_(noisy) if flat else noisy
    return out


# ------------------------------------------------------------------------------------- load


def load_spec(address: str, vocab: int, clients: int, seed: int) -> LoadSpec:
    """`clients` greedy streams of random prompts (32-160 tokens), 64-256 tokens each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 160))] for _ in range(64)]
    return LoadSpec(address, prompts, clients, seed, max_tokens=(64, 256), timeout_s=600)


def itls(load: StreamLoad, start: float, end: float) -> list[float]:
    """Inter-token gaps of the arrivals in [start, end)."""
    return [gap for gap, _ in arrival_gaps(load.streams(since=start), start, end)]


# ------------------------------------------------------------------------------------- runs


def loopback_grpc_rate(chunk_bytes: int, total_bytes: int = 4 * 2**30) -> float:
    """Bytes/s one client stream moves to a bare gRPC server over loopback, in messages of
    `chunk_bytes` that the server only counts: the peer of the daemon's receive rate."""
    import asyncio
    import threading

    import grpc
    import grpc.aio

    options = [("grpc.max_receive_message_length", chunk_bytes + 2**20),
               ("grpc.max_send_message_length", chunk_bytes + 2**20)]  # fmt: skip

    async def count(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        received = 0
        async for message in messages:
            received += len(message)
        return str(received).encode()

    ready, stop, port = threading.Event(), threading.Event(), []

    async def serve() -> None:
        server = grpc.aio.server(options=options)
        handler = grpc.stream_unary_rpc_method_handler(count)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Sink", {"Take": handler}),)
        )
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(None)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    ready.wait(60)
    payload = bytes(chunk_bytes)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port[0]}", options=options) as channel:
            take = channel.stream_unary("/bench.Sink/Take")
            count_of = total_bytes // chunk_bytes
            started = now()
            # Each message a new bytes object, as the client builds each chunk's message.
            take(b"".join((b"", payload)) for _ in range(count_of))
            return count_of * chunk_bytes / (now() - started)
    finally:
        stop.set()
        thread.join(60)


def available(transports: list[str], device: str) -> list[str]:
    """The transports that can run here: IPC needs a GPU, NCCL a second one (gloo on a CPU)."""
    out = []
    for name in transports:
        if name == "ipc" and device != "cuda":
            print("skipping ipc: it needs the daemon on a GPU", flush=True)
        elif name == "dist" and device == "cuda" and torch.cuda.device_count() < 2:
            print("skipping dist: NCCL needs the trainer on a second GPU", flush=True)
        else:
            out.append(name)
    return out


class Trainer:
    """The pushing side: the tensors where each transport sends them from, and the client."""

    def __init__(
        self, daemon: BenchDaemon, v1: Path, device: str, seed: int, ipc_flatten: bool = False
    ) -> None:
        self.client = WeightsClient(daemon.address, token=daemon.token())
        gpu = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        # With `ipc_flatten` the trainer's tensors live in one flat buffer (see the docstring).
        on_gpu = device == "cuda"
        self.tensors = {"ipc": trainer_tensors(v1, gpu, seed, flat=ipc_flatten) if on_gpu else {}}
        if on_gpu:
            torch.cuda.empty_cache()
        self.tensors["grpc"] = {n: t.cpu() for n, t in self.tensors["ipc"].items()} or (
            trainer_tensors(v1, torch.device("cpu"), seed)
        )
        self.group: WeightGroup | None = None
        self._device = device
        self._pushes = 0

    def push(
        self, transport: str, policy: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> tuple[PushResult, float, float]:
        """One push of every tensor; (its result, call time, commit time)."""
        self._pushes += 1
        version = f"push-{self._pushes}-{transport}"
        if transport == "dist" and self.group is None:
            backend = "nccl" if self._device == "cuda" else "gloo"
            self.group = WeightGroup.create([self.client], backend=backend, timeout_s=600)
            where = torch.device("cuda", 1) if self._device == "cuda" else torch.device("cpu")
            self.tensors["dist"] = {n: t.to(where) for n, t in self.tensors["grpc"].items()}
        started = now()
        result = self.client.push(self.tensors[transport], version=version,
                                  transport=transport, policy=policy,
                                  chunk_bytes=chunk_bytes)  # fmt: skip
        return result, started, now()


def slowest(daemon: BenchDaemon, before: str) -> dict[str, float]:
    """Since the /metrics text `before`: how many engine steps ran, and the upper bounds of the
    histogram buckets holding the slowest step and the event loop's latest wake-up (ms). An
    inter-token gap longer than every step came from the loop that streams the tokens."""
    after = daemon.metrics_text()
    out: dict[str, float] = {}
    for key, name in (("step", "sitsd_step_duration_seconds"),
                      ("loop_lag", "sitsd_event_loop_lag_seconds")):  # fmt: skip
        rows = parse_histograms(after, name).get("", [])
        since = parse_histograms(before, name).get("", [])
        if key == "step" and rows:
            out["steps"] = rows[-1][1] - (since[-1][1] if since else 0.0)
        bound = bucket_quantile(rows, 1.0, since) if rows else None
        out[f"{key}_max_ms"] = bound * 1e3 if bound is not None else 0.0
    return out


def window_p99s(streams: list[Stream], start: float, end: float, length: float) -> list[float]:
    """ITL P99 (ms) of each window of `length` seconds in [start, end), back to back: what a
    window as short as a push's shows with no push (its P99 is about its slowest step)."""
    out = []
    while start + length <= end and length > 0:
        gaps = [gap for gap, _ in arrival_gaps(streams, start, start + length)]
        if len(gaps) >= 2:
            out.append(stats(gaps)["p99_ms"])
        start += length
    return out


def measure_transports(
    args: argparse.Namespace, daemon: BenchDaemon, trainer: Trainer, load: StreamLoad
) -> dict:
    steady_start, metrics = now(), daemon.metrics_text()
    time.sleep(args.steady)
    steady_end = now()
    steady = stats(itls(load, steady_start, steady_end)) | slowest(daemon, metrics)
    steady_streams = load.streams(since=steady_start)
    out: dict = {"steady": steady, "pushes": {}}
    runs = [(t, None) for t in available(args.transports, args.device) if t != "grpc"]
    if "grpc" in args.transports:  # one push per chunk size (--grpc-chunk-mib)
        runs[:0] = [("grpc", mib) for mib in args.grpc_chunk_mib]
    for transport, mib in runs:
        # Scraped before the gap, not just before the call: making the /metrics text holds the
        # daemon's interpreter for milliseconds, which its engine step waits for (measured on
        # an H200: a 26 ms step just before the call, inside the receive window).
        metrics = daemon.metrics_text()
        time.sleep(args.gap)
        chunk = mib * 2**20 if mib else DEFAULT_CHUNK_BYTES
        result, called, committed = trainer.push(transport, args.policy, chunk)
        window = slowest(daemon, metrics)  # from before the gap to the commit
        if mib is not None and len(args.grpc_chunk_mib) > 1:
            transport = f"grpc-{mib}MiB"
        # Staged (received, validated, canaried) at the daemon's total less its commit stage.
        staged = called + result.total_s - result.timings["commit"]
        time.sleep(1.0)  # the second after the commit is part of the window below
        receiving = stats(itls(load, called, staged))
        committing = stats(itls(load, staged, committed + 1.0))
        receive_s = result.timings["receive"]
        out["pushes"][transport] = {
            "call_to_commit_s": committed - called,
            "call_to_staged_s": staged - called,
            "daemon_total_s": result.total_s,
            "stages_s": result.timings,
            "pause_ms": result.pause_ms,
            "itl_receiving": receiving,
            "itl_committing": committing,
            "p99_ratio": receiving["p99_ms"] / steady["p99_ms"],
            "p99_ratio_commit": committing["p99_ms"] / steady["p99_ms"],
            "bytes": result.num_bytes,
            "bytes_per_s": result.num_bytes / receive_s if receive_s else float("nan"),
            "call_to_commit": window,
            # The control: steady cut into windows as long as this one's receive window.
            "steady_windows_p99_ms": window_p99s(
                steady_streams, steady_start, steady_end, staged - called
            ),
        }
        print(f"{transport}: {json.dumps(out['pushes'][transport])}", flush=True)
    return out


def measure_throughput(
    args: argparse.Namespace, trainer: Trainer, load: StreamLoad, steady_p99_ms: float
) -> dict:
    """Output tokens/s with no push, then with a push every `push_every` seconds, per policy
    of `--throughput-policies`; and each of those pushes' inter-token P99 while receiving
    against steady (more pushes than the one per transport above: their median and worst)."""
    transports = available(args.transports, args.device)
    transport = "ipc" if "ipc" in transports else transports[0]  # 16 GB over grpc takes > 10 s
    start = now()
    time.sleep(args.period)
    end = now()
    quiet = arrivals(load.streams(since=start), start, end) / (end - start)
    out: dict = {"transport": transport, "push_every_s": args.push_every, "quiet_tok_s": quiet,
                 "policies": {}}  # fmt: skip
    windows = []  # (call, staged) of every push
    for policy in args.throughput_policies:
        start = now()
        while now() - start < args.period:
            began = now()
            result, called, _ = trainer.push(transport, policy)
            windows.append((called, called + result.total_s - result.timings["commit"]))
            time.sleep(max(0.0, args.push_every - (now() - began)))
        end = now()
        pushing = arrivals(load.streams(since=start), start, end) / (end - start)
        out["policies"][policy] = {"pushing_tok_s": pushing, "ratio": pushing / quiet}
        print(f"throughput, {policy}: {json.dumps(out['policies'][policy])}", flush=True)
    out["receiving_p99_ratios"] = [
        stats(itls(load, called, staged))["p99_ms"] / steady_p99_ms for called, staged in windows
    ]
    return out


def daemon_flags(args: argparse.Namespace, v1: Path) -> list[str]:
    flags = ["--model", str(v1), "--served-model-name", "bench", "--device", args.device,
             "--scheduling-policy", "fcfs", "--max-num-seqs", str(2 * args.clients),
             "--weight-slots", "2", "--swap-policy", args.policy]  # fmt: skip
    if args.staging_share:
        flags += ["--staging-share", str(args.staging_share)]
    if args.ipc_keep_mapped:
        flags.append("--ipc-keep-mapped")
    # Stall warnings down to short ones, so the timeline can place every step and loop wake-up
    # that stretched a gap (a line each, at most 50 a second of each kind).
    flags += ["--slow-step-ms", "8", "--slow-step-factor", "1.5", "--loop-lag-warn-ms", "4",
              "--stall-warn-every-s", "0.02", "--gil-hold-warn-ms", "4"]  # fmt: skip
    if args.device == "cuda":
        return [*flags, "--gpu-memory-utilization", "0.6"]
    return [*flags, "--kv-cache-memory", "256MiB"]


def run(args: argparse.Namespace, work: Path) -> dict:
    result: dict = {"device": args.device, "clients": args.clients, "policy": args.policy,
                    "ipc_flatten": args.ipc_flatten}  # fmt: skip
    if args.device == "cuda":
        from bench.floors import copy_bandwidth

        result["copy_bandwidth_gb_s"] = copy_bandwidth() / 1e9  # before the daemon takes the GPU
        torch.cuda.empty_cache()
    result["loopback_grpc_b_s"] = {
        mib: loopback_grpc_rate(mib * 2**20) for mib in args.grpc_chunk_mib
    }  # before the daemon and the load take the host's cores
    v1 = write_v1(work, args.device)
    wall_minus_perf = time.time() - now()  # the daemon's log has wall-clock times
    daemon = BenchDaemon(work / "state", daemon_flags(args, v1), log_path=work / "daemon.log")
    try:
        daemon.wait_until_serving()
        trainer = Trainer(daemon, v1, args.device, args.seed, args.ipc_flatten)
        vocab = (LLAMA3_8B if args.device == "cuda" else SMOLLM2).vocab_size
        load = StreamLoad(load_spec(daemon.address, vocab, args.clients, args.seed))
        load.start()
        time.sleep(args.warmup)
        result |= measure_transports(args, daemon, trainer, load)
        if args.period > 0:
            steady_p99 = result["steady"]["p99_ms"]
            result["throughput"] = measure_throughput(args, trainer, load, steady_p99)
        streams = load.stop(600)
        result["requests"] = len(streams)
        result["failed_requests"] = sum(s.failed for s in streams)
    finally:
        daemon.stop()
        notes = daemon_notes(daemon.log_text())
        print("\n".join(["the daemon's own account (slow steps, loop stalls, IPC parts):", *notes]))
    timelines = ipc_timelines(daemon.log_text(), streams, wall_minus_perf)
    print("\n".join(["IPC pushes, ms from the daemon's start of each:", *timelines]))
    return result


NOTES = (
    "ipc push",
    "engine step",
    "event loop",
    "garbage collection",
    "weight push",
    "interpreter was held",
)
_IPC_PARTS = re.compile(r"ipc push (\S+): \d+ shared storages opened in ([\d.]+) ms \(\d+ "
                        r"kept mapped from the last push\), \d+ tensors copied in ([\d.]+) ms, "
                        r"let go in ([\d.]+) ms")  # fmt: skip
_PUSH_DONE = re.compile(r"weight push (\S+) over ipc: committed in ([\d.]+) s \(receive "
                        r"([\d.]+) s, validate ([\d.]+) s")  # fmt: skip


def ipc_timelines(log_text: str, streams: list[Stream], wall_minus_perf: float) -> list[str]:
    """Each committed IPC push as the daemon's log places its parts (ms from the daemon's start
    of it: open, copy, let go, validated, committed) beside the longest inter-token gaps the
    clients saw around it (at the arrival of the gap's second token; one per millisecond):
    which part a long gap lines up with."""
    done: dict[str, tuple[float, float, float]] = {}  # version -> (time, total, validate)
    parts: dict[str, tuple[float, float, float, float]] = {}  # (time, open, copy, let go)
    stalls: list[tuple[float, str]] = []  # (when it ended, what): slow steps, loop stalls
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        event, stamp = entry.get("event", ""), entry.get("timestamp", "")
        if not stamp:
            continue
        at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        if m := _IPC_PARTS.match(event):
            opened, copied, let_go = (float(g) / 1e3 for g in m.groups()[1:])
            parts[m.group(1)] = (at, opened, copied, let_go)
        elif m := _PUSH_DONE.match(event):
            done[m.group(1)] = (at, float(m.group(2)), float(m.group(4)))
        elif "step_ms" in entry:
            tokens, swap = entry.get("num_tokens", 0), entry.get("swap_work_tokens", 0)
            wait = entry.get("device_wait_ms", 0.0)
            stalls.append((at, f"step {entry['step_ms']:.1f} ms ({tokens} tokens, {swap} of a "
                               f"swap's; {wait:.1f} ms waiting for the device"
                               f"{host_parts(entry)})"))  # fmt: skip
        elif "gil_wait_ms" in entry:
            stalls.append((at, f"interpreter held {entry['gil_wait_ms']:.1f} ms"))
        elif "lag_ms" in entry:
            stalls.append((at, f"loop late {entry['lag_ms']:.1f} ms"))
    out = []
    for version, (at, opened, copied, let_go) in parts.items():
        if version not in done:
            continue
        end, total, validate = done[version]
        start = end - total
        open_at = at - let_go - copied - opened
        marks = {"open": open_at, "copied": open_at + opened + copied, "let go": at,
                 "validated": at + validate, "committed": end}  # fmt: skip
        gaps: dict[int, float] = {}
        lo, hi = start - wall_minus_perf - 0.05, end - wall_minus_perf + 0.05
        for gap, arrival in arrival_gaps(streams, lo, hi):
            key = round((arrival + wall_minus_perf - start) * 1e3)
            gaps[key] = max(gaps.get(key, 0.0), gap)
        longest = sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
        out.append(
            f"{version}: " + ", ".join(f"{k} +{(t - start) * 1e3:.0f}" for k, t in marks.items())
            + " ms; longest gaps: "
            + ", ".join(f"{g * 1e3:.1f} ms at {k:+d}" for k, g in sorted(longest))
        )  # fmt: skip
        near = [(t, what) for t, what in stalls if start - 0.05 <= t <= end + 0.05]
        if near:
            out.append("    the daemon's warnings (at the end of each): " + ", ".join(
                f"{what} at {(t - start) * 1e3:+.0f}" for t, what in near))  # fmt: skip
    return out


def daemon_notes(log_text: str, most: int = 40) -> list[str]:
    """The daemon's log lines that place a slow inter-token gap: its slow-step and loop-stall
    warnings, and each push's parts with their times (the last `most`)."""
    return [line for line in log_text.splitlines() if any(n in line for n in NOTES)][-most:]


def _window_ratios(p99s: list[float], steady_p99: float) -> str:
    if not p99s:
        return "no window"
    ratios = [p99 / steady_p99 for p99 in p99s]
    return f"{statistics.median(ratios):.2f}x / {max(ratios):.2f}x ({len(ratios)} windows)"


def table(r: dict) -> str:
    rows = [("measure", "value", "target")]
    steady = r["steady"]
    rows.append(("ITL steady P50 / P99", f"{steady['p50_ms']:.1f} / {steady['p99_ms']:.1f} ms", ""))
    rows.append(("steady: slowest step / loop lag",
                 f"<= {steady['step_max_ms']:g} / <= {steady['loop_lag_max_ms']:g} ms "
                 f"({steady.get('steps', 0):.0f} steps)", ""))  # fmt: skip
    bandwidth = r.get("copy_bandwidth_gb_s")
    for name, p in r["pushes"].items():
        stages = " / ".join(f"{p['stages_s'][s] * 1e3:.0f}" for s in p["stages_s"])
        # Against the device's copy bandwidth where the bytes move device to device.
        on_device = bandwidth and not name.startswith("grpc")
        share = f" ({p['bytes_per_s'] / 1e9 / bandwidth:.2f} of the copy)" if on_device else ""
        target = "< 0.25 s" if name == "ipc" else ""
        rows += [
            (f"{name}: call to commit", f"{p['call_to_commit_s']:.3f} s", target),
            (f"{name}: call to staged (commit: {r['policy']})", f"{p['call_to_staged_s']:.3f} s",
             ""),
            (f"{name}: receive / validate / canary / commit", f"{stages} ms", ""),
            (f"{name}: serving pause at the commit", f"{p['pause_ms']:.3f} ms", "< 1 ms"),
            # One window, about its slowest step: the target is read on the median of every
            # push of the run where throughput pushes follow (below)
            (f"{name}: ITL P99 while receiving / steady", f"{p['p99_ratio']:.2f}x",
             "<= 1.5x" if "throughput" not in r else ""),
            (f"{name}: ITL P99 while committing / steady", f"{p['p99_ratio_commit']:.2f}x", ""),
            (f"{name}: received", f"{p['bytes_per_s'] / 1e9:.2f} GB/s{share}",
             ">= 1 GB/s" if name.startswith("grpc") else ""),
            (f"{name}: steady cut into windows as long, ITL P99 / steady: median / worst",
             _window_ratios(p.get("steady_windows_p99_ms", []), steady["p99_ms"]), ""),
            (f"{name}: slowest step / loop lag, gap to commit",
             f"<= {p['call_to_commit']['step_max_ms']:g} / <= "
             f"{p['call_to_commit']['loop_lag_max_ms']:g} ms "
             f"({p['call_to_commit'].get('steps', 0):.0f} steps)", ""),
        ]  # fmt: skip
    for chunk_mib, rate in r.get("loopback_grpc_b_s", {}).items():
        rows.append((f"peer: bare gRPC over loopback, {chunk_mib} MiB chunks",
                     f"{rate / 1e9:.2f} GB/s", ""))  # fmt: skip
    if "throughput" in r:
        t = r["throughput"]
        for policy, p in t["policies"].items():
            rows.append((f"tok/s, a {t['transport']} push every {t['push_every_s']:g} s / none "
                         f"({policy})",
                         f"{p['pushing_tok_s']:.0f} / {t['quiet_tok_s']:.0f} = {p['ratio']:.3f}",
                         ">= 0.95"))  # fmt: skip
        if ratios := t.get("receiving_p99_ratios"):
            rows.append((f"{t['transport']}: ITL P99 while receiving / steady, the "
                         f"{len(ratios)} pushes above: median / worst",
                         f"{statistics.median(ratios):.2f}x / {max(ratios):.2f}x",
                         ""))  # fmt: skip
            first = r["pushes"].get(t["transport"])
            every = ([first["p99_ratio"]] if first else []) + ratios
            rows.append((f"{t['transport']}: ITL P99 while receiving / steady, all "
                         f"{len(every)} pushes of the run: median / worst",
                         f"{statistics.median(every):.2f}x / {max(every):.2f}x",
                         "<= 1.5x"))  # fmt: skip
    if bandwidth:
        rows.append(("device copy bandwidth (read + write)", f"{bandwidth:.0f} GB/s", ""))
    rows.append(("requests served / failed", f"{r['requests']} / {r['failed_requests']}", "0"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--clients", type=int, default=32, help="concurrent streams (default 32)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help="comma-separated, in order (default: grpc,ipc,dist)")  # fmt: skip
    parser.add_argument("--policy", default="migrate", choices=("migrate", "drain", "restart"))
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--steady", type=float, default=10.0, help="steady-state seconds")
    parser.add_argument("--gap", type=float, default=5.0, help="seconds between two pushes")
    parser.add_argument("--period", type=float, default=60.0,
                        help="seconds of each throughput run (0: none)")  # fmt: skip
    parser.add_argument("--push-every", type=float, default=10.0)
    parser.add_argument("--staging-share", type=float, default=0.0,
                        help="the daemon's --staging-share (0: its default; on a CPU device a "
                        "tenth of a core, which paces a gRPC push's copies)")  # fmt: skip
    parser.add_argument("--ipc-flatten", action="store_true",
                        help="IPC pushes send views of one flat copy of the tensors")  # fmt: skip
    parser.add_argument("--ipc-keep-mapped", action="store_true",
                        help="the daemon's --ipc-keep-mapped: the trainer's buffers are mapped "
                        "at the first IPC push only")  # fmt: skip
    parser.add_argument("--grpc-chunk-mib", default=str(DEFAULT_CHUNK_BYTES // 2**20),
                        help="comma-separated chunk sizes of gRPC pushes in MiB, one push "
                        "each (default: the client's)")  # fmt: skip
    parser.add_argument("--throughput-policies", default=None,
                        help="comma-separated swap policies, one throughput run each "
                        "(default: --policy)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None, help="where v1 is written")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    args.transports = [t for t in args.transports.split(",") if t]
    args.grpc_chunk_mib = [int(m) for m in args.grpc_chunk_mib.split(",") if m]
    args.throughput_policies = (args.throughput_policies or args.policy).split(",")
    if unknown := set(args.throughput_policies) - {"migrate", "drain", "restart"}:
        parser.error(f"unknown policies: {', '.join(sorted(unknown))}")
    if unknown := set(args.transports) - set(TRANSPORTS):
        parser.error(f"unknown transports: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="sitsd-push-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(args, work)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    flat = ", IPC from one flat buffer" if args.ipc_flatten else ""
    flat += ", kept mapped" if args.ipc_keep_mapped else ""
    print(f"\nlive pushes under load ({args.device}, {args.clients} streams, {args.policy}{flat})")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
