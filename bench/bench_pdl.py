"""Programmatic dependent launch, measured: decode graph replays with and without it.

Builds the runner twice (Llama-3-8B shapes, random bf16, decode CUDA graphs as the daemon
captures them, mixed-step graphs off: they play no part here), once with the decode kernels
launched with PDL (`kernels/_pdl.py`, the sm_90+ default) and once without, and times one graph
replay per batch with CUDA events (median of 20) at a 256-token context, beside the step's
floor. Same run, same GPU, same weights: the ratio is PDL's own effect.

Runs on the device machine:  python3 -m bench.bench_pdl [--batches 1,8,32,64,128]
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import replace

import torch

from bench.engine_setup import engine_config, graph_gpu_ms, random_checkpoint
from bench.floors import copy_bandwidth, decode_step_floor_s, matmul_rate
from bench.shapes import LLAMA3_8B
from sitsd.builder import build_runner

CONTEXT = 256


def replay_ms(ckpt, batches: list[int], pdl: bool) -> dict[int, float]:
    cfg = engine_config(max(batches))
    cfg = replace(cfg, model=replace(cfg.model, pdl=pdl, mixed_graphs=False))
    runner, _ = build_runner(cfg, ckpt.arch, ckpt.tensors, "bench")
    assert runner.model.kernels.name == ("triton-pdl" if pdl else "triton")
    out = graph_gpu_ms(runner, batches, CONTEXT)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,64,128")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not torch.cuda.is_available():
        sys.exit("bench.bench_pdl needs a CUDA GPU")
    bw, mm = copy_bandwidth(), matmul_rate()
    gc.collect()
    torch.cuda.empty_cache()
    ckpt = random_checkpoint(LLAMA3_8B, "llama-3-8b-random")
    without = replay_ms(ckpt, batches, pdl=False)
    with_pdl = replay_ms(ckpt, batches, pdl=True)
    print(f"\n{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s, matmul "
          f"{mm / 1e12:.0f} TFLOP/s; one decode graph replay at context {CONTEXT}")  # fmt: skip
    print(f"{'batch':>5} {'floor ms':>9} {'no PDL ms':>10} {'PDL ms':>8} {'PDL gain':>9} "
          f"{'of floor (no PDL / PDL)':>24}")  # fmt: skip
    for b in batches:
        floor = decode_step_floor_s(LLAMA3_8B, b, CONTEXT, bw, mm)[0] * 1e3
        print(f"{b:>5} {floor:>9.2f} {without[b]:>10.3f} {with_pdl[b]:>8.3f} "
              f"{without[b] / with_pdl[b]:>8.3f}x {floor / without[b]:>12.3f} / "
              f"{floor / with_pdl[b]:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
