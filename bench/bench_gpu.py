"""GPU benchmark: sitsd decode and throughput against the hardware floors and transformers.

Random weights in Llama-3-8B shapes, bf16; every figure is measured in this run, on this GPU:

1. the floors (`bench.floors`): device-to-device copy bandwidth (bytes read + written / time)
   and the bf16 matmul rate; a decode step's memory floor = bytes it must read (every weight but the
   embedding table, of which it reads one row per sequence, + the KV of every context) / copy
   bandwidth; its compute floor = 2 x non-embedding parameters x batch / matmul rate;
2. decode tokens/s at batch 1, 8, 32, 64, 128 (128-token prompts, 256 new tokens, greedy,
   through the whole engine: scheduler, runner, CUDA graphs, sampler, detokenizer) beside the
   step floor at the mean context;
3. batch-1 decode through transformers (static cache, which its `generate` compiles);
4. 256 requests of 512 prompt / 256 output tokens at once: output tokens/s beside the
   workload's floor (prefill FLOPs / matmul rate + each decode step at its floor), prefill
   TFLOP/s beside the matmul rate;
5. SmolLM2-135M-shaped decode step time with and without CUDA graphs at batch 1 and 32;
6. a mixed step (32 decodes + a 480-token chunk; a 512-token prompt alone), eager vs the
   mixed-step CUDA graphs (`--mixed-graphs`): host, step and GPU ms (`bench.bench_mixed`);
7. decode and the 256-request workload again one step at a time (`--no-async-scheduling`):
   what scheduling each step while the GPU runs the last one (the default on CUDA) buys.

The engine runs with the daemon's CUDA defaults: decode and mixed-step graphs, asynchronous
scheduling; FCFS (`bench.engine_setup.engine_config`).

Runs on the device machine:  python3 -m bench.bench_gpu [--quick] [--skip-peer] [--skip-mixed]
[--skip-in-turn] [--mixed-first]
Prints a table last; `--json PATH` writes every number.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

from bench.bench_mixed import mixed_step_benchmark, print_mixed
from bench.engine_setup import engine_config, graph_gpu_ms, random_checkpoint
from bench.floors import copy_bandwidth, decode_step_floor_s, matmul_rate, prefill_flops
from bench.shapes import LLAMA3_8B, SMOLLM2
from bench.timing import now
from sitsd.builder import build_engine, build_runner
from sitsd.daemon import freeze_startup_objects
from sitsd.model.arch import LlamaArch
from sitsd.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from sitsd.types import SamplingParams
from sitsd.weights.checkpoint import Checkpoint

# ---------------------------------------------------------------------------------- the engine


async def run_batch(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Submit all at once; decode tok/s from the moment every request has its first token."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    firsts, ends = [], []

    async def one(ids):
        first, produced = None, 0
        async for delta in engine.add_request(ids, params):
            first = first or now()
            produced += len(delta.new_token_ids)
            if delta.error:
                raise RuntimeError(f"a benchmark request ended early: {delta.error}")
        if produced != new_tokens:  # every figure below counts new_tokens per request
            raise RuntimeError(f"a benchmark request produced {produced} of {new_tokens} tokens")
        firsts.append(first)
        ends.append(now())

    t0 = now()
    await asyncio.gather(*(one(p) for p in prompts))
    n = len(prompts)
    return {
        "decode_tok_s": n * (new_tokens - 1) / (max(ends) - max(firsts)),
        "output_tok_s": n * new_tokens / (max(ends) - t0),
        "wall_s": max(ends) - t0,
        "ttft_s": max(firsts) - t0,
    }


async def engine_benchmarks(
    ckpt: Checkpoint, batches: list[int], quick: bool, ahead: bool | None = None
) -> dict:
    """Decode at each batch size and the 256-request workload; `ahead`: asynchronous
    scheduling on or off (None: the default, on with CUDA)."""
    arch = ckpt.arch
    max_seqs = 256
    engine = build_engine(engine_config(max_seqs, ahead=ahead), checkpoint=ckpt)
    await engine.start()
    freeze_startup_objects()  # as the daemon does: no full collection scans them mid-run
    rng = torch.Generator().manual_seed(1)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(1, arch.vocab_size, (n, length), generator=rng).tolist()

    out = {"decode": {}, "blocks": engine.status().num_blocks_total}
    new_tokens = 64 if quick else 256
    await run_batch(engine, prompts(2, 128), 8)  # warm-up
    for b in batches:
        out["decode"][b] = await run_batch(engine, prompts(b, 128), new_tokens)
        print(f"  sitsd batch {b}{' (in turn)' if ahead is False else ''}: "
              f"{out['decode'][b]['decode_tok_s']:.0f} decode tok/s", flush=True)  # fmt: skip
    n = 64 if quick else 256
    out["throughput"] = await run_batch(engine, prompts(n, 512), new_tokens)
    out["throughput"]["num_requests"] = n
    out["throughput"]["new_tokens"] = new_tokens
    # Prefill alone: the same requests asking for one token each.
    out["prefill"] = await run_batch(engine, prompts(n, 512), 1)
    print(f"  sitsd throughput: {out['throughput']['output_tok_s']:.0f} out tok/s", flush=True)
    await engine.shutdown(5.0)
    gc.unfreeze()  # the engine's objects may go now (the peer needs its memory)
    out["graph_gpu_ms"] = graph_gpu_ms(engine.core.runner, batches, context=128 + new_tokens // 2)
    return out


def transformers_peer(ckpt: Checkpoint, new_tokens: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    a = ckpt.arch
    cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                      intermediate_size=a.intermediate_size, num_hidden_layers=a.num_layers,
                      num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                      rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings,
                      tie_word_embeddings=a.tie_word_embeddings, dtype=torch.bfloat16)  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.load_state_dict(ckpt.tensors, strict=False)  # the same weights as sitsd
    ids = torch.randint(1, a.vocab_size, (1, 128), device="cuda")

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        t0 = now()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       cache_implementation="static", pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
        return now() - t0

    t0 = now()
    generate(new_tokens)  # compiles
    compile_s = now() - t0
    rates = []
    for _ in range(3):
        rates.append((new_tokens - 1) / (generate(new_tokens) - generate(1)))
    return {"decode_tok_s": statistics.median(rates), "first_call_s": compile_s}


def graph_vs_eager(arch: LlamaArch) -> dict:
    """Runner-level decode step time (host work included) with and without CUDA graphs."""
    ckpt = random_checkpoint(arch, "smollm2-shaped")
    out = {}
    for eager in (False, True):
        cfg = engine_config(32, eager=eager, util=0.2)
        runner, _ = build_runner(cfg, arch, ckpt.tensors, "bench")
        for batch in (1, 32):
            out[(eager, batch)] = decode_step_ms(runner, batch)
        del runner
        torch.cuda.empty_cache()
    return out


def decode_step_ms(runner, batch: int, context: int = 128, steps: int = 60) -> float:
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    blocks_per = -(-(context + steps + 2) // 16)
    reqs = [f"r{i}" for i in range(batch)]
    new = [NewRequestData(r, list(range(1, context + 1)), context, params, 0,
                          list(range(i * blocks_per, (i + 1) * blocks_per)), 0,
                          runner.weights_version)
           for i, r in enumerate(reqs)]  # fmt: skip
    runner.execute(SchedulerOutput(new_reqs=new, num_scheduled_tokens=dict.fromkeys(reqs, context),
                                   total_num_scheduled_tokens=batch * context))  # fmt: skip
    times = []
    for step in range(steps):
        cached = [CachedRequestData(r, [], context + step) for r in reqs]
        so = SchedulerOutput(cached_reqs=cached, num_scheduled_tokens=dict.fromkeys(reqs, 1),
                             total_num_scheduled_tokens=batch)  # fmt: skip
        t0 = now()
        runner.execute(so)  # ends with the host sync that returns the token ids
        times.append(now() - t0)
    runner.execute(SchedulerOutput(finished_req_ids=set(reqs)))
    return statistics.median(times[5:]) * 1e3


# ------------------------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    parser.add_argument("--skip-peer", action="store_true", help="no transformers peer")
    parser.add_argument("--skip-mixed", action="store_true", help="no mixed-step graphs case")
    parser.add_argument(
        "--mixed-first",
        action="store_true",
        help="the mixed-step case first: every later runner is built after its graphs are gone",
    )
    parser.add_argument(
        "--skip-in-turn", action="store_true", help="no run with --no-async-scheduling"
    )
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.bench_gpu needs a CUDA GPU")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
          f"{props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)  # fmt: skip
    bw, mm = copy_bandwidth(), matmul_rate()
    print(f"copy {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    results: dict = {"copy_bw": bw, "matmul_rate": mm}
    ckpt = random_checkpoint(LLAMA3_8B, "llama-3-8b-random")
    if args.mixed_first and not args.skip_mixed:
        results["mixed_step"] = mixed_step_benchmark(ckpt)
        print_mixed(results["mixed_step"])
        gc.collect()
        torch.cuda.empty_cache()
    step = graph_vs_eager(SMOLLM2)
    results["smollm2_step_ms"] = {f"{'eager' if e else 'graphs'}_b{b}": v
                                  for (e, b), v in step.items()}  # fmt: skip
    batches = [1, 8, 32, 64, 128]
    eng = asyncio.run(engine_benchmarks(ckpt, batches, args.quick))
    results["engine"] = eng
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    new_tokens = 64 if args.quick else 256
    print_table(results, batches, new_tokens)
    if not args.skip_peer:
        gc.collect()  # the engine's tensors (KV pool) go before the peer loads its copy
        torch.cuda.empty_cache()
        results["peer"] = transformers_peer(ckpt, new_tokens)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
        print_table(results, batches, new_tokens)
    if not args.skip_in_turn:
        gc.collect()
        torch.cuda.empty_cache()
        results["engine_in_turn"] = asyncio.run(
            engine_benchmarks(ckpt, batches, args.quick, ahead=False)
        )
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
        print_in_turn(results, batches, new_tokens)
    if not args.skip_mixed and not args.mixed_first:  # last: if it breaks, the tables stand
        gc.collect()
        torch.cuda.empty_cache()
        results["mixed_step"] = mixed_step_benchmark(ckpt)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
        print_mixed(results["mixed_step"])


def print_in_turn(results: dict, batches: list[int], new_tokens: int) -> None:
    """Steps in turn (`--no-async-scheduling`) vs scheduled ahead (the default), same run,
    same floors."""
    arch, bw, mm = LLAMA3_8B, results["copy_bw"], results["matmul_rate"]
    turn, ahead = results["engine_in_turn"], results["engine"]
    ctx = 128 + new_tokens / 2
    print("\nasynchronous scheduling (Llama-3-8B shapes): tok/s, fraction of the floor")
    print(f"{'measure':<30}{'in turn':>10}{'ahead':>10}{'floor':>10}{'ratio':>8}")
    for b in batches:
        floor_s = decode_step_floor_s(arch, b, ctx, bw, mm)[0]
        t, a = turn["decode"][b]["decode_tok_s"], ahead["decode"][b]["decode_tok_s"]
        print(f"{f'decode batch {b}':<30}{t:>10.0f}{a:>10.0f}{b / floor_s:>10.0f}"
              f"{a * floor_s / b:>8.2f}")  # fmt: skip
    t, a = turn["throughput"]["output_tok_s"], ahead["throughput"]["output_tok_s"]
    print(f"{'256 x 512/256 output tok/s':<30}{t:>10.0f}{a:>10.0f}")


def print_table(results: dict, batches: list[int], new_tokens: int) -> None:
    arch, bw, mm = LLAMA3_8B, results["copy_bw"], results["matmul_rate"]
    eng = results["engine"]
    print("\nsitsd GPU benchmark (Llama-3-8B shapes, random bf16 weights)")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    print(f"{'measure':<44}{'sitsd':>10}{'floor/peer':>12}{'ratio':>8}")
    ctx = 128 + new_tokens / 2
    for b in batches:
        floor_s, mem_s, comp_s = decode_step_floor_s(arch, b, ctx, bw, mm)
        got = eng["decode"][b]["decode_tok_s"]
        bound = "memory" if mem_s >= comp_s else "compute"
        print(f"{f'decode batch {b} tok/s ({bound} floor)':<44}{got:>10.0f}{b / floor_s:>12.0f}"
              f"{got * floor_s / b:>8.2f}")  # fmt: skip
    tp = eng["throughput"]
    n, new = tp["num_requests"], tp["new_tokens"]
    prefill_s = prefill_flops(arch, n, 512) / mm
    decode_s = sum(decode_step_floor_s(arch, n, 512 + i, bw, mm)[0] for i in range(new))
    floor_tp = n * new / (prefill_s + decode_s)
    print(f"{f'{n} x 512/{new} output tok/s':<44}{tp['output_tok_s']:>10.0f}{floor_tp:>12.0f}"
          f"{tp['output_tok_s'] / floor_tp:>8.2f}")  # fmt: skip
    pf = prefill_flops(arch, n, 512) / eng["prefill"]["wall_s"]
    print(f"{'prefill TFLOP/s (matmul rate)':<44}{pf / 1e12:>10.0f}{mm / 1e12:>12.0f}"
          f"{pf / mm:>8.2f}")  # fmt: skip
    gpu = eng.get("graph_gpu_ms", {})
    for b, ms in gpu.items():
        engine_ms = 1e3 * int(b) / eng["decode"][b]["decode_tok_s"]
        floor_ms = 1e3 * decode_step_floor_s(arch, int(b), ctx, bw, mm)[0]
        print(f"{f'batch {b} step ms: GPU (graph) / engine':<44}{ms:>10.2f}{engine_ms:>12.2f}"
              f"{ms / engine_ms:>8.2f}  floor {floor_ms:.2f} ms")  # fmt: skip
    peer = results.get("peer")
    if peer:
        b1 = eng["decode"][1]["decode_tok_s"]
        print(f"{'batch 1 decode vs transformers (static+compile)':<44}{b1:>10.0f}"
              f"{peer['decode_tok_s']:>12.0f}{b1 / peer['decode_tok_s']:>8.2f}")  # fmt: skip
    s = results["smollm2_step_ms"]
    for b in (1, 32):
        g, e = s[f"graphs_b{b}"], s[f"eager_b{b}"]
        print(f"{f'SmolLM2 step ms batch {b}: graphs vs eager':<44}{g:>10.3f}{e:>12.3f}"
              f"{e / g:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
