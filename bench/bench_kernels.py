"""Benchmark of sitsd's Triton kernels on one GPU, against ceilings measured in the same run.

Ceilings (`bench.floors`): device-to-device copy bandwidth (bytes read + written over time, a
4 GiB copy) and the bf16 `torch.matmul` rate (8192^3). Each kernel is timed with `bench.timing`:
the median of single calls with the L2 flushed before each (`median_ms(flush_l2=True)`), and,
for decode, also as CUDA-graph replays (`graph_ms`: no launch overhead, but back-to-back, so
small working sets stay in L2). Counts are explicit: bytes are each input read once and each output
written once; attention FLOPs are 4 * head_dim per (query head, visible key) pair.

    decode_attention   Llama-3-8B shapes (32 q / 8 kv heads, head_dim 128, bf16, block 16):
                       GB/s and fraction of the copy bandwidth; SDPA on contiguous K/V as a peer
    prefill_attention  TFLOP/s, fraction of the matmul rate, and speed against SDPA (flash)
    rms_norm & co.     GB/s, fraction of the copy bandwidth, and speed against the reference

GPU only (`python3 -m bench.bench_kernels [--sweep]`); never part of the tests. Prints a table
last. `--sweep` first times launch configurations of the attention kernels (each output checked
against its reference), the measurements behind the wrappers' defaults (kernels/NOTES.md).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench import timing
from bench.floors import copy_bandwidth, matmul_rate
from bench.shapes import LLAMA3_8B
from sitsd.kernels import (
    decode_attention,
    fused_add_rms_norm,
    prefill_attention,
    rms_norm,
    silu_and_mul,
)
from sitsd.kernels._utils import num_sms
from sitsd.kernels.decode_attention import choose_num_splits
from sitsd.kernels.reference import (
    decode_attention_ref,
    fused_add_rms_norm_ref,
    prefill_attention_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = LLAMA3_8B.num_heads, LLAMA3_8B.num_kv_heads, LLAMA3_8B.head_dim
BLOCK_SIZE = 16  # the KV cache's default
DTYPE = torch.bfloat16
L2_BYTES = 60 * 2**20  # H200
DEVICE = torch.device("cuda")
DECODE_CONTEXTS = (512, 2048, 8192)
DECODE_BATCHES = (1, 8, 32, 64, 128)
# (number of sequences, chunk length, cached prefix length)
PREFILL_CASES = ((1, 4096, 0), (4, 2048, 0), (16, 512, 0), (1, 512, 7680), (1, 8192, 0))
NUM_TOKENS = 4096  # elementwise kernels: a prefill step of Llama-3-8B's activations
HIDDEN, INTERMEDIATE = LLAMA3_8B.hidden_size, LLAMA3_8B.intermediate_size
SWEEP_DECODE_CASES = ((32, 8192), (8, 8192), (128, 2048))  # (batch, context)
SWEEP_PREFILL_CASES = ((4096, 0), (512, 7680))  # (chunk length, cached prefix)


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float
    rate: float  # GB/s or TFLOP/s
    unit: str
    frac: float  # of the copy bandwidth or the matmul rate
    extra: str = ""  # peer or graph timing


_WARMUP, _REPEATS = 10, 100  # single calls
_GRAPH_CALLS = 100  # back-to-back calls in one timed graph


def median_ms(fn: Callable[[], object]) -> float:
    """Median of single calls, L2 flushed before each (host launch overhead can show)."""
    return timing.median_ms(fn, warmup=_WARMUP, repeats=_REPEATS, clock="cuda", flush_l2=True)


def graph_ms(fn: Callable[[], object]) -> float:
    """Median per call of CUDA-graph replays of back-to-back calls (no launch overhead)."""
    return timing.graph_ms([fn] * _GRAPH_CALLS)


def host_us(fn: Callable[[], object], num_calls: int = 200) -> float:
    """Host time per call of a wrapper (checks + launches), launches left queued."""
    return timing.median_ms(fn, warmup=1, repeats=num_calls, clock="host") * 1e3


def measure_ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s), measured now on random data."""
    copy_gbs = copy_bandwidth() / 1e9
    torch.cuda.empty_cache()  # the copy's 8 GiB go before the matmul
    return copy_gbs, matmul_rate() / 1e12


def _paged(seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shuffled paged caches holding `seq_lens` (random data), block tables, seq_lens tensor."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    value_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    ids = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32, device=DEVICE)
    start = 0
    for seq, n in enumerate(blocks_per_seq):
        tables[seq, :n] = ids[start : start + n]
        start += n
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return key_cache, value_cache, tables, lens


def bench_decode(copy_gbs: float) -> list[Row]:
    return [
        _decode_case(batch, context, copy_gbs)
        for context in DECODE_CONTEXTS
        for batch in DECODE_BATCHES
    ]


def _decode_case(batch: int, context: int, copy_gbs: float) -> Row:
    scale = HEAD_DIM**-0.5
    key_cache, value_cache, tables, lens = _paged([context] * batch)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(query)
    splits = choose_num_splits(batch, NUM_KV_HEADS, context, num_sms(DEVICE))
    fn = functools.partial(
        decode_attention, query, key_cache, value_cache, tables, lens, scale,
        max_seq_len=context, out=out,
    )  # fmt: skip
    eager_ms = median_ms(fn)
    ms = graph_ms(fn)  # decode runs CUDA-graph captured: replay time is what serving sees
    num_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * query.numel() * 2
    gbs = num_bytes / ms / 1e6
    in_l2 = " IN-L2" if num_bytes < 2 * L2_BYTES else ""
    extra = (
        f"splits {splits}{in_l2}, eager {eager_ms * 1e3:.0f}us, host {host_us(fn):.0f}us/call"
        + _sdpa_decode_peer(batch, context, scale, ms)
    )
    return Row("decode", f"B={batch} ctx={context}", ms, gbs, "GB/s", gbs / copy_gbs, extra)


def _sdpa_decode_peer(batch: int, context: int, scale: float, ms: float) -> str:
    """SDPA with GQA on contiguous K/V (no paging), graph-timed too: our speed over it."""
    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    try:
        peer_ms = graph_ms(
            functools.partial(F.scaled_dot_product_attention, q, k, v, scale=scale, enable_gqa=True)
        )
    except RuntimeError as exc:  # a backend refusing GQA: report, do not fail the run
        return f", sdpa n/a ({str(exc)[:40]})"
    return f", sdpa-gqa {peer_ms * 1e3:.1f}us (x{peer_ms / ms:.2f})"


def bench_prefill(mm_tflops: float) -> list[Row]:
    return [_prefill_case(*case, mm_tflops) for case in PREFILL_CASES]


def _prefill_case(num_seqs: int, q_len: int, prefix: int, mm_tflops: float) -> Row:
    scale = HEAD_DIM**-0.5
    key_cache, value_cache, tables, lens = _paged([prefix + q_len] * num_seqs)
    query = torch.randn(num_seqs * q_len, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    qsl = torch.arange(0, num_seqs + 1, device=DEVICE, dtype=torch.int32) * q_len
    out = torch.empty_like(query)
    ms = median_ms(
        functools.partial(
            prefill_attention, query, key_cache, value_cache, tables, lens, qsl, scale, out=out
        )
    )
    visible_pairs = num_seqs * (q_len * prefix + q_len * (q_len + 1) // 2)
    flops = 4 * HEAD_DIM * NUM_HEADS * visible_pairs
    tflops = flops / ms / 1e9
    extra = "sdpa n/a (prefix)"
    if prefix == 0:
        q = torch.randn(num_seqs, NUM_HEADS, q_len, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        k = torch.randn_like(q)  # K/V expanded to all heads: the flash path, same FLOPs
        v = torch.randn_like(q)
        peer_ms = median_ms(
            functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, scale=scale)
        )
        extra = f"sdpa {flops / peer_ms / 1e9:.0f} TFLOP/s (x{peer_ms / ms:.2f})"
    shape = f"{num_seqs}x{q_len} prefix={prefix}"
    return Row("prefill", shape, ms, tflops, "TFLOP/s", tflops / mm_tflops, extra)


def _elementwise_row(name: str, shape: str, num_bytes: int, fn, ref_fn, copy_gbs: float) -> Row:
    ms = median_ms(fn)
    ref_ms = median_ms(ref_fn)
    gbs = num_bytes / ms / 1e6
    return Row(name, shape, ms, gbs, "GB/s", gbs / copy_gbs, f"x{ref_ms / ms:.2f} vs reference")


def bench_elementwise(copy_gbs: float) -> list[Row]:
    num_tokens, hidden, inter = NUM_TOKENS, HIDDEN, INTERMEDIATE
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(x)
    act_bytes = x.numel() * 2
    rows = [
        _elementwise_row("rms_norm", f"{num_tokens}x{hidden}", 2 * act_bytes,
                         lambda: rms_norm(x, weight, 1e-5, out=out),
                         lambda: rms_norm_ref(x, weight, 1e-5), copy_gbs),
        _elementwise_row("fused_add_rms_norm", f"{num_tokens}x{hidden}", 4 * act_bytes,
                         lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
                         lambda: fused_add_rms_norm_ref(x, residual, weight, 1e-5), copy_gbs),
    ]  # fmt: skip
    gate_up = torch.randn(num_tokens, 2 * inter, device=DEVICE, dtype=DTYPE)
    act_out = torch.empty(num_tokens, inter, device=DEVICE, dtype=DTYPE)
    rows.append(_elementwise_row(
        "silu_and_mul", f"{num_tokens}x{2 * inter}", 3 * num_tokens * inter * 2,
        lambda: silu_and_mul(gate_up, out=act_out), lambda: silu_and_mul_ref(gate_up), copy_gbs,
    ))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------
# Tuning sweep (--sweep): launch configurations of the attention kernels, each checked first
# ---------------------------------------------------------------------------------------------


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep_decode() -> None:
    scale = HEAD_DIM**-0.5
    configs = ((64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3),
               (128, 8, 3), (32, 4, 4))  # fmt: skip
    for batch, context in SWEEP_DECODE_CASES:
        key_cache, value_cache, tables, lens = _paged([context] * batch)
        query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        ref = decode_attention_ref(query, key_cache, value_cache, tables, lens, scale)
        num_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
        auto = choose_num_splits(batch, NUM_KV_HEADS, context, num_sms(DEVICE))
        variants = [dict(block_n=n, num_warps=w, num_stages=st) for n, w, st in configs]
        variants += [dict(num_splits=k) for k in (1, 2, 3, 4, 6, 8, 12, 16) if batch <= 32]
        for kwargs in variants:
            fn = functools.partial(
                decode_attention, query, key_cache, value_cache, tables, lens, scale, **kwargs
            )
            err = _rel_err(fn(), ref)
            ms = graph_ms(fn)
            gbs = num_bytes / ms / 1e6
            label = f"B={batch} ctx={context} (auto splits {auto}) {kwargs}"
            print(
                f"sweep decode {label}: {ms * 1e3:.1f}us {gbs:.0f} GB/s err {err:.1e}", flush=True
            )


def sweep_prefill() -> None:
    scale = HEAD_DIM**-0.5
    configs = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2),
               (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4), (128, 64, 8, 4))  # fmt: skip
    for q_len, prefix in SWEEP_PREFILL_CASES:
        key_cache, value_cache, tables, lens = _paged([q_len + prefix])
        query = torch.randn(q_len, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        qsl = torch.tensor([0, q_len], device=DEVICE, dtype=torch.int32)
        args = (query, key_cache, value_cache, tables, lens, qsl, scale)
        ref = prefill_attention_ref(*args)
        flops = 4 * HEAD_DIM * NUM_HEADS * (q_len * prefix + q_len * (q_len + 1) // 2)
        for block_m, block_n, warps, stages in configs:
            kwargs = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
            fn = functools.partial(prefill_attention, *args, **kwargs)
            try:
                err = _rel_err(fn(), ref)
            except Exception as exc:  # e.g. out of shared memory: report and go on
                print(f"sweep prefill {q_len}+{prefix} {kwargs}: failed {str(exc)[:60]}")
                continue
            ms = median_ms(fn)
            tflops = flops / ms / 1e9
            label = f"{q_len} prefix={prefix} {kwargs}"
            print(
                f"sweep prefill {label}: {ms:.3f} ms {tflops:.0f} TFLOP/s err {err:.1e}", flush=True
            )


def print_table(rows: list[Row], copy_gbs: float, mm_tflops: float) -> None:
    print(f"\n{torch.cuda.get_device_name()}  copy {copy_gbs:.0f} GB/s (read+write), "
          f"bf16 matmul {mm_tflops:.0f} TFLOP/s")  # fmt: skip
    print(f"{'kernel':<19} {'shape':<24} {'ms':>9} {'rate':>14} {'of ceiling':>10}  notes")
    for r in rows:
        rate = f"{r.rate:.0f} {r.unit}"
        print(f"{r.kernel:<19} {r.shape:<24} {r.ms:>9.4f} {rate:>14} {r.frac:>10.1%}  {r.extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="first time launch configurations of the attention kernels (kernels/NOTES.md)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.bench_kernels needs a CUDA GPU")
    torch.manual_seed(0)
    if args.sweep:
        sweep_prefill()
        sweep_decode()
    copy_gbs, mm_tflops = measure_ceilings()
    print(f"ceilings: copy {copy_gbs:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    rows = []
    for part in (bench_decode, bench_prefill, bench_elementwise):
        arg = mm_tflops if part is bench_prefill else copy_gbs
        new_rows = part(arg)
        for r in new_rows:
            print(f"  {r.kernel} {r.shape}: {r.ms:.4f} ms {r.rate:.0f} {r.unit} {r.extra}",
                  flush=True)  # fmt: skip
        rows += new_rows
    print_table(rows, copy_gbs, mm_tflops)


if __name__ == "__main__":
    main()
