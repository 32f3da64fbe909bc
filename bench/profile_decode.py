"""Where a decode step's GPU time goes: kernel breakdown of graph replays, GEMM efficiency.

Runs on the device machine: python3 bench/profile_decode.py. Llama-3-8B shapes, random bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import (
    LLAMA3_8B,
    copy_bandwidth,
    engine_config,
    random_checkpoint,
    timed_ms,
)

from sitsd.builder import build_runner


def main() -> None:
    bw = copy_bandwidth()
    ckpt = random_checkpoint(LLAMA3_8B, "llama-3-8b-random")
    runner, _ = build_runner(engine_config(128, util=0.5), LLAMA3_8B, ckpt.tensors, "prof")
    d = runner.builder.dev
    d.slot_mapping.fill_(-1)
    d.seq_lens.fill_(256)
    blocks = torch.arange(runner.builder.max_blocks_per_seq, dtype=torch.int32, device="cuda")
    d.block_tables.copy_(blocks.expand_as(d.block_tables))
    for b in (1, 32, 128):
        bucket = runner.graphs.bucket_for(b)
        for _ in range(3):
            runner.graphs.replay(bucket)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.graphs.replay(bucket)
            torch.cuda.synchronize()
        replay_ms = timed_ms(lambda bucket=bucket: runner.graphs.replay(bucket))
        print(f"\n=== batch {b}: graph replay {replay_ms:.3f} ms; kernels over 5 replays ===")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=14, max_name_column_width=70
            )
        )
    w = runner.weights.layers[0]
    shapes = {"qkv": w.qkv_proj, "o": w.o_proj, "gate_up": w.gate_up_proj,
              "down": w.down_proj, "lm_head": runner.weights.lm_head}  # fmt: skip
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; cuBLAS (F.linear) per shape:")
    for m in (1, 8, 128):
        for name, weight in shapes.items():
            x = torch.randn(m, weight.shape[1], device="cuda", dtype=torch.bfloat16)
            ms = timed_ms(lambda x=x, weight=weight: torch.nn.functional.linear(x, weight), 50)
            gbs = weight.numel() * 2 / (ms / 1e3) / 1e9
            print(f"  M={m:<4} {name:<8} {tuple(weight.shape)}: {ms * 1e3:8.1f} us "
                  f"{gbs:7.0f} GB/s ({gbs * 1e9 / bw:.2f} of copy)")  # fmt: skip


if __name__ == "__main__":
    main()
