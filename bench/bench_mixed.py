"""GPU benchmark of one mixed step (prompt tokens, with or without decodes): eager vs the
mixed-step CUDA graphs of `--mixed-graphs`. Called by `bench.bench_gpu`; runs alone too:
python3 -m bench.bench_mixed

Cases, Llama-3-8B shapes in bf16 (random weights), through `ModelRunner.launch` (input
building, forward, sampling), each repetition with fresh request ids so every step is the same:

* 32 decodes at a 512-token context + one 480-token prompt chunk (512 tokens: one bucket);
* a 512-token prompt alone.

Per case and mode: host ms (until `launch` returns, the GPU work queued), step ms (until the
sampled ids are on the host) and GPU ms (the step's kernel time from the profiler, per step).
A host-bound step has host ms close to step ms and GPU ms well below; graphs should bring
step ms down to about GPU ms.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import torch

from bench.engine_setup import random_checkpoint
from bench.shapes import LLAMA3_8B
from bench.timing import now
from sitsd.builder import build_runner
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig, WeightsConfig
from sitsd.outputs import NewRequestData, SchedulerOutput
from sitsd.types import SamplingParams
from sitsd.weights.checkpoint import Checkpoint

BLOCK = 16
CASES = {  # name -> (decode contexts, prompt chunk lengths)
    "32 decodes + 480-token chunk": ([512] * 32, [480]),
    "512-token prompt alone": ([], [512]),
}


def mixed_config() -> SitsdConfig:
    return SitsdConfig(
        model=ModelConfig(device="cuda", dtype="bfloat16", max_model_len=2048,
                          mixed_graphs=True),
        cache=CacheConfig(gpu_memory_utilization=0.5, block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
        weights=WeightsConfig(weight_slots="1"),
    )  # fmt: skip


def step_output(runner, rep: int, decodes: list[int], chunks: list[int]) -> SchedulerOutput:
    """One step's requests, new each time: decodes over a context said to be cached (their
    KV is whatever the pool holds), prompt chunks from scratch."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    version = runner.weights_version
    new, sched, next_block = [], {}, 0
    for i, n in enumerate(decodes + chunks):
        is_decode = i < len(decodes)
        req_id = f"{rep}-{i}"
        tokens = list(range(1, n + 2)) if is_decode else list(range(1, n + 1))
        table = list(range(next_block, next_block + -(-(len(tokens) + 1) // BLOCK)))
        next_block += len(table)
        computed = n if is_decode else 0
        new.append(NewRequestData(req_id, tokens, len(tokens), params, 0, table, computed,
                                  version))  # fmt: skip
        sched[req_id] = 1 if is_decode else n
    return SchedulerOutput(new_reqs=new, num_scheduled_tokens=sched,
                           total_num_scheduled_tokens=sum(sched.values()))  # fmt: skip


def measure(runner, decodes: list[int], chunks: list[int], reps: int = 30) -> dict:
    host, step = [], []
    for rep in range(reps + 5):
        so = step_output(runner, rep, decodes, chunks)
        torch.cuda.synchronize()
        t0 = now()
        pending = runner.launch(so)
        t1 = now()
        pending.result()
        t2 = now()
        runner.execute(SchedulerOutput(finished_req_ids=set(so.num_scheduled_tokens)))
        if rep >= 5:
            host.append(t1 - t0)
            step.append(t2 - t0)
    from torch.profiler import ProfilerActivity, profile

    n = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for rep in range(n):
            so = step_output(runner, 1000 + rep, decodes, chunks)
            runner.execute(so)
            runner.execute(SchedulerOutput(finished_req_ids=set(so.num_scheduled_tokens)))
        torch.cuda.synchronize()
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return {
        "host_ms": statistics.median(host) * 1e3,
        "step_ms": statistics.median(step) * 1e3,
        "gpu_ms": gpu_us / n / 1e3,
    }


def mixed_step_benchmark(ckpt: Checkpoint) -> dict:
    """{case: {"eager": {...}, "graphs": {...}, "buckets": [...], "capture_s": s}}."""
    runner, info = build_runner(mixed_config(), ckpt.arch, ckpt.tensors, "bench")
    mixed = dict(runner.slot_mixed)
    out: dict = {"buckets": list(info.mixed_graph_buckets),
                 "capture_s": info.mixed_graph_capture_s}  # fmt: skip
    for name, (decodes, chunks) in CASES.items():
        runner.slot_mixed = {}  # eager: what a step with prompt tokens does without the flag
        eager = measure(runner, decodes, chunks)
        runner.slot_mixed = mixed
        graphs = measure(runner, decodes, chunks)
        out[name] = {"eager": eager, "graphs": graphs}
        print(f"  mixed step, {name}: eager {eager['step_ms']:.2f} ms "
              f"(host {eager['host_ms']:.2f}, GPU {eager['gpu_ms']:.2f}); graphs "
              f"{graphs['step_ms']:.2f} ms (host {graphs['host_ms']:.2f}, "
              f"GPU {graphs['gpu_ms']:.2f})", flush=True)  # fmt: skip
    del runner, mixed
    gc.collect()
    torch.cuda.empty_cache()
    probe = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out["context_ok_after"] = bool(torch.isfinite((probe @ probe).float().sum()).item())
    return out


def print_mixed(results: dict) -> None:
    print(f"\nmixed steps (Llama-3-8B shapes, bf16): token buckets {results['buckets']} "
          f"captured in {results['capture_s']:.1f}s")  # fmt: skip
    print(f"{'case':<32}{'mode':<8}{'host ms':>9}{'step ms':>9}{'GPU ms':>9}")
    for name in CASES:
        for mode in ("eager", "graphs"):
            r = results[name][mode]
            print(f"{name:<32}{mode:<8}{r['host_ms']:>9.2f}{r['step_ms']:>9.2f}"
                  f"{r['gpu_ms']:>9.2f}")  # fmt: skip
        speedup = results[name]["eager"]["step_ms"] / results[name]["graphs"]["step_ms"]
        print(f"{'':<32}graphs {speedup:.2f}x faster per step")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.bench_mixed needs a CUDA GPU")
    print_mixed(mixed_step_benchmark(random_checkpoint(LLAMA3_8B, "llama-3-8b-random")))


if __name__ == "__main__":
    main()
