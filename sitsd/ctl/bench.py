"""`sitsctl bench`: an open-loop load generator that reports latency per SLA tier.

Requests arrive as a Poisson process at `--rate` per second (open loop: a slow daemon does not
slow the arrivals), or from `--concurrency N` clients that each send the next request when the
last one ended. Each request draws its tier from `--tier-mix`, a prompt length and an output
length (uniform over `--prompt-tokens A:B` and `--max-tokens A:B`, `ignore_eos` so the length
is exact). Prompts are windows of real English text tokenized once by the daemon
(`Inference.Tokenize`) and sent as token ids, at random offsets so the prefix cache does not
turn the run into a cache benchmark. The run stops sending after `--duration` seconds or
`--num-requests`, then waits for the requests in flight.

Tier targets for goodput come from `--tiers FILE`, else from the daemon (`Admin.Status`, needs
the admin token), else the built-in SITS table. A tqdm bar on stderr shows progress; stdout gets
the table, or JSON with `--json`; `--plot FILE.png` draws percentiles over time
(`sitsd.ctl.bench_report`, which also does the statistics). `--openai URL` sends the same load
to any OpenAI-compatible server instead (`sitsd.ctl.bench_openai`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio

from sitsd.api.v1 import admin_pb2, inference_pb2_grpc
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.ctl import bench_openai
from sitsd.ctl.bench_report import (
    TIERS,
    Draw,
    RequestRecord,
    format_report,
    plot_reports,
    summarize,
)
from sitsd.ctl.client import Client, CtlError

TIER_TO_PROTO = {"gold": pb.TIER_GOLD, "silver": pb.TIER_SILVER, "bronze": pb.TIER_BRONZE}
# Plain English, varied enough that token windows at random offsets differ.
CORPUS = (
    "The river rose slowly through the night, and by morning the low fields were silver with "
    "water. Farmers walked the dikes with lanterns, counting the posts that still stood. In the "
    "town, the baker lit his ovens an hour early, because people who cannot sleep want bread. "
    "A scheduler decides which work runs next; a good one keeps promises to those who wait. "
    "Mountains are slow clocks: their faces record ice ages in scratches and fallen stone. "
    "She opened the old atlas and traced the coastline with a finger, naming the harbours "
    "aloud as if calling ships home. Light takes about eight minutes to reach us from the sun, "
    "so every sunrise is a small piece of history. The committee met on Tuesday, argued about "
    "the budget for an hour, and agreed only to meet again. Bees tell each other where flowers "
    "are by dancing, and the angle of the dance points toward the food. When the power failed, "
    "the city grew quiet enough to hear the sea, which had been there all along. "
)


# ------------------------------------------------------------------------------ arguments


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        a, b = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or A:B, got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"need 1 <= A <= B, got {text!r}")
    return a, b


def _tier_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in TIERS:
            raise argparse.ArgumentTypeError(f"unknown tier {name!r} (gold, silver, bronze)")
        try:
            mix[name] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad weight in {part!r}") from None
        if mix[name] < 0:
            raise argparse.ArgumentTypeError(f"negative weight in {part!r}")
    if sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError("the tier weights add up to 0")
    return mix


def _positive(kind: type) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "bench",
        help="load-test the daemon; latency, goodput and refusals per tier",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--rate",
        type=_positive(float),
        metavar="R",
        help="Poisson arrivals, R requests per second (default: 4)",
    )
    load.add_argument(
        "--concurrency",
        type=_positive(int),
        metavar="N",
        help="N clients, each sending its next request when the last ended",
    )
    stop = p.add_mutually_exclusive_group()
    stop.add_argument(
        "--duration", type=_positive(float), metavar="S", help="send for S seconds (default: 30)"
    )
    stop.add_argument("--num-requests", type=_positive(int), metavar="N", help="send N requests")
    p.add_argument(
        "--tier-mix",
        type=_tier_mix,
        default=_tier_mix("gold=0.2,silver=0.3,bronze=0.5"),
        metavar="T=W,...",
        help="tier weights (default: gold=0.2,silver=0.3,bronze=0.5)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=_range,
        default=(32, 256),
        metavar="A:B",
        help="prompt length, uniform in [A, B] tokens (default: 32:256)",
    )
    p.add_argument(
        "--max-tokens",
        type=_range,
        default=(16, 128),
        metavar="A:B",
        help="output length, uniform in [A, B] tokens (default: 16:128)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw (default: 0)")
    p.add_argument(
        "--deadline",
        type=_positive(float),
        default=None,
        metavar="S",
        help="deadline of each request (default: none)",
    )
    p.add_argument(
        "--tiers",
        default="",
        metavar="FILE",
        help="tiers file with the targets goodput is judged by (default: the daemon's)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--plot",
        default="",
        metavar="FILE.png",
        help="draw TTFT and inter-token P99 over time per tier (needs matplotlib)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    bench_openai.add_flags(p)
    p.set_defaults(run=run_bench)


# ---------------------------------------------------------------------------------- plan


def tier_targets(
    args: argparse.Namespace, client: Client
) -> tuple[dict[str, tuple[float, float]], str]:
    """tier -> (TTFT target, inter-token target) in seconds, and where they came from."""
    from sitsd.config import TiersConfig

    if args.tiers:
        from sitsd.tiers_file import load_tiers_file

        try:
            config = load_tiers_file(args.tiers)
        except (OSError, ValueError) as exc:
            raise CtlError(f"--tiers: {exc}") from None
        return {t: (config.tier(t).ttft_p99_s, config.tier(t).itl_p99_s) for t in TIERS}, args.tiers
    try:
        status = None if args.openai else client.admin.Status(
            admin_pb2.StatusRequest(),
            metadata=client.admin_metadata(),
            timeout=client.unary_timeout,
        )  # fmt: skip
        if status is not None and status.tiers:
            return {
                t.tier: (t.ttft_p99_target_s, t.itl_p99_target_s) for t in status.tiers
            }, "daemon"
    except (CtlError, grpc.RpcError):
        pass
    config = TiersConfig()
    return {t: (config.tier(t).ttft_p99_s, config.tier(t).itl_p99_s) for t in TIERS}, "built-in"


def corpus_token_ids(client: Client, min_tokens: int) -> list[int]:
    """Token ids of the corpus, repeated until there are at least `min_tokens`.

    Tokenized a sentence at a time: the daemon refuses text that cannot fit its context, and
    a sentence fits the shortest one (ids of the daemon's BOS may thus be among them).
    """
    ids: list[int] = []
    for sentence in CORPUS.split(". "):
        request = pb.TokenizeRequest(text=sentence.strip() + ". ")
        ids += client.inference.Tokenize(request, timeout=client.unary_timeout).token_ids
    if not ids:
        raise CtlError("the daemon tokenized the benchmark corpus to nothing")
    while len(ids) < min_tokens:
        ids += ids
    return ids


class Plan:
    """Draws each request's tier, prompt and output length from one seeded generator."""

    def __init__(self, args: argparse.Namespace, corpus_length: int) -> None:
        self.rng = random.Random(args.seed)
        self.args = args
        self.corpus_length = corpus_length
        self.tiers = list(args.tier_mix)
        self.weights = [args.tier_mix[t] for t in self.tiers]

    def next_request(self) -> Draw:
        rng, args = self.rng, self.args
        tier = rng.choices(self.tiers, self.weights)[0]
        num_prompt = rng.randint(*args.prompt_tokens)
        max_tokens = rng.randint(*args.max_tokens)
        # A fraction, not randrange: the generator's later draws (the next tiers) must not
        # depend on the corpus length, which differs between gRPC's token ids and --openai's words.
        start = int(rng.random() * (self.corpus_length - num_prompt + 1))
        return Draw(tier, num_prompt, max_tokens, start)

    def next_gap(self) -> float:
        return self.rng.expovariate(self.args.rate)


def grpc_request(draw: Draw, corpus: list[int]) -> pb.GenerateRequest:
    """`draw` as a `Generate` request: greedy, `ignore_eos`, the prompt as token ids."""
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=corpus[draw.start : draw.start + draw.num_prompt_tokens]),
        sampling=pb.SamplingParams(max_tokens=draw.max_tokens, temperature=0.0),
        ignore_eos=True,
        tier=TIER_TO_PROTO[draw.tier],
    )


# ----------------------------------------------------------------------------------- run


async def send_one(
    stub: inference_pb2_grpc.InferenceStub,
    tier: str,
    request: pb.GenerateRequest,
    t0: float,
    deadline: float | None,
) -> RequestRecord:
    """Send one request and time its tokens."""
    record = RequestRecord(
        tier, len(request.token_ids.ids), request.sampling.max_tokens, time.perf_counter() - t0
    )
    try:
        async for response in stub.Generate(request, timeout=deadline):
            now = time.perf_counter() - t0
            if response.token_ids:
                if record.first_token_at is None:
                    record.first_token_at = now
                record.token_times += [now] * len(response.token_ids)
                record.num_output_tokens += len(response.token_ids)
        record.status = "OK"
    except grpc.aio.AioRpcError as exc:
        record.status = exc.code().name
    record.ended_at = time.perf_counter() - t0
    return record


Send = Callable[[Draw, float], Awaitable[RequestRecord]]


async def run_load(
    args: argparse.Namespace, plan: Plan, send: Send, on_done: Callable[[RequestRecord], None]
) -> tuple[list[RequestRecord], float]:
    """Send the planned load; every record, and the wall time from start to the last end."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    budget = _Budget(args, t0)

    async def one() -> None:
        record = await send(plan.next_request(), t0)
        records.append(record)
        on_done(record)

    if args.concurrency:
        await asyncio.gather(*(_client_loop(budget, one) for _ in range(args.concurrency)))
    else:
        tasks = []
        next_at = t0
        while budget.take():
            tasks.append(asyncio.ensure_future(one()))
            next_at += plan.next_gap()
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        await asyncio.gather(*tasks)
    return records, time.perf_counter() - t0


async def run_grpc(
    args: argparse.Namespace, client: Client, on_done: Callable[[RequestRecord], None]
) -> tuple[list[RequestRecord], float]:
    """The load on the daemon's gRPC `Generate`, prompts as token ids of the corpus."""
    corpus = corpus_token_ids(client, args.prompt_tokens[1] + 1)
    plan = Plan(args, len(corpus))
    async with grpc.aio.insecure_channel(client.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def send(draw: Draw, t0: float) -> RequestRecord:
            return await send_one(stub, draw.tier, grpc_request(draw, corpus), t0, args.deadline)

        return await run_load(args, plan, send, on_done)


async def run_openai(
    args: argparse.Namespace, on_done: Callable[[RequestRecord], None]
) -> tuple[list[RequestRecord], float]:
    """The same load on `--openai URL` (`sitsd.ctl.bench_openai`)."""
    words = bench_openai.words_of(CORPUS, args.prompt_tokens[1] + 1)
    async with bench_openai.OpenAiTarget(args, words) as target:
        return await run_load(args, Plan(args, len(words)), target.send, on_done)


class _Budget:
    """How many more requests may be sent: by count, or until the duration has passed."""

    def __init__(self, args: argparse.Namespace, t0: float) -> None:
        self.left = args.num_requests
        self.until = None if args.num_requests else t0 + (args.duration or 30.0)

    def take(self) -> bool:
        if self.until is not None:
            return time.perf_counter() < self.until
        if self.left <= 0:
            return False
        self.left -= 1
        return True


async def _client_loop(budget: _Budget, one: Callable[[], Awaitable[None]]) -> None:
    while budget.take():
        await one()


def run_bench(args: argparse.Namespace, client: Client) -> int:
    if not args.rate and not args.concurrency:
        args.rate = 4.0
    targets, source = tier_targets(args, client)
    progress = _progress_bar(args)

    def on_done(record: RequestRecord) -> None:
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(record.status, refresh=False)

    # What exists now (grpc, the corpus, the plan) lives through the run: out of the collector's
    # scans, so that a full collection cannot pause every stream this client times.
    gc.collect()
    gc.freeze()
    try:
        load = run_openai(args, on_done) if args.openai else run_grpc(args, client, on_done)
        records, duration = asyncio.run(load)
    finally:
        gc.unfreeze()
        if progress is not None:
            progress.close()
    settings = {
        "rate": args.rate,
        "concurrency": args.concurrency,
        "duration": args.duration,
        "num_requests": args.num_requests,
        "tier_mix": args.tier_mix,
        "prompt_tokens": list(args.prompt_tokens),
        "max_tokens": list(args.max_tokens),
        "seed": args.seed,
        "deadline": args.deadline,
        "targets_from": source,
        "target": args.openai or client.address,
    }
    report = summarize(records, duration_s=duration, targets=targets, settings=settings)
    if args.plot:
        plot_reports([("sitsctl bench", report)], args.plot)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _progress_bar(args: argparse.Namespace):  # -> tqdm | None
    if args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=args.num_requests, unit="req", file=sys.stderr, desc="bench", dynamic_ncols=True
    )
