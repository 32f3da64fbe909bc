"""What a decode step serving two weights versions costs on the GPU, beside one serving one.

Runs on the device machine: python3 -m bench.probe_two_versions [--rows 32,128]. One runner
with two weight slots (Llama-3-8B shapes, random bf16 weights copied into both), each slot's
decode graphs captured as the engine captures them. For each row count it times, by CUDA
events: the step on one version (every row on slot 0); the engine's two-version step (a
sub-batch on each slot, replayed in turn on one stream, as `ModelRunner.launch` does); and the
same two sub-batches replayed on two streams at once (not what the engine does: whether the two
graphs' kernels would fill each other's gaps). Beside them the floor: the bytes of one or two
slots' weights over the measured copy bandwidth.

A migration, a drain and a restart serve two versions until the last request leaves the old
one, and every such step reads both weight sets; at 32 streams (a memory-bound step) that sets
how close to the steady step those phases can come, whatever the pacing does.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import torch

from bench.engine_setup import engine_config, fill_decode_inputs, random_checkpoint
from bench.floors import copy_bandwidth
from bench.shapes import LLAMA3_8B
from bench.timing import median_ms
from sitsd.builder import build_runner
from sitsd.config import WeightsConfig
from sitsd.runtime.cuda_graphs import DecodeGraphs


def _in_turn(first: DecodeGraphs, second: DecodeGraphs, rows: tuple[int, int]) -> None:
    """The engine's two-version step: one sub-batch after the other on the current stream."""
    first.replay(first.bucket_for(rows[0]))
    second.replay(second.bucket_for(rows[1]))


def _side_by_side(
    first: DecodeGraphs, second: DecodeGraphs, rows: tuple[int, int], side: torch.cuda.Stream
) -> None:
    """The two sub-batches on two streams, joined on the current one."""
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    first.replay(first.bucket_for(rows[0]))
    with torch.cuda.stream(side):
        second.replay(second.bucket_for(rows[1]))
    main.wait_stream(side)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="32,128",
                        type=lambda t: [int(r) for r in t.split(",") if r])  # fmt: skip
    parser.add_argument("--context", type=int, default=256, help="tokens of KV a row attends")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.probe_two_versions needs a CUDA GPU")
    bw = copy_bandwidth()
    ckpt = random_checkpoint(LLAMA3_8B, "llama-3-8b-random")
    config = engine_config(max(args.rows), util=0.85)
    # Decode graphs only: the mixed-step graphs are not what this measures.
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, mixed_graphs=False),
        weights=WeightsConfig(weight_slots="2"),
    )
    runner, info = build_runner(config, LLAMA3_8B, ckpt.tensors, "v1")
    if info.num_weight_slots != 2:
        sys.exit("two weight slots did not fit")
    slots = runner.slots
    standby = slots.standby
    slots.release(standby)
    slots.copy_into(standby, ckpt.tensors)
    slots.fill(standby, "v2")
    del ckpt
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    fill_decode_inputs(runner, args.context)
    first, second = runner.slot_graphs[slots.index_of("v1")], runner.slot_graphs[standby]
    slot_gb = slots.nbytes(standby) / 1e9
    floor_ms = slot_gb * 1e9 / bw * 1e3  # as `bench.floors` prices a step's bytes
    print(f"{torch.cuda.get_device_name()}; copy {bw / 1e9:.0f} GB/s; one slot {slot_gb:.2f} GB, "
          f"its floor {floor_ms:.2f} ms")  # fmt: skip
    side = torch.cuda.Stream()
    print(f"{'rows':>5} {'split':>9} {'one version':>12} {'two, in turn':>13} "
          f"{'two, at once':>13} {'in turn / one':>14} {'one / floor':>12} "
          f"{'in turn / two floors':>21}")  # fmt: skip
    for rows in args.rows:
        one = median_ms(functools.partial(first.replay, first.bucket_for(rows)), repeats=50)
        for split in ((rows // 2, rows - rows // 2), (rows - 1, 1)):
            turn = median_ms(functools.partial(_in_turn, first, second, split), repeats=50)
            once = median_ms(functools.partial(_side_by_side, first, second, split, side),
                             repeats=50)  # fmt: skip
            print(f"{rows:>5} {f'{split[0]}+{split[1]}':>9} {one:>10.2f}ms {turn:>11.2f}ms "
                  f"{once:>11.2f}ms {turn / one:>13.2f}x {one / floor_ms:>11.2f}x "
                  f"{turn / (2 * floor_ms):>20.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
