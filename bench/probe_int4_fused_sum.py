"""GPU probe: the split-K sum of o and down left to the RMSNorm that follows them.

Past `INT4_MERGE_ROWS` rows an INT4 layer split along K writes float32 partials `[SPLIT_K, M,
N]` and a second kernel sums them into x's dtype; after o and down the next kernel is the
residual add + RMSNorm (`rmsnorm.fused_add_rms_norm`), which can take the partials and sum them
itself (`int4_matmul(unsummed=True)`): the same bits, one launch and one 16-bit round trip
fewer. Per Llama-3-8B layer (o, down), row count and INT4 format (symmetric codes, zero points),
the default configuration's layer followed by the add + norm, launched as the engine launches
them (PDL where `int4_pdl_pays` and `pdl_pays`), graph-timed over rotating weight copies as
`bench.bench_quant_kernels` does: summed by the layer's kernels (up to `INT4_MERGE_ROWS` rows
merged in its tiles, as served), and by the norm (never merged).

    python3 -m bench.probe_int4_fused_sum [--rows 32,64,128]   (1-16 rows: against the merge)
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench.bench_quant_kernels import SHAPES, Bench, Weight
from bench.shapes import LLAMA3_8B
from sitsd.kernels.int4_matmul import choose_int4_config, int4_matmul
from sitsd.kernels.rmsnorm import fused_add_rms_norm
from sitsd.model.qlinear import QuantizedLinears, int4_pdl_pays, int4_split_counters
from sitsd.model.routing import pdl_pays
from sitsd.quant.layout import Int4Weight


def layer_and_norm(x: torch.Tensor, w: Weight, *, residual: torch.Tensor,
                   norm: torch.Tensor, counters: torch.Tensor | None,
                   unsummed: bool) -> torch.Tensor:  # fmt: skip
    """One INT4 layer as `QuantizedLinears` launches it, then the residual add + RMSNorm; with
    `unsummed` the norm sums the layer's split partials."""
    assert isinstance(w, Int4Weight)
    rows = x.shape[0]
    y = int4_matmul(x, w.qweight, w.scales, w.offsets, w.group_size, w.perm, zeros=w.zeros,
                    pdl=int4_pdl_pays(rows), split_counters=counters, slice_major=w.slice_major,
                    unsummed=unsummed)  # fmt: skip
    return fused_add_rms_norm(y, residual, norm, 1e-5, pdl=pdl_pays(rows))[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,64,128")
    args = parser.parse_args(argv)
    bench = Bench.on_gpu("bench.probe_int4_fused_sum")
    rows = [int(r) for r in args.rows.split(",")]
    served = QuantizedLinears(split_counters=int4_split_counters(LLAMA3_8B, torch.device("cuda")))
    hidden = LLAMA3_8B.hidden_size
    norm = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, copy {bench.copy_gbs:.0f} GB/s; us per layer + norm")
    print(f"{'layer':<6} {'fmt':<7} {'M':>4} {'split':>5} {'summed':>8} {'by norm':>8}")
    totals: dict[tuple[str, int], list[float]] = {}
    for name in ("o", "down"):
        n, k = SHAPES[name]
        for fmt in ("int4", "int4 zp"):
            zp = fmt == "int4 zp"
            copies = bench.copies(fmt, n, k)
            for num_rows in rows:
                x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
                residual = torch.randn(num_rows, hidden, device="cuda", dtype=torch.bfloat16)
                config = choose_int4_config(num_rows, n, k, 128, has_offsets=zp, has_zeros=zp)
                counters = served.counters_for(num_rows, n)
                times = []
                outs = []
                for unsummed in (False, True):
                    # by the norm: never merged in the layer (up to INT4_MERGE_ROWS the
                    # served layer merges its tiles' parts, which leaves no partials)
                    fn = functools.partial(layer_and_norm, residual=residual, norm=norm,
                                           counters=None if unsummed else counters,
                                           unsummed=unsummed)  # fmt: skip
                    start = residual.clone()
                    outs.append(fn(x, copies[0]).clone())
                    residual.copy_(start)
                    times.append(bench.time_linear(fn, x, copies))
                    residual.copy_(start)
                assert torch.equal(outs[0], outs[1]), "the norm's sum differs from the kernel's"
                row = totals.setdefault((fmt, num_rows), [0.0, 0.0])
                row[0] += times[0]
                row[1] += times[1]
                print(f"{name:<6} {fmt:<7} {num_rows:>4} {config.split_k:>5} {times[0]:8.2f} "
                      f"{times[1]:8.2f}", flush=True)  # fmt: skip
            del copies
            torch.cuda.empty_cache()
    for (fmt, num_rows), (summed, by_norm) in totals.items():
        print(f"o + down {fmt:<7} {num_rows:>4}: summed {summed:8.2f}, by the norm "
              f"{by_norm:8.2f} us")  # fmt: skip


if __name__ == "__main__":
    main()
