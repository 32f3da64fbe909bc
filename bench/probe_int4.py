"""One INT4 layer call, repeated, for a profiler to look at (`ncu`): Llama-3-8B's shapes,
random group-128 weights with zero points, bf16 x.

    ncu --kernel-name regex:int4 --launch-skip 3 --launch-count 1 --section WarpStateStats \
        python3 -m bench.probe_int4 --layer down --rows 1 --config mma,16,256,128,4,4,3
"""

from __future__ import annotations

import argparse

import torch

from bench.shapes import LLAMA3_8B, linear_shapes
from sitsd.kernels.int4_matmul import Int4MatmulConfig, int4_matmul
from sitsd.kernels.quant_layout import pack_int4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="down")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--config", default="", help="mode,block_m,block_n,block_k,split_k,"
                        "num_warps,num_stages (default: the chosen one)")  # fmt: skip
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    n, k = linear_shapes(LLAMA3_8B)[args.layer]
    codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    scales = (torch.rand(k // 128, n, device="cuda") + 0.5).half() / 300
    offsets = -(torch.randint(0, 16, scales.shape, device="cuda").float() * scales.float())
    x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
    config = None
    if args.config:
        mode, *nums = args.config.split(",")
        config = Int4MatmulConfig(mode, *(int(v) for v in nums))
    qweight = pack_int4(codes)
    for _ in range(args.calls):
        int4_matmul(x, qweight, scales, offsets, 128, config=config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
