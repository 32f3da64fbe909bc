"""Hostile input against a normal stream: its inter-token latency alone and while one client
loops the hostile requests of issue 15's items 6-8, on the real daemon over gRPC.

The daemon serves SmolLM2-135M-Instruct (`--model default`, CPU unless `--device`). The normal
stream is one Generate of NEW_TOKENS tokens from a short prompt (greedy, `ignore_eos`); its
inter-token latency is the gap between consecutive responses after the first, seen by the
client. The hostile client, a process of its own (so its request building does not share the
measuring client's interpreter), loops without pause over:

- malformed bytes (item 6): `12 02 ff fe` (bad UTF-8) to Generate and Tokenize, garbage, and
  unknown groups nested past the parser's limit;
- large prompts (item 7): 4 MB of text to Generate and Tokenize (refused before tokenizing),
  and text of about twice the context in tokens, under the byte limit (tokenized off the event
  loop, then refused for its length);
- costly sampling (item 8): 290k stop strings (4 MB, refused), and a generation that runs with
  the most stop strings allowed at their longest and `top_k = 2^32 - 1` (clamped to the
  vocabulary), four tokens each.

The daemon and the clients run on separate cores (the daemon on all but the last, every
client on the last; `--no-pin` turns this off), as a client on another machine would: on a
small machine a client process beside the daemon otherwise measures the machine (on two cores a
`while True: pass` client alone doubles the inter-token latency) instead of what the daemon
does with hostile bytes. With the pinning, a control run beside a plain CPU-burning client
shows what remains of that.

Runs alternate, alone and with the hostile client, `--repeats` pairs (the order alternating),
so a drift in the machine's load between pairs cancels. Prints the median inter-token latency
of each side (the median over the pairs of each run's median) and P90, the ratio (the issue asks
at most 1.5), and the hostile calls by status.

    .venv/bin/python -m bench.bench_hostile [--repeats 3] [--new-tokens 64] [--no-pin] [--json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path

import grpc

from bench.daemon import BenchDaemon, split_cores
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.api.v1 import inference_pb2_grpc

GENERATE = "/sitsd.api.v1.Inference/Generate"
TOKENIZE = "/sitsd.api.v1.Inference/Tokenize"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SENTENCE = "The quick brown fox jumps over the lazy dog while the farmer watches. "


def stream_gaps_ms(address: str, new_tokens: int) -> list[float]:
    """One normal stream: the gaps between its responses after the first, in ms."""
    request = pb.GenerateRequest(
        text=PROMPT,
        sampling=pb.SamplingParams(max_tokens=new_tokens, temperature=0.0),
        ignore_eos=True,
    )
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        times = [time.perf_counter() for _ in stub.Generate(request, timeout=600)]
    return [(b - a) * 1000 for a, b in itertools.pairwise(times[1:])]


def hostile_calls(max_model_len: int) -> list[tuple[str, str, bytes]]:
    """(name, method path, request bytes) of each hostile request, looped in this order."""
    huge_text = "a" * 4_000_000  # under gRPC's 4 MiB message limit: sitsd's check refuses it
    # ~2x the context in tokens (English runs ~4.7 bytes a token), within the byte limit
    over_context = SENTENCE * (max_model_len * 10 // len(SENTENCE) + 1)
    most_stops = [f"{i:02d}" + "z" * 254 for i in range(16)]
    calls: list[tuple[str, str, pb.GenerateRequest | pb.TokenizeRequest | bytes]] = [
        ("bad UTF-8 (Generate)", GENERATE, bytes.fromhex("1202fffe")),
        ("bad UTF-8 (Tokenize)", TOKENIZE, bytes.fromhex("1202fffe")),
        ("garbage", GENERATE, b"\xff" * 16),
        ("nested 300 deep", GENERATE, b"\x9b\x01" * 300 + b"\x9c\x01" * 300),
        ("4 MB prompt (Generate)", GENERATE, pb.GenerateRequest(text=huge_text)),
        ("4 MB text (Tokenize)", TOKENIZE, pb.TokenizeRequest(text=huge_text)),
        ("prompt over the context", GENERATE, pb.GenerateRequest(text=over_context)),
        ("290k stop strings", GENERATE,
         pb.GenerateRequest(text=PROMPT, stop=[f"s{i:05d}x7" for i in range(290_000)])),
        ("16 longest stops, top_k 2^32-1", GENERATE,
         pb.GenerateRequest(text=PROMPT, stop=most_stops, ignore_eos=True,
                            sampling=pb.SamplingParams(max_tokens=4, top_k=2**32 - 1))),
    ]  # fmt: skip
    return [(n, p, r if isinstance(r, bytes) else r.SerializeToString()) for n, p, r in calls]


def hostile_loop(
    address: str,
    max_model_len: int,
    cpus: set[int] | None,
    ready: Event,
    stop: Event,
    counts: dict[str, int],
) -> None:
    """Loop the hostile calls until `stop` (`ready` once the first round is done); `counts`
    (shared) gets "name: STATUS" tallies. Runs on `cpus` (None: any)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    calls = hostile_calls(max_model_len)
    tally: Counter[str] = Counter()
    with grpc.insecure_channel(address) as channel:
        while not stop.is_set():
            for name, path, payload in calls:
                tally[f"{name}: {call_status(channel, path, payload)}"] += 1
            ready.set()
    counts.update(tally)


def call_status(channel: grpc.Channel, path: str, payload: bytes) -> str:
    try:
        if path == GENERATE:
            for _ in channel.unary_stream(path)(payload, timeout=600):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=600)
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def burn_loop(cpus: set[int] | None, ready: Event, stop: Event) -> None:
    """The control client: CPU work that sends nothing, until `stop`."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    ready.set()
    while not stop.is_set():
        sum(range(10_000))


def with_client(
    address: str,
    max_model_len: int,
    cpus: set[int] | None,
    run: Callable[[], list[float]],
    hostile: bool = True,
):
    """`run()` while the hostile client (else the control client) loops; (its result, the
    hostile calls by status)."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        ready, stop, counts = context.Event(), context.Event(), manager.dict()
        client = context.Process(
            target=hostile_loop if hostile else burn_loop,
            args=(address, max_model_len, cpus, ready, stop, counts) if hostile
            else (cpus, ready, stop),
        )  # fmt: skip
        client.start()
        try:
            if not ready.wait(600):  # one round done: every kind of call is under way
                raise RuntimeError("the hostile client did not finish a round in 600 s")
            result = run()
        finally:
            stop.set()
            client.join(120)
            if client.is_alive():
                client.kill()
        return result, dict(counts)


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (default: 3)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens of the normal stream")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-pin", action="store_true",
                        help="let the daemon and the clients share every core")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    daemon_cpus, client_cpus = split_cores(not args.no_pin)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)  # the measuring client, and the Manager it starts

    with tempfile.TemporaryDirectory() as state:
        daemon = BenchDaemon(Path(state), ["--model", "default", "--device", args.device],
                             cpus=daemon_cpus)  # fmt: skip
        try:
            daemon.wait_until_serving()
            with grpc.insecure_channel(daemon.address) as channel:
                models = inference_pb2_grpc.InferenceStub(channel).ListModels(
                    pb.ListModelsRequest(), timeout=30
                )
            max_model_len = models.models[0].max_model_len
            stream_gaps_ms(daemon.address, 8)  # warm-up
            alone: list[list[float]] = []
            hostile: list[list[float]] = []
            control: list[list[float]] = []
            counts: Counter[str] = Counter()
            stream = functools.partial(stream_gaps_ms, daemon.address, args.new_tokens)
            for i in range(args.repeats):
                for side in ("alone", "hostile") if i % 2 == 0 else ("hostile", "alone"):
                    if side == "alone":
                        alone.append(stream())
                        continue
                    gaps, tally = with_client(daemon.address, max_model_len, client_cpus, stream)
                    hostile.append(gaps)
                    counts.update(tally)
                control.append(
                    with_client(daemon.address, max_model_len, client_cpus, stream, False)[0]
                )
                print(f"pair {i + 1}/{args.repeats} done", file=sys.stderr)
            traceback_in_log = "Traceback" in daemon.log_text()
        finally:
            daemon.stop()

    report = figures(alone, hostile, control, counts, traceback_in_log)
    on = {"daemon": sorted(daemon_cpus or cores), "clients": sorted(client_cpus or cores)}
    report["cores"] = on
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"normal stream, {args.new_tokens} tokens, {args.repeats} pairs of runs ({args.device}; "
          f"daemon on cores {on['daemon']}, clients on {on['clients']})")  # fmt: skip
    print(f"  inter-token latency alone:       median {report['alone_median_ms']:.1f} ms, "
          f"P90 {report['alone_p90_ms']:.1f} ms")  # fmt: skip
    print(f"  with the hostile client looping: median {report['hostile_median_ms']:.1f} ms, "
          f"P90 {report['hostile_p90_ms']:.1f} ms")  # fmt: skip
    print(f"  beside a CPU-burning client:     median {report['control_median_ms']:.1f} ms, "
          f"P90 {report['control_p90_ms']:.1f} ms")  # fmt: skip
    print(f"  ratio of the medians: {report['ratio']:.2f} (at most 1.5 asked); "
          f"the control's: {report['control_ratio']:.2f}")  # fmt: skip
    print(f"  traceback in the daemon's log: {traceback_in_log}")
    print("hostile calls by status:")
    for name, count in sorted(counts.items()):
        print(f"  {count:6d}  {name}")


def figures(
    alone: list[list[float]],
    hostile: list[list[float]],
    control: list[list[float]],
    counts: Counter[str],
    traceback: bool,
) -> dict[str, object]:
    alone_median = statistics.median(statistics.median(g) for g in alone)
    hostile_median = statistics.median(statistics.median(g) for g in hostile)
    control_median = statistics.median(statistics.median(g) for g in control)
    return {
        "control_median_ms": control_median,
        "control_p90_ms": statistics.median(p90(g) for g in control),
        "control_ratio": control_median / alone_median,
        "alone_median_ms": alone_median,
        "alone_p90_ms": statistics.median(p90(g) for g in alone),
        "hostile_median_ms": hostile_median,
        "hostile_p90_ms": statistics.median(p90(g) for g in hostile),
        "ratio": hostile_median / alone_median,
        "hostile_calls": dict(counts),
        "traceback_in_log": traceback,
    }


if __name__ == "__main__":
    main()
