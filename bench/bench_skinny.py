"""Skinny GEMM against cuBLAS and gemv: Llama-3-8B's linear layers at 16, 32 and 64 rows.

For each layer shape and row count: `F.linear` (cuBLAS), `gemv`'s default, and `skinny_gemm`
(`kernels/skinny_gemm.py`) over a sweep of tilings and K splits, each output checked against
`F.linear` before it is timed. Timing as in `bench.bench_gemv`: 20 calls in one CUDA graph
cycling through enough weight copies to defeat the L2, median of 10 replays; GB/s = weight bytes
/ time against the copy bandwidth measured in the same run (`bench.floors`). The winners, with
their speed-up over cuBLAS, are what `sitsd.model.linear` routes to `skinny_gemm`.

GPU only:  python3 -m bench.bench_skinny [--rows 16,32,64] [--json PATH]; prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_gemv import DTYPE, SHAPES, LayerCase, check_close
from bench.floors import copy_bandwidth
from bench.timing import now
from sitsd.kernels.gemv import gemv
from sitsd.kernels.skinny_gemm import SkinnyConfig, choose_skinny_config, skinny_gemm

_TILES = ((128, 128, 4), (64, 128, 4), (128, 64, 6), (64, 256, 3))  # block_n, block_k, stages
_SPLITS = (1, 2, 4, 8)


def describe(c: SkinnyConfig) -> str:
    return f"n{c.block_n} k{c.block_k} split{c.split_k} w{c.num_warps} s{c.num_stages}"


def configs_for(n: int, k: int, num_rows: int) -> list[SkinnyConfig]:
    default = choose_skinny_config(num_rows, n, k)
    sweep = [SkinnyConfig(bn, bk, s, 4, st) for bn, bk, st in _TILES for s in _SPLITS
             if k % (s * bk) == 0 and n % bn == 0]  # fmt: skip
    return [default] + [c for c in sweep if c != default]


def bench_shape(name: str, rows: list[int], copy_gbs: float) -> list[dict]:
    n, k = SHAPES[name]
    case = LayerCase.random(name, copy_gbs)
    out = []
    for num_rows in rows:
        x = torch.randn(num_rows, k, device="cuda", dtype=DTYPE)
        ref = F.linear(x, case.weights[0])
        t_linear = case.time_us(functools.partial(F.linear, x))
        t_gemv = case.time_us(functools.partial(gemv, x))
        times = {}
        for config in configs_for(n, k, num_rows):
            fn = functools.partial(skinny_gemm, x, **asdict(config))
            check_close(fn(case.weights[0]), ref, f"{name} M={num_rows} {describe(config)}")
            times[config] = case.time_us(fn)
        best = min(times, key=times.__getitem__)
        default = next(iter(times))
        result = {
            "layer": name, "rows": num_rows, "linear_us": t_linear, "gemv_us": t_gemv,
            "default_us": times[default], "default": asdict(default),
            "best_us": times[best], "best": asdict(best), "weight_gb": case.weight_gb,
            "all": {describe(c): t for c, t in times.items()},
        }  # fmt: skip
        out.append(result)
        print(f"  {name} M={num_rows}: F.linear {t_linear:.2f} us, gemv {t_gemv:.2f}, skinny "
              f"default {times[default]:.2f}, best {times[best]:.2f} ({describe(best)}): "
              f"x{t_linear / times[best]:.2f} over cuBLAS", flush=True)  # fmt: skip
    return out


def print_table(results: list[dict], copy_gbs: float) -> None:
    print(f"\n{torch.cuda.get_device_name()}  copy {copy_gbs:.0f} GB/s; of copy = weight bytes "
          "/ time / copy bandwidth; x cuBLAS = F.linear's time / this time")  # fmt: skip
    print(f"{'layer':<8} {'M':>3} {'F.linear us':>11} {'of copy':>7} {'gemv us':>8} "
          f"{'skinny us':>9} {'of copy':>7} {'x cuBLAS':>8}  best config")  # fmt: skip
    for r in results:
        frac = functools.partial(lambda us, gb: gb / us * 1e6 / copy_gbs, gb=r["weight_gb"])
        best = SkinnyConfig(**r["best"])
        print(f"{r['layer']:<8} {r['rows']:>3} {r['linear_us']:>11.2f} "
              f"{frac(r['linear_us']):>7.1%} {r['gemv_us']:>8.2f} {r['best_us']:>9.2f} "
              f"{frac(r['best_us']):>7.1%} {r['linear_us'] / r['best_us']:>8.2f}  "
              f"{describe(best)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--layers", default=",".join(SHAPES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.bench_skinny needs a CUDA GPU")
    started = now()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth() / 1e9
    torch.cuda.empty_cache()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name in args.layers.split(","):
        results += bench_shape(name, rows, copy_gbs)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"copy_gbs": copy_gbs, "results": results}, indent=1))
    print_table(results, copy_gbs)
    print(f"\n{now() - started:.0f} s")


if __name__ == "__main__":
    main()
