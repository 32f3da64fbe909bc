"""Probe: what mode `mma` would cost if x needed no reordering (weights stored slice-major).

`int4_matmul`'s `mma` multiplies a group's eight nibble slices with x's columns in slice-major
order: either each program permutes x on its way into shared memory (tiles under 64 rows), or
one copy (`slice_major_x`) puts x in that order before the kernel. A weight whose codes were
stored in slice-major order at load would let x be read as it is. This times, per Llama-3-8B
layer and row count: the default configuration; the same tiles with x ordered by the copy; the
copy alone; and the same weight with its codes stored slice-major (`to_slice_major_weight`),
which the kernels multiply with x as it is.

    python3 -m bench.probe_x_order [--rows 8,16,32,64,128] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch

from bench.bench_quant_kernels import (
    DTYPE,
    GROUP,
    SHAPES,
    SMOKE_SHAPES,
    Bench,
    int4_linear,
)
from bench.floors import copy_bandwidth
from sitsd.kernels.int4_matmul import choose_int4_config, slice_major_x
from sitsd.quant.layout import to_slice_major_weight


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,16,32,64,128")
    parser.add_argument("--smoke", action="store_true", help="small shapes on the CPU")
    args = parser.parse_args(argv)
    bench = Bench(
        smoke=args.smoke, copy_gbs=0.0 if args.smoke else copy_bandwidth() / 1e9, slice_major=False
    )  # the column order; slice-major copies made below
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    print(f"{'fmt':8} {'layer':8} {'rows':>5} {'default':>9} {'ordered':>9} {'copy':>7} "
          f"{'ord-copy':>9} {'sliced':>9}  tile")  # fmt: skip
    for fmt in ("int4", "int4 zp"):
        totals: dict[int, list[float]] = {}
        for num_rows in [int(r) for r in args.rows.split(",")]:
            for layer, (n, k) in shapes.items():
                copies = bench.copies(fmt, n, k)
                sliced = [to_slice_major_weight(w) for w in copies]
                x = torch.randn(num_rows, k, device=bench.device, dtype=DTYPE)
                zp = fmt == "int4 zp"
                default = choose_int4_config(num_rows, n, k, GROUP, has_offsets=zp, has_zeros=zp)
                ordered = default
                if default.mode == "mma":
                    ordered = dataclasses.replace(default, order_x=True)
                t_default = bench.time_linear(functools.partial(int4_linear, config=default), x,
                                              copies)  # fmt: skip
                t_ordered = bench.time_linear(functools.partial(int4_linear, config=ordered), x,
                                              copies)  # fmt: skip
                t_copy = bench.us([functools.partial(slice_major_x, x, None)] * 20)
                t_sliced = bench.time_linear(functools.partial(int4_linear, config=default), x,
                                             sliced)  # fmt: skip
                free = t_ordered - t_copy
                row = totals.setdefault(num_rows, [0.0, 0.0])
                row[0] += t_default
                row[1] += t_sliced
                print(f"{fmt:8} {layer:8} {num_rows:5d} {t_default:9.2f} {t_ordered:9.2f} "
                      f"{t_copy:7.2f} {free:9.2f} {t_sliced:9.2f}  m{default.block_m} "
                      f"n{default.block_n} k{default.block_k} s{default.split_k}",
                      flush=True)  # fmt: skip
        for num_rows, (t_default, t_sliced) in totals.items():
            print(f"{fmt:8} 4 layers {num_rows:5d} default {t_default:8.1f} us, slice-major "
                  f"{t_sliced:8.1f} us ({t_default / t_sliced:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
