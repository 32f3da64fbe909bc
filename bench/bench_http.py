"""The HTTP front end's cost: decode tokens/s over HTTP against gRPC, and constrained decoding
(`json_schema`) against unconstrained, on the real daemon, in one run.

One daemon (`--scheduling-policy fcfs`, SmolLM2 on the CPU by default; `--model` and `--device`
pass through) serves both protocols. Each measurement keeps C streams going (C = 1 and 32):
every stream asks for `--max-tokens` tokens with `ignore_eos`, greedy, so every request
computes the same work; tokens/s counts the tokens the clients received over the wall time.
gRPC goes through `grpc.aio` stubs, HTTP through the official `openai.AsyncOpenAI` client,
streamed (SSE). Rounds alternate gRPC and HTTP so drift in the machine's load hits both; the
ratio of the medians is printed. The constrained run adds `response_format` with a JSON
schema to the 32 HTTP streams, right after the unconstrained 32 (after the grammar ends only
end-of-sequence is allowed, and `ignore_eos` keeps the request going, so the mask is computed
at every step). The machine's load average is printed at the start and after each round.
The daemon runs on all cores but the last and the clients on the last (`--no-pin`: any core),
so the clients' own work (the `openai` client parses SSE in Python) is not counted as the
daemon's, as it would not be with the clients on another machine.

    .venv/bin/python -m bench.bench_http [--max-tokens 64] [--rounds 3] [--no-pin]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import grpc.aio
import openai

from bench.daemon import BenchDaemon, split_cores
from sitsd.api.v1 import inference_pb2, inference_pb2_grpc

HTTP_URL = re.compile(r"http on (http://\S+/v1)")
PROMPT = "Write a long story about a lighthouse keeper and the sea."
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "chapters": {"type": "array", "items": {"type": "string", "maxLength": 60}},
    },
    "required": ["title", "chapters"],
}


async def grpc_streams(address: str, concurrency: int, max_tokens: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            chat=inference_pb2.ChatMessages(
                messages=[inference_pb2.ChatMessage(role="user", content=PROMPT)]
            ),
            sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0),
            ignore_eos=True,
        )

        async def one() -> int:
            return sum([len(r.token_ids) async for r in stub.Generate(request)])

        return await _timed(one, concurrency)


async def http_streams(
    url: str, concurrency: int, max_tokens: int, schema: dict | None = None
) -> float:
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    extra = {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "story", "schema": schema}}}  # fmt: skip

    async def one() -> int:
        stream = await client.chat.completions.create(
            model="", messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, **(extra if schema else {}),
        )  # fmt: skip
        usage = [c.usage async for c in stream if c.usage is not None]
        return usage[-1].completion_tokens

    try:
        return await _timed(one, concurrency)
    finally:
        await client.close()


async def _timed(one, concurrency: int) -> float:
    """Tokens/s of `concurrency` requests run at once."""
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one() for _ in range(concurrency))))
    return tokens / (time.perf_counter() - start)


def measure(daemon: BenchDaemon, url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Tokens/s of every measurement, one value per round; each round runs them all in turn."""
    runs: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        for concurrency in (1, 32):
            plan = [
                (
                    f"grpc c={concurrency}",
                    grpc_streams(daemon.address, concurrency, args.max_tokens),
                ),
                (f"http c={concurrency}", http_streams(url, concurrency, args.max_tokens)),
            ]
            if concurrency == 32:  # unconstrained beside constrained: the run just before
                plan.append(
                    ("http c=32 json_schema", http_streams(url, 32, args.max_tokens, SCHEMA))
                )
            for name, work in plan:
                runs.setdefault(name, []).append(asyncio.run(work))
        print(f"round {round_index + 1}/{args.rounds} done, load {_load()}", flush=True)
    return runs


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def report(runs: dict[str, list[float]]) -> None:
    median = {name: statistics.median(values) for name, values in runs.items()}
    print(f"\n{'measure':<34} {'tok/s (median)':>15}  runs")
    for name, value in median.items():
        print(f"{name:<34} {value:>15.1f}  {', '.join(f'{v:.1f}' for v in runs[name])}")
    print()
    for c in (1, 32):
        print(f"HTTP / gRPC at {c:>2} streams: {median[f'http c={c}'] / median[f'grpc c={c}']:.3f}")
    ratio = median["http c=32 json_schema"] / median["http c=32"]
    print(f"json_schema / unconstrained at 32 streams (HTTP): {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-pin", action="store_true",
                        help="let the daemon and the clients share every core")  # fmt: skip
    args = parser.parse_args()
    flags = ["--scheduling-policy", "fcfs", "--max-num-seqs", "32",
             "--model", args.model, "--device", args.device, "--no-step-spans"]  # fmt: skip
    daemon_cpus, client_cpus = split_cores(not args.no_pin)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)
    with tempfile.TemporaryDirectory() as state:
        daemon = BenchDaemon(Path(state), flags, cpus=daemon_cpus).wait_until_serving()
        try:
            url = HTTP_URL.search(daemon.log_text())
            assert url, "the daemon logged no HTTP address"
            where = "any core" if daemon_cpus is None else f"daemon on {sorted(daemon_cpus)}, " \
                f"clients on {sorted(client_cpus or ())}"  # fmt: skip
            print(f"load average at the start: {_load()} ({os.cpu_count()} CPUs; {where})",
                  flush=True)  # fmt: skip
            report(measure(daemon, url.group(1), args))
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
