"""What the tier scheduler alone does to gold's time to first token, in simulated time.

The real `Scheduler` with a stand-in for the model (`TokenRunner`: each request's tokens, the
next one sampled as the last + 1), driven like the engine core (admission control at arrival,
shedding, schedule, step, update), with each step's duration from a model of the daemon on the
GPU: `base + per-prompt-token x prompt tokens + per-sequence x sequences` (defaults fitted to
Llama-3-8B shapes on an H200 with `--mixed-graphs`: inter-token P50 ~10 ms at ~64 running, a
2048-token step ~50 ms, and the FCFS capacity of the daemon there, ~28 requests/s, within a few
percent). Arrivals are the overload benchmark's (`bench.bench_tiers` on the GPU): Poisson,
20% gold / 30% silver / 50% bronze, prompts 128-512, outputs 64-256 tokens, `--max-num-seqs 64`.

No network, no event loop, no GIL: the gap between these figures and the daemon's is what the
delivery path (engine thread -> asyncio -> gRPC -> client) adds. Deterministic for a seed.

    .venv/bin/python -m bench.sim_tiers [--rate 56] [--duration 40] [--budget 2048]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

from bench.timing import percentile
from sitsd.config import SchedulerConfig, TiersConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler
from sitsd.outputs import ModelRunnerOutput, SchedulerOutput
from sitsd.types import FinishReason, SamplingParams, Tier

BLOCK = 16
VOCAB_SIZE = 1000


class TokenRunner:
    """The model, as far as the simulation needs one: it keeps each request's tokens and, when
    a step's chunk reaches the last of them, samples the last + 1. Time is the simulation's
    model, not this runner's; it checks nothing (the tests' fake runner does)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}  # req_id -> prompt + outputs so far
        self.num_computed: dict[str, int] = {}  # req_id -> tokens computed

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(req_id, None)
            self.num_computed.pop(req_id, None)
        for new in so.new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        sampled = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            self.num_computed[req_id] += num_tokens
            if self.num_computed[req_id] == len(tokens):  # the chunk ends the known tokens
                tokens.append((tokens[-1] + 1) % VOCAB_SIZE)
                sampled.append([tokens[-1]])
            else:  # mid-prompt: nothing sampled
                sampled.append([])
        return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)


def arrivals(rate: float, duration: float, seed: int) -> list[tuple[float, Tier, int, int]]:
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        u = rng.random()
        tier = Tier.GOLD if u < 0.2 else Tier.SILVER if u < 0.5 else Tier.BRONZE
        out.append((t, tier, rng.randint(128, 512), rng.randint(64, 256)))


def simulate(args: argparse.Namespace, policy: str, gold_step_tokens: int) -> dict:
    """{tier: (first tokens, P50, P90, P99 ms, refused, shed)} of one run."""
    now = 0.0
    tiers = replace(TiersConfig(), gold_step_tokens=gold_step_tokens)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.budget, policy=policy)  # fmt: skip
    sched = Scheduler(config, KVCacheManager(40000, BLOCK), 2048, clock=lambda: now, tiers=tiers)
    runner = TokenRunner()
    pending = arrivals(args.rate, args.duration, args.seed)
    tier_of: dict[str, Tier] = {}
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    refused = dict.fromkeys(Tier, 0)
    shed = dict.fromkeys(Tier, 0)
    i = 0
    # Asynchronous scheduling: the step scheduled now was scheduled while the last one ran, so
    # it sees the arrivals up to the last step's start only.
    visible = now
    while i < len(pending) or sched.has_work():
        horizon = visible if args.ahead else now
        while i < len(pending) and pending[i][0] <= horizon:
            at, tier, prompt, output = pending[i]
            i += 1
            request = Request(
                req_id=f"r{i}", prompt_token_ids=[(i * 7 + k) % 1000 for k in range(prompt)],
                params=SamplingParams(max_tokens=output, ignore_eos=True), seed=0, tier=tier,
                arrival_time=at, weights_version="fake@0",
            )  # fmt: skip
            if sched.admission_refusal(request) is not None:
                refused[tier] += 1
                continue
            sched.add_request(request)
            tier_of[request.req_id], arrived[request.req_id] = tier, at
        if not sched.has_work():
            now = visible = max(now, pending[i][0])
            continue
        for req_id, _ in sched.overdue_requests(now):
            sched.finish_request(req_id, FinishReason.ABORT)
            shed[tier_of[req_id]] += 1
        so = sched.schedule()
        if not so.num_scheduled_tokens:
            now += 1e-3
            continue
        out = runner.execute(so)
        visible = now
        decodes = sum(1 for n in so.num_scheduled_tokens.values() if n == 1)
        prompt_tokens = so.total_num_scheduled_tokens - decodes
        now += (args.base_ms + args.per_token_ms * prompt_tokens
                + args.per_seq_ms * len(so.num_scheduled_tokens)) / 1e3  # fmt: skip
        for update in sched.update_from_output(so, out):
            req_id = update.request.req_id
            if req_id not in ttft and update.request.num_output_tokens:
                ttft[req_id] = now - arrived[req_id]
    result = {}
    for tier in Tier:
        values = sorted(v for r, v in ttft.items() if tier_of[r] is tier)
        if values:
            p50, p90, p99 = (1e3 * percentile(values, p) for p in (50, 90, 99))
            result[tier.value] = (len(values), p50, p90, p99, refused[tier], shed[tier])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=56.0, help="arrivals per second")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--base-ms", type=float, default=8.0)
    parser.add_argument("--per-token-ms", type=float, default=0.021)
    parser.add_argument("--per-seq-ms", type=float, default=0.03)
    parser.add_argument("--ahead", action="store_true",
                        help="model asynchronous scheduling (a step sees arrivals up to the "
                        "start of the step before it)")  # fmt: skip
    args = parser.parse_args()
    print(f"{'policy':<24}{'tier':<8}{'first':>6}{'p50':>7}{'p90':>7}{'p99 ms':>8}"
          f"{'refused':>9}{'shed':>6}")  # fmt: skip
    for label, policy, gold_step in (("tiers", "tiers", 512), ("tiers, gold_step 0", "tiers", 0),
                                     ("fcfs", "fcfs", 0)):  # fmt: skip
        for tier, (n, p50, p90, p99, refused, shed) in simulate(args, policy, gold_step).items():
            print(f"{label:<24}{tier:<8}{n:>6}{p50:>7.0f}{p90:>7.0f}{p99:>8.0f}{refused:>9}"
                  f"{shed:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
