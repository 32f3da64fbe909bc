"""GPU probe: what programmatic dependent launch and the split-K merge each cost or save on the
INT4 layers, at the default configuration.

`QuantizedLinears` launches `int4_matmul` with PDL (up to `INT4_PDL_MAX_ROWS` rows, where
`pdl_pays`) and with split-K summed by each tile's last program (up to `INT4_MERGE_ROWS`). This
times the four combinations apart, per Llama-3-8B layer, graph-timed over rotating weight copies
as `bench.bench_quant_kernels` does. Its first run (an H100, `bench/results/quant-kernels-h100.txt`
run 8) set both limits: the merge was even at 8 rows and lost at 32 and 64, PDL lost at 64.

    python3 -m bench.probe_int4_launch [--rows 8,32,64]
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench.bench_quant_kernels import SHAPES, Bench, int4_linear
from bench.shapes import LLAMA3_8B
from sitsd.kernels.int4_matmul import Int4MatmulConfig, choose_int4_config, int4_matmul
from sitsd.model.qlinear import int4_split_counters
from sitsd.quant.layout import Int4Weight


def launch(x: torch.Tensor, w: Int4Weight, *, pdl: bool, counters: torch.Tensor | None,
           config: Int4MatmulConfig | None = None) -> torch.Tensor:  # fmt: skip
    """One `int4_matmul` call on `w` as given (its zero points and code order), with or without
    PDL and the split merge; `config` None: the default one."""
    return int4_matmul(x, w.qweight, w.scales, w.offsets, w.group_size, w.perm, config=config,
                       zeros=w.zeros, pdl=pdl, split_counters=counters,
                       slice_major=w.slice_major)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32,64")
    args = parser.parse_args(argv)
    bench = Bench.on_gpu("bench.probe_int4_launch")
    rows = [int(r) for r in args.rows.split(",")]
    counters = int4_split_counters(LLAMA3_8B, torch.device("cuda"), max(rows))
    print(f"{torch.cuda.get_device_name()}, copy {bench.copy_gbs:.0f} GB/s; us per call")
    print(f"{'layer':<8} {'fmt':<7} {'M':>4} {'plain':>8} {'pdl':>8} {'merge':>8} "
          f"{'both':>8}  config")  # fmt: skip
    for name, (n, k) in SHAPES.items():
        for fmt in ("int4", "int4 zp"):
            copies = bench.copies(fmt, n, k)
            for num_rows in rows:
                x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
                expected = int4_linear(x, copies[0])
                times = []
                for pdl, merge in ((False, False), (True, False), (False, True), (True, True)):
                    fn = functools.partial(launch, pdl=pdl, counters=counters if merge else None)
                    torch.testing.assert_close(fn(x, copies[0]), expected, atol=0, rtol=0)
                    times.append(bench.time_linear(fn, x, copies))
                zp = fmt == "int4 zp"
                config = choose_int4_config(num_rows, n, k, 128, has_offsets=zp, has_zeros=zp)
                cells = " ".join(f"{t:8.2f}" for t in times)
                print(f"{name:<8} {fmt:<7} {num_rows:>4} {cells}  {config}", flush=True)
            del copies
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
