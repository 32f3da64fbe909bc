"""Which decode launches get programmatic dependent launch: a rule by row count, from measurement.

Programmatic dependent launch (PDL, `sitsd.kernels._pdl`) lets each decode kernel's launch and
ramp-up overlap the tail of the kernel before it. Whether that pays depends on the batch, and not
monotonically. `bench/bench_pdl.py` timed one decode CUDA-graph replay of Llama-3-8B on an H200
with PDL and without (context 256, bf16; `bench/results/pdl-h200.txt`, 2026-11-30; an earlier
run agreed: 1.048x at 1, 0.955x at 8); the speed-up per decode batch (rows of each launch):

    rows       1      2      4      8      16     24     32     64     128
    speed-up   1.049  1.023  0.970  0.961  0.987  0.984  1.020  1.013  1.004

So PDL goes on at 1-2 rows and from 32 (`pdl_pays`). Why 4-24 lose is not understood: those
batches mix gemv's tensor-core path with cuBLAS kernels (`bench/NOTES.md`). PDL needs sm_90 or
newer (`kernels._utils.supports_pdl`); devices newer than the measured H200 get the same rule
until measured.

This module decides; `ops.with_pdl` (norms, SwiGLU, rotary + cache write, decode attention) and
`linear.TunedLinear` (gemv, skinny_gemm) apply the rule to each call, under the runner's on/off
switch. Which linear kernel runs at which shape and row count is `sitsd.model.linear`'s table,
kept there with the launch configurations it carries (that module imports triton; this one
imports nothing, so `ops` can use it on the CPU runtime too).
"""

from __future__ import annotations


def pdl_pays(rows: int) -> bool:
    """Whether a decode launch of `rows` rows (tokens, or sequences for decode attention) should
    use programmatic dependent launch: at 1-2 rows and from 32, where it measured faster."""
    return rows <= 2 or rows >= 32
