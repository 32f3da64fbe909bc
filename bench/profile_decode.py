"""Where a decode step's GPU time goes: kernel breakdown of graph replays, GEMM efficiency.

Runs on the device machine: python3 -m bench.profile_decode [--precision int4-g128]
[--batches 1,32,128] [--without linears,others,norms,rotary,attention,swiglu]. Llama-3-8B
shapes, random bf16 weights, served as they are or quantized at load by the precision's map
(`bench.bench_quant_engine.PRECISIONS`, as `sitsd serve --quantize` does). `--without` then
recaptures the graphs without each family of kernels named (`bench.decode_ablation`) and prints
each replay beside the full step's.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import torch

from bench.bench_quant_engine import PRECISIONS
from bench.decode_ablation import FAMILIES, without
from bench.engine_setup import (
    engine_config,
    fill_decode_inputs,
    quantized_at_load,
    random_checkpoint,
)
from bench.floors import copy_bandwidth
from bench.shapes import LLAMA3_8B
from bench.timing import median_ms
from sitsd.builder import build_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16")
    parser.add_argument("--batches", default="1,32,128",
                        type=lambda t: [int(b) for b in t.split(",") if b])  # fmt: skip
    parser.add_argument("--without", default="", help=f"families to leave out: {FAMILIES}",
                        type=lambda t: [f for f in t.split(",") if f])  # fmt: skip
    args = parser.parse_args()
    if unknown := set(args.without) - set(FAMILIES):
        parser.error(f"--without takes {FAMILIES}, got {sorted(unknown)}")
    if not torch.cuda.is_available():
        sys.exit("bench.profile_decode needs a CUDA GPU")
    bw = copy_bandwidth()
    ckpt = random_checkpoint(LLAMA3_8B, "llama-3-8b-random")
    body = PRECISIONS[args.precision]
    # A quantized runner keeps a standby slot as large as the 16-bit version beside its own.
    config = engine_config(max(128, *args.batches), util=0.5 if body is None else 0.8)
    with tempfile.TemporaryDirectory(prefix="sitsd-profile-") as tmp:
        config = quantized_at_load(config, body, Path(tmp))
        runner, _ = build_runner(config, LLAMA3_8B, ckpt.tensors, "prof")
    print(f"weights: {runner.weights.precision}")
    fill_decode_inputs(runner, 256)
    full: dict[int, float] = {}  # batch -> the full step's graph replay, ms
    for b in args.batches:
        bucket = runner.graphs.bucket_for(b)
        for _ in range(3):
            runner.graphs.replay(bucket)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.graphs.replay(bucket)
            torch.cuda.synchronize()
        replay_ms = full[b] = median_ms(functools.partial(runner.graphs.replay, bucket))
        print(f"\n=== batch {b}: graph replay {replay_ms:.3f} ms; kernels over 5 replays ===")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=24, max_name_column_width=70
            )
        )
    served = runner.model.kernels
    for family in args.without:
        runner.model.kernels = without(served, family, runner.weights.lm_head)
        runner.capture_graphs(args.batches)
        for b in args.batches:
            ms = median_ms(functools.partial(runner.graphs.replay, runner.graphs.bucket_for(b)))
            print(f"batch {b}: graph replay {full[b]:.3f} ms, without {family} {ms:.3f} ms "
                  f"({full[b] - ms:.3f} ms theirs)")  # fmt: skip
    runner.model.kernels = served  # (the graphs stay the last family's: none replays again)
    if body is not None:
        return  # cuBLAS per shape: for 16-bit weights
    w = runner.weights.layers[0]
    shapes = {"qkv": w.qkv_proj, "o": w.o_proj, "gate_up": w.gate_up_proj,
              "down": w.down_proj, "lm_head": runner.weights.lm_head}  # fmt: skip
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; cuBLAS (F.linear) per shape:")
    for m in (1, 8, 128):
        for name, weight in shapes.items():
            x = torch.randn(m, weight.shape[1], device="cuda", dtype=torch.bfloat16)
            linear = functools.partial(torch.nn.functional.linear, x, weight)
            ms = median_ms(linear, repeats=50)
            gbs = weight.numel() * 2 / (ms / 1e3) / 1e9
            print(f"  M={m:<4} {name:<8} {tuple(weight.shape)}: {ms * 1e3:8.1f} us "
                  f"{gbs:7.0f} GB/s ({gbs * 1e9 / bw:.2f} of copy)")  # fmt: skip


if __name__ == "__main__":
    main()
