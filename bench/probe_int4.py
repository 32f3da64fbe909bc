"""One INT4 layer call, repeated, for a profiler to look at (`ncu`): Llama-3-8B's shapes, random
group-128 weights in the layout CUDA serves (slice-major codes; with `--format zp` integer zero
points, the engine's RTN format), bf16 x, launched as the engine launches it (PDL and the split
merge where `QuantizedLinears` uses them) unless `--plain`.

    ncu --kernel-name regex:int4 --launch-skip 3 --launch-count 1 --section WarpStateStats \
        python3 -m bench.probe_int4 --layer gate_up --rows 32 --format zp \
        --config "mma m32 n64 k128 s4 w4 p3 x in loop"

`--config` takes a configuration as `bench.bench_quant_kernels` prints it (without "sweep").
"""

from __future__ import annotations

import argparse

import torch

from bench.bench_quant_kernels import config_of, make_weight
from bench.shapes import LLAMA3_8B, linear_shapes
from sitsd.kernels.int4_matmul import int4_matmul
from sitsd.model.qlinear import QuantizedLinears, int4_pdl_pays, int4_split_counters
from sitsd.quant.layout import Int4Weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="down", choices=sorted(linear_shapes(LLAMA3_8B)))
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--format", choices=("sym", "zp"), default="zp")
    parser.add_argument("--config", default="", help='e.g. "mma m32 n64 k128 s4 w4 p3 x in loop" '
                        "(default: the one int4_matmul chooses)")  # fmt: skip
    parser.add_argument("--plain", action="store_true", help="no PDL, splits summed apart")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    n, k = linear_shapes(LLAMA3_8B)[args.layer]
    w: Int4Weight = make_weight("int4 zp" if args.format == "zp" else "int4", n, k, "cuda")
    x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
    config = config_of(f"sweep {args.config}") if args.config else None
    pdl = not args.plain and int4_pdl_pays(args.rows)
    served = QuantizedLinears(split_counters=int4_split_counters(LLAMA3_8B, x.device))
    counters = None if args.plain else served.counters_for(args.rows, n)
    for _ in range(args.calls):
        int4_matmul(x, w.qweight, w.scales, w.offsets, w.group_size, w.perm, config=config,
                    zeros=w.zeros, pdl=pdl, split_counters=counters,
                    slice_major=w.slice_major)  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
