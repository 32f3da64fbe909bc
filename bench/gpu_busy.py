"""Is the engine GPU-bound while it decodes? The GPU's busy share of a window of steady decode.

With asynchronous scheduling the host prepares step N+1 while the GPU runs step N; the engine
step should then cost what the GPU does. `bench.bench_gpu` still shows engine steps 0.2 ms (batch
32) to 0.6 ms (batch 128) longer than a graph replay. This script tells the two possible causes
apart: it decodes a batch through the whole engine (Llama-3-8B shapes, random bf16, the CUDA
defaults, FCFS) and, once every request is past its prefill, records ~1 s of GPU kernels with
torch's profiler (CUDA activity only: it covers every thread's launches). The union of kernel
intervals over the window is the GPU's busy time:

- busy ~100%: the GPU work per step exceeds the replay (work outside the graph: input copies,
  sampling, the pending-token patch); the kernel table says which;
- busy well below 100%: the GPU waits for the host (the idle gap per step is the host's excess).

Runs on the device machine:  python3 -m bench.gpu_busy [--batches 1,32,128] [--window 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter

import torch

from bench.engine_setup import engine_config, random_checkpoint
from bench.shapes import LLAMA3_8B
from bench.timing import now
from sitsd.builder import build_engine
from sitsd.daemon import freeze_startup_objects
from sitsd.types import SamplingParams


def busy_share(events: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """The share of `window` (start, end) covered by the union of the `events` intervals."""
    start, end = window
    busy, reach = 0.0, start
    for s, e in sorted(events):
        s, e = max(s, reach), min(e, end)
        if e > s:
            busy += e - s
            reach = e
    return busy / (end - start)


async def measure(engine, batch: int, window_s: float) -> dict:
    arch = LLAMA3_8B
    rng = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, arch.vocab_size, (batch, 128), generator=rng).tolist()
    # Long enough to outlast the window (~200 steps) within the 2048-token context.
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    started = asyncio.Event()
    first = 0

    async def one(ids):
        nonlocal first
        seen = False
        async for delta in engine.add_request(ids, params):
            if delta.new_token_ids and not seen:
                seen = True
                first += 1
                if first == batch:
                    started.set()

    tasks = [asyncio.create_task(one(p)) for p in prompts]
    await started.wait()
    await asyncio.sleep(0.2)  # steady decode
    steps0 = engine.core.num_steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = now()
        await asyncio.sleep(window_s)
        torch.cuda.synchronize()
        wall = now() - t0
    steps = engine.core.num_steps - steps0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]  # us
    lo = min(s for s, _ in intervals)
    hi = max(e for _, e in intervals)
    per_kernel: Counter[str] = Counter()
    for e in kernels:
        per_kernel[e.name] += e.time_range.end - e.time_range.start
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": wall / max(steps, 1) * 1e3,
        "busy": busy_share(intervals, (lo, hi)),
        "gpu_ms_per_step": sum(per_kernel.values()) / 1e3 / max(steps, 1),
        "top": per_kernel.most_common(12),
    }


async def run(batches: list[int], window_s: float) -> None:
    ckpt = random_checkpoint(LLAMA3_8B, "llama-3-8b-random")
    engine = build_engine(engine_config(max(batches)), checkpoint=ckpt)
    await engine.start()
    freeze_startup_objects()
    for batch in batches:
        r = await measure(engine, batch, window_s)
        print(f"\nbatch {r['batch']}: {r['steps']} steps in the window, {r['step_ms']:.2f} ms "
              f"per engine step; GPU busy {r['busy']:.1%} of the window; kernel time "
              f"{r['gpu_ms_per_step']:.2f} ms per step; idle {(1 - r['busy']) * r['step_ms']:.2f}"
              " ms per step", flush=True)  # fmt: skip
        for name, us in r["top"]:
            print(f"  {us / 1e3 / max(r['steps'], 1):8.3f} ms/step  {name[:90]}")
    await engine.shutdown(5.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--window", type=float, default=1.0, help="seconds profiled per batch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.gpu_busy needs a CUDA GPU")
    asyncio.run(run([int(b) for b in args.batches.split(",")], args.window))


if __name__ == "__main__":
    main()
