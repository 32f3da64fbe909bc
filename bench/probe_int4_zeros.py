"""GPU probe: what integer zero points cost the INT4 layers, against symmetric codes.

Per Llama-3-8B layer and row count, launched as `QuantizedLinears` launches them (PDL and the
split merge where it uses them), graph-timed over rotating weight copies as
`bench.bench_quant_kernels` does: symmetric codes at their default configuration; codes with
zero points (the engine's RTN format) at theirs (`choose_int4_config(has_zeros=True)`); and
the same codes on the tile that offsets needing x's sums take (`has_zeros=False`, GGUF's
minima: 128 weight rows a program), which zero points took before session 32. The last
column is the zero points' default.

    python3 -m bench.probe_int4_zeros [--rows 8,32,128]
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench.bench_quant_kernels import SHAPES, Bench
from bench.probe_int4_launch import launch
from bench.shapes import LLAMA3_8B
from sitsd.kernels.int4_matmul import choose_int4_config
from sitsd.model.qlinear import QuantizedLinears, int4_pdl_pays, int4_split_counters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32,128")
    args = parser.parse_args(argv)
    bench = Bench.on_gpu("bench.probe_int4_zeros")
    rows = [int(r) for r in args.rows.split(",")]
    served = QuantizedLinears(split_counters=int4_split_counters(LLAMA3_8B, torch.device("cuda")))
    print(f"{torch.cuda.get_device_name()}, copy {bench.copy_gbs:.0f} GB/s; us per call")
    print(f"{'layer':<8} {'M':>4} {'sym':>8} {'zp':>8} {'zp n128':>9}  config")
    totals: dict[int, list[float]] = {r: [0.0, 0.0, 0.0] for r in rows}
    for name, (n, k) in SHAPES.items():
        sym, zp = bench.copies("int4", n, k), bench.copies("int4 zp", n, k)
        for num_rows in rows:
            x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
            as_served = functools.partial(launch, pdl=int4_pdl_pays(num_rows),
                                          counters=served.counters_for(num_rows, n))  # fmt: skip
            default = choose_int4_config(num_rows, n, k, 128, has_offsets=True, has_zeros=True)
            sums_tile = choose_int4_config(num_rows, n, k, 128, has_offsets=True)
            torch.testing.assert_close(as_served(x, zp[0], config=sums_tile),
                                       as_served(x, zp[0], config=default), atol=2e-2,
                                       rtol=2e-2)  # fmt: skip
            times = [
                bench.time_linear(functools.partial(as_served, config=c), x, copies)
                for c, copies in ((choose_int4_config(num_rows, n, k, 128), sym),
                                  (default, zp), (sums_tile, zp))
            ]  # fmt: skip
            for i, t in enumerate(times):
                totals[num_rows][i] += t
            print(f"{name:<8} {num_rows:>4} {times[0]:8.2f} {times[1]:8.2f} {times[2]:9.2f}  "
                  f"{default}", flush=True)  # fmt: skip
        del sym, zp
        torch.cuda.empty_cache()
    for num_rows, (s, z, a) in totals.items():
        print(f"{'the four':<8} {num_rows:>4} {s:8.2f} {z:8.2f} {a:9.2f}")


if __name__ == "__main__":
    main()
