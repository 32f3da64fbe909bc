"""GPU probe: how many parts the INT4 `mma` layers should split K into, from 17 rows up.

Past `INT4_MERGE_ROWS` rows a second kernel sums the split-K partials: float32 `[SPLIT_K, M,
N]` written by the layer and read back, then the output in 16 bits (gate_up at 128 rows, split
in two: 29 MB read, 7 MB written). Split less and that traffic and a launch go; the grid has
fewer programs, each a longer loop. Per Llama-3-8B layer, row count and INT4 format (symmetric
codes, and zero points: the engine's RTN), the default configuration's tile at each split from
1 to 8 (no more parts than groups), launched as `QuantizedLinears` launches it (PDL up to
`INT4_PDL_MAX_ROWS` rows, the splits merged in the kernel up to `INT4_MERGE_ROWS`) and
graph-timed over rotating weight copies as `bench.bench_quant_kernels` does; `*` marks the
default's split. `--max-registers` replaces the defaults' register cap (0: none, the
compiler's choice); `--tile M,N,WARPS` their tile (block_m, block_n, num_warps).

    python3 -m bench.probe_int4_split [--rows 32,64,128] [--layers qkv,o,gate_up,down]
        [--max-registers N] [--tile 64,128,8]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch

from bench.bench_quant_kernels import SHAPES, Bench, int4_linear
from bench.probe_int4_launch import launch
from bench.shapes import LLAMA3_8B
from sitsd.kernels.int4_matmul import choose_int4_config
from sitsd.model.qlinear import QuantizedLinears, int4_pdl_pays, int4_split_counters

SPLITS = (1, 2, 4, 8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,64,128")
    parser.add_argument("--layers", default=",".join(SHAPES))
    parser.add_argument("--max-registers", type=int, default=None)
    parser.add_argument("--tile", default=None, help="block_m,block_n,num_warps for every call")
    args = parser.parse_args(argv)
    bench = Bench.on_gpu("bench.probe_int4_split")
    rows = [int(r) for r in args.rows.split(",")]
    served = QuantizedLinears(split_counters=int4_split_counters(LLAMA3_8B, torch.device("cuda")))
    print(f"{torch.cuda.get_device_name()}, copy {bench.copy_gbs:.0f} GB/s; us per call")
    heads = " ".join(f"{'split ' + str(s):>9}" for s in SPLITS)
    print(f"{'layer':<8} {'fmt':<7} {'M':>4} {heads}  default tile")
    best: dict[tuple[str, int], list[float]] = {}
    for name in args.layers.split(","):
        n, k = SHAPES[name]
        for fmt in ("int4", "int4 zp"):
            zp = fmt == "int4 zp"
            copies = bench.copies(fmt, n, k)
            for num_rows in rows:
                x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
                expected = int4_linear(x, copies[0])
                default = choose_int4_config(num_rows, n, k, 128, has_offsets=zp, has_zeros=zp)
                if args.max_registers is not None:
                    default = dataclasses.replace(default, max_registers=args.max_registers or None)
                if args.tile:
                    block_m, block_n, warps = (int(v) for v in args.tile.split(","))
                    default = dataclasses.replace(default, block_m=block_m, block_n=block_n,
                                                  num_warps=warps)  # fmt: skip
                cells, times = [], {}
                for split in SPLITS:
                    if split > k // 128:
                        cells.append(f"{'-':>9}")
                        continue
                    config = dataclasses.replace(default, split_k=split)
                    fn = functools.partial(launch, pdl=int4_pdl_pays(num_rows),
                                           counters=served.counters_for(num_rows, n),
                                           config=config)  # fmt: skip
                    torch.testing.assert_close(fn(x, copies[0]), expected, atol=2e-2, rtol=2e-2)
                    times[split] = bench.time_linear(fn, x, copies)
                    mark = "*" if split == default.split_k else " "
                    cells.append(f"{times[split]:8.2f}{mark}")
                row = best.setdefault((fmt, num_rows), [0.0, 0.0])
                row[0] += times[default.split_k]
                row[1] += min(times.values())
                tile = f"m{default.block_m} n{default.block_n} w{default.num_warps}"
                tile += "" if default.x_ahead else " x in loop"
                tile += f" cap {default.max_registers}" if default.max_registers else ""
                print(f"{name:<8} {fmt:<7} {num_rows:>4} {' '.join(cells)}  {tile}", flush=True)
            del copies
            torch.cuda.empty_cache()
    for (fmt, num_rows), (default_us, best_us) in best.items():
        print(f"{args.layers} {fmt:<7} {num_rows:>4}: default {default_us:8.2f}, best split "
              f"per layer {best_us:8.2f} us")  # fmt: skip


if __name__ == "__main__":
    main()
