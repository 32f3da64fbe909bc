"""GPU benchmark: the quantized-weight kernels on Llama-3-8B's linear layers, against bf16 cuBLAS
and against each format's own memory floor, all measured in one run.

Formats: bf16 (`F.linear`, cuBLAS); INT4 group 128 without zero points (float16 scales, as GPTQ
`sym: true` writes them) and with them (float32 offsets, as AWQ and GPTQ `sym: false` become);
FP8 e4m3 with per-channel scales and per-token activation scales.

Floor of a call = the bytes it must move in its format (codes, scales, offsets, x and the output
in bf16) / the device-to-device copy bandwidth measured at the start
(`bench.floors.copy_bandwidth`).
"x bf16" = cuBLAS bf16's time / this time; TFLOP/s = 2 M N K / time. Every timing is a CUDA
graph of back-to-back calls cycling through enough weight copies that none is read from L2
(`bench.timing.graph_ms`); every variant is checked against its plain-PyTorch reference first:
a sweep candidate that fails (a wrong result, a tile that does not compile) is reported and
left out, any other variant that fails ends the run.

1. Single layers qkv (6144 x 4096), o (4096 x 4096), gate_up (28672 x 4096), down (4096 x
   14336) at M = 1, 8, 32, 128, 512 (`--rows`) and 2048 (`--prefill-rows`): bf16; INT4
   `int4_matmul` with its default configuration (and as the engine launches it,
   `qlinear.QuantizedLinears`: PDL and the splits merged in the kernel where its rules say; past
   `INT4_MERGE_ROWS` rows also the default with the splits merged, "default merged") and
   the best of a small sweep (winner printed;
   `--no-sweep` skips it), with zero points, and `int4_dequantize` + F.linear from 32 rows; FP8
   `fp8_matmul` through torch's scaled matmul and through Triton.
2. 32 layers of qkv -> o -> gate_up -> silu_and_mul -> down in one graph, each layer with weights
   of its own (bf16: 14 GB, nothing stays in L2), M = 1, 8, 32, 128: bf16, INT4 (default
   configurations; as the engine launches them; past `INT4_MERGE_ROWS` rows the defaults with
   the splits merged; the sweep's winners), FP8; ms per 32 layers
   against the format's floor.

    python -m bench.bench_quant_kernels [--no-sweep] [--skip-layers] [--rows 1,8,32,128,512]
        [--prefill-rows 2048] [--json PATH]
    TRITON_INTERPRET=1 python -m bench.bench_quant_kernels --smoke

Table last. `--smoke` runs every path on tiny shapes in the Triton interpreter, timed by the
wall clock (numbers meaningless): a check of the script before a GPU run.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.floors import copy_bandwidth
from bench.shapes import LLAMA3_8B, linear_shapes
from bench.timing import graph_ms
from sitsd.kernels.activation import silu_and_mul
from sitsd.kernels.fp8_matmul import fp8_matmul
from sitsd.kernels.int4_dequant import int4_dequantize
from sitsd.kernels.int4_matmul import Int4MatmulConfig, choose_int4_config, int4_matmul
from sitsd.kernels.quant_layout import pack_int4
from sitsd.kernels.quant_reference import fp8_matmul_ref
from sitsd.model.qlinear import (
    INT4_DEQUANT_FROM_ROWS,
    INT4_MERGE_ROWS,
    QuantizedLinears,
    int4_split_counters,
)
from sitsd.quant.layout import (
    Fp8Weight,
    Int4Weight,
    mark_integer_zeros,
    nbytes,
    to_slice_major_weight,
)

DTYPE, GROUP = torch.bfloat16, 128
NUM_LAYERS = LLAMA3_8B.num_layers
SHAPES = {name: shape for name, shape in linear_shapes(LLAMA3_8B).items() if name != "lm_head"}
SMOKE_SHAPES = {"qkv": (192, 128), "o": (128, 128), "gate_up": (512, 128), "down": (128, 256)}
ROWS, PREFILL_ROWS, LAYER_ROWS = (1, 8, 32, 128, 512), (2048,), (1, 8, 32, 128)
FORMATS = ("bf16", "int4", "int4 zp", "fp8")
_CALLS_PER_GRAPH = 20
_ROTATE_BYTES = 256 * 2**20  # > 4x the H200's L2

Weight = torch.Tensor | Int4Weight | Fp8Weight
Linear = Callable[[torch.Tensor, Weight], torch.Tensor]


@dataclass
class Row:
    layer: str
    num_rows: int
    variant: str
    us: float  # per call (ms per 32 layers for the layer rows: see unit)
    floor_frac: float  # the format's floor / this time
    vs_bf16: float  # bf16 cuBLAS's time / this time
    tflops: float
    note: str = ""
    unit: str = "us"


def make_weight(fmt: str, n: int, k: int, device: str, *, slice_major: bool = True) -> Weight:
    """Random weights of one format, giving outputs of order 1; INT4 codes slice-major, as CUDA
    serves them (`sitsd.quant.linear.to_serving_layout`), unless `slice_major` is False."""
    if fmt == "bf16":
        return torch.empty(n, k, device=device, dtype=DTYPE).normal_(0.0, k**-0.5)
    if fmt == "fp8":
        codes = (torch.randn(n, k, device=device) * 8).to(torch.float8_e4m3fn)
        return Fp8Weight(codes, (torch.rand(n, device=device) + 0.5) / (8 * k**0.5))
    codes = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8)
    scales = ((torch.rand(k // GROUP, n, device=device) + 0.5) / (4.6 * k**0.5)).half()
    offsets = None
    if fmt == "int4 zp":
        offsets = -(torch.randint(0, 16, scales.shape, device=device).float() * scales.float())
    weight = Int4Weight(pack_int4(codes), scales, offsets, GROUP)
    return mark_integer_zeros(to_slice_major_weight(weight) if slice_major else weight)


def weight_bytes(w: Weight) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else nbytes(w)


# -------------------------------------------------------------------------- the linears


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def int4_linear(
    x: torch.Tensor,
    w: Int4Weight,
    *,
    config: Int4MatmulConfig | None = None,
    counters: torch.Tensor | None = None,
):
    return int4_matmul(x, w.qweight, w.scales, w.offsets, w.group_size, w.perm, config=config,
                       zeros=w.zeros, split_counters=counters,
                       slice_major=w.slice_major)  # fmt: skip


def int4_dequant_linear(x: torch.Tensor, w: Int4Weight, *, workspace: torch.Tensor):
    deq = int4_dequantize(w.qweight, w.scales, w.offsets, w.group_size, w.perm, out=workspace,
                          slice_major=w.slice_major)  # fmt: skip
    return F.linear(x, deq)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, *, backend: str = "scaled_mm") -> torch.Tensor:
    return fp8_matmul(x, w.weight, w.scale, backend=backend)


def reference(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """The plain-PyTorch product: W dequantized in float32 (per-token FP8 quantization of x)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if isinstance(w, Fp8Weight):
        return fp8_matmul_ref(x, w.weight, w.scale)
    return (x.float() @ w.dequantize().T).to(x.dtype)


def check_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Abort the run unless a variant matches its reference to bf16 accuracy."""
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=2e-2, msg=lambda m: f"{what}: {m}")


def int4_sweep(num_rows: int) -> list[Int4MatmulConfig]:
    """A few configurations per row count around the default (compiling is most of the run:
    the list is short, and layers that share K share compiled variants)."""
    c = Int4MatmulConfig
    m16 = min(64, max(16, 1 << max(num_rows - 1, 0).bit_length()))  # rows of an MMA tile
    if num_rows <= 4:  # the tensor-core kernel against gemv, split until the grid fills the SMs
        m = 1 << max(num_rows - 1, 0).bit_length()
        return [
            *(c("gemv", m, n, 128, split_k=8, num_warps=w) for n, w in ((32, 2), (64, 2),
                                                                       (128, 2), (128, 4))),
            c("gemv", m, 32, 128, split_k=8, num_warps=2, num_stages=1),  # loads not ahead
            c("gemv", m, 128, 128, split_k=8, num_warps=2, num_stages=1),
            # two chunks a program at K = 4096 (four at 8 parts): less of each program's time
            # waiting on its own loads in turn
            *(c("gemv", m, n, 128, split_k=16, num_warps=w) for n, w in ((64, 2), (128, 4))),
            c("gemv", m, 64, 256, split_k=8, num_warps=2),  # each row's bytes twice as long
            c("gemv", m, 256, 128, split_k=8, num_warps=8),
            c("mma", 16, 64, 128, split_k=8),
        ]  # fmt: skip
    if num_rows <= 64:
        return [c("dot_swapped", m16, 64, 128, split_k=2)] + [
            c("mma", m16, n, 128, split_k=s) for n in (64, 128) for s in (2, 4, 8)
        ] + [c("mma", m16, 64, 128, split_k=4, scaled=True)] + [
            # x copied into shared memory by Triton's pipeliner where each group uses it, not
            # one group ahead through registers (at 32 rows its tile is twice the codes')
            c("mma", m16, n, 128, split_k=s, num_stages=p, x_ahead=False)
            for n, s, p in ((64, 4, 3), (64, 4, 4), (64, 8, 3), (64, 2, 4), (128, 4, 3),
                            (128, 8, 3))
            # (two warpgroups sharing x's tile, 32 x 128 and 32 x 256 on 8 warps: on an H100 no
            # layer gained past the scatter, gate_up lost, 49.5 and 71.6 against 44.4 us)
        ]  # fmt: skip
    return [
        c("dot", 64, 128, 64),
        c("dot", 128, 128, 64, num_warps=8),
        c("dot_swapped", 128, 128, 64, num_warps=8),
        c("dot_swapped", 128, 64, 128),
        c("mma", 64, 128, 128, split_k=2),
        c("mma", 64, 64, 128, split_k=2),
        c("mma", 128, 64, 128, split_k=2),
        # on an H100 the smaller of these won three layers of four (more programs, each code
        # unpacked twice): more programs still, by K
        c("mma", 64, 64, 128, split_k=4),
        c("mma", 128, 64, 128, split_k=4),
        # the scale in the codes: 184 -> 142 registers at 64 x 64 (3 programs per SM, not 2),
        # 10% more instructions in the loop (bench.sass_int4, triton 3.6)
        c("mma", 64, 64, 128, split_k=2, scaled=True),
        c("mma", 128, 64, 128, split_k=2, scaled=True),
        # 8 warps: no spills at 128 x 64 (132 registers, 114 scaled; 4 warps: 255 and 56-64
        # bytes of stack), twice the warps per SM scaled
        c("mma", 128, 64, 128, split_k=2, num_warps=8),
        c("mma", 128, 64, 128, split_k=2, num_warps=8, scaled=True),
        # 128 x 128 tiles: every program reads all of its rows of x for each group, so at 64
        # weight rows a program x is read N / 64 times (gate_up at 128 rows: 470 MB from L2
        # against 59 MB of codes); 128 weight rows halve that, and the scale in the codes
        # keeps the accumulator alone in registers (8 warps: 64 of them a thread)
        c("mma", 128, 128, 128, split_k=2, num_warps=8),
        c("mma", 128, 128, 128, split_k=2, num_warps=8, scaled=True),
        c("mma", 128, 128, 128, split_k=4, num_warps=8, scaled=True),
        c("mma", 128, 128, 128, split_k=1, num_warps=8, scaled=True),
        # x copied into shared memory by Triton's pipeliner where each group uses it (x's tile
        # 32 KB a group at 128 rows, the codes' 4-8 KB), 3-4 stages, 4 and 8 warps
        c("mma", 64, 64, 128, split_k=2, x_ahead=False),
        c("mma", 64, 64, 128, split_k=4, x_ahead=False),
        c("mma", 128, 64, 128, split_k=2, x_ahead=False),
        c("mma", 128, 64, 128, split_k=2, num_warps=8, x_ahead=False),
        c("mma", 128, 64, 128, split_k=4, num_warps=8, x_ahead=False),
        c("mma", 128, 128, 128, split_k=2, num_warps=8, x_ahead=False),
        c("mma", 128, 128, 128, split_k=2, num_warps=8, num_stages=4, x_ahead=False),
        c("mma", 128, 128, 128, split_k=2, num_warps=8, scaled=True, x_ahead=False),
        c("mma", 64, 128, 128, split_k=2, num_warps=8, x_ahead=False),
        # zero points want 128 weight rows a program with x ahead (down: 51.2 us against 62.9 on
        # 64 in the loop, session 30): 128 rows on one warpgroup with x in the loop
        c("mma", 64, 128, 128, split_k=2, x_ahead=False),
        c("mma", 64, 128, 128, split_k=4, x_ahead=False),
        c("mma", 128, 128, 128, split_k=4, num_warps=8, x_ahead=False),
        # (x ordered by each program as it loads a group, `order_x=False`, lost every layer at
        # 128 rows on an H100, the copy included: gate_up 145.0 against 113.7 us without
        # offsets, 140.3 against 130.6 with; kernels/NOTES.md, session 22)
    ]  # fmt: skip


def describe(config: Int4MatmulConfig) -> str:
    return (
        f"{config.mode} m{config.block_m} n{config.block_n} k{config.block_k} "
        f"s{config.split_k} w{config.num_warps} p{config.num_stages}"
        + (" scaled" if config.scaled else "")
        + ("" if config.order_x is None else " x ordered" if config.order_x else " x in place")
        + ("" if config.x_ahead else " x in loop")
    )


def variants(
    fmt: str, num_rows: int, n: int, k: int, sweep: bool, workspace: torch.Tensor
) -> dict[str, Linear]:
    """Label -> linear for one format at one row count; for INT4 the default first, then the
    sweep ("sweep ..." labels), then dequantize + cuBLAS."""
    if fmt == "bf16":
        return {"bf16 F.linear (cuBLAS)": bf16_linear}
    if fmt == "fp8":
        return {
            f"fp8 {b}": functools.partial(fp8_linear, backend=b) for b in ("scaled_mm", "triton")
        }
    label = "int4 g128" + (" zero points" if fmt == "int4 zp" else "")
    zp = fmt == "int4 zp"  # integer zero points (the engine's RTN)
    default = choose_int4_config(num_rows, n, k, GROUP, has_offsets=zp, has_zeros=zp)
    out = {f"{label} default": functools.partial(int4_linear, config=default)}
    if num_rows < INT4_DEQUANT_FROM_ROWS:  # the default as the engine launches it (PDL, merge)
        out[f"{label} as served"] = QuantizedLinears(
            None, workspace.device.type == "cuda", int4_split_counters(LLAMA3_8B, workspace.device)
        )
    if INT4_MERGE_ROWS < num_rows < INT4_DEQUANT_FROM_ROWS:  # the merge past where it is served
        out[f"{label} default merged"] = functools.partial(
            int4_linear, config=default,
            counters=int4_split_counters(LLAMA3_8B, workspace.device, num_rows),
        )  # fmt: skip
    for config in int4_sweep(num_rows) if sweep else []:
        if config != default:
            out[f"sweep {describe(config)}"] = functools.partial(int4_linear, config=config)
    if num_rows >= 32:
        out[f"{label} dequant + cuBLAS"] = functools.partial(
            int4_dequant_linear, workspace=workspace
        )
    return out


# ------------------------------------------------------------------------------ timing


@dataclass
class Bench:
    """How this run times and where it puts tensors."""

    smoke: bool
    copy_gbs: float
    slice_major: bool = True  # INT4 codes as CUDA serves them

    @classmethod
    def on_gpu(cls, tool: str) -> Bench:
        """The Bench of a GPU run (copy bandwidth measured, torch's seed set); without CUDA it
        exits, saying that `tool` needs a GPU."""
        if not torch.cuda.is_available():
            sys.exit(f"{tool} needs a CUDA GPU")
        torch.manual_seed(0)
        bench = cls(False, copy_bandwidth() / 1e9)
        torch.cuda.empty_cache()
        return bench

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    def us(self, calls: list[Callable[[], object]]) -> float:
        """Graph-timed microseconds per call; one wall-clock call in the smoke run."""
        if not self.smoke:
            return graph_ms(calls) * 1e3
        start = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - start) * 1e6

    def copies(self, fmt: str, n: int, k: int) -> list[Weight]:
        """Copies of one random weight, enough that a graph of calls never hits L2."""
        first = make_weight(fmt, n, k, self.device, slice_major=self.slice_major)
        count = (
            1 if self.smoke else min(max(_ROTATE_BYTES // weight_bytes(first), 1), _CALLS_PER_GRAPH)
        )
        return [first] + [make_weight(fmt, n, k, self.device, slice_major=self.slice_major)
                          for _ in range(count - 1)]  # fmt: skip

    def time_linear(self, fn: Linear, x: torch.Tensor, copies: list[Weight]) -> float:
        calls = [functools.partial(fn, x, copies[i % len(copies)]) for i in range(_CALLS_PER_GRAPH)]
        return self.us(calls)

    def floor_us(self, w: Weight, num_rows: int, k: int) -> float:
        moved = weight_bytes(w) + 2 * num_rows * (w.shape[0] + k)  # + x and out in bf16
        return moved / self.copy_gbs / 1e3


def _summarize(
    times: dict[str, float], fmt: str
) -> tuple[dict[str, tuple[float, str]], str | None]:
    """The rows to print (label -> time, note): the sweep collapsed into its best; the winner."""
    swept = {lb: t for lb, t in times.items() if lb.startswith("sweep") or lb.endswith("default")}
    rows = {lb: (t, "") for lb, t in times.items() if not lb.startswith("sweep")}
    if len(swept) < 2:
        return rows, None
    best = min(swept, key=swept.__getitem__)
    note = "the default" if best.endswith("default") else best.removeprefix("sweep ")
    label = "int4 g128" + (" zero points" if fmt == "int4 zp" else "")
    rows[f"{label} best of {len(swept)}"] = (swept[best], note)
    return rows, best


def bench_shape(
    bench: Bench, name: str, shape: tuple[int, int], rows: tuple[int, ...], sweep: bool
) -> tuple[list[Row], dict]:
    """Every format and variant of one layer at each row count; the INT4 sweep's winners."""
    n, k = shape
    copies = {fmt: bench.copies(fmt, n, k) for fmt in FORMATS}
    workspace = torch.empty(n, k, device=bench.device, dtype=DTYPE)
    out, winners = [], {}
    for num_rows in rows:
        x = torch.randn(num_rows, k, device=bench.device, dtype=DTYPE)
        t_bf16 = 0.0
        for fmt in FORMATS:
            w0 = copies[fmt][0]
            ref, times = reference(x, w0), {}
            for label, fn in variants(fmt, num_rows, n, k, sweep, workspace).items():
                if label.startswith("sweep"):  # a candidate that fails is reported, left out
                    try:
                        check_close(fn(x, w0), ref, f"{name} M={num_rows} {label}")
                    except Exception as error:  # a wrong result, or a tile that cannot compile
                        reason = (str(error).splitlines() or [""])[0][:160]
                        print(f"    {name} M={num_rows} {fmt} {label}: left out, "
                              f"{type(error).__name__}: {reason}", flush=True)  # fmt: skip
                        continue
                else:  # the default and the engine's route: a wrong result ends the run
                    check_close(fn(x, w0), ref, f"{name} M={num_rows} {label}")
                times[label] = bench.time_linear(fn, x, copies[fmt])
                if label.startswith("sweep"):  # every configuration's time, for the log
                    print(f"    {name} M={num_rows} {fmt} {label}: {times[label]:.2f} us",
                          flush=True)  # fmt: skip
            t_bf16 = t_bf16 or times["bf16 F.linear (cuBLAS)"]
            summary, best = _summarize(times, fmt)
            if best and fmt == "int4":
                winners[(name, num_rows)] = best
            floor = bench.floor_us(w0, num_rows, k)
            for label, (us, note) in summary.items():
                if label.endswith("default"):
                    zp = fmt == "int4 zp"
                    note = describe(choose_int4_config(num_rows, n, k, GROUP, has_offsets=zp,
                                                          has_zeros=zp))  # fmt: skip
                out.append(
                    Row(
                        name,
                        num_rows,
                        label,
                        us,
                        floor / us,
                        t_bf16 / us,
                        2 * num_rows * n * k / us / 1e6,
                        note,
                    )
                )
                print(
                    f"  {name} M={num_rows} {label}: {us:.2f} us, {floor / us:.1%} of its "
                    f"floor, x{t_bf16 / us:.2f} bf16  {note}",
                    flush=True,
                )
    return out, winners


# ------------------------------------------------------------------------- 32 layers in a row


def _layer(x: torch.Tensor, weights: dict[str, Weight], linears: dict[str, Linear]):
    """One decoder layer's linears (no attention or norms): qkv -> o -> gate_up -> down."""
    qkv = linears["qkv"](x, weights["qkv"])
    h = linears["o"](qkv[:, : x.shape[1]].contiguous(), weights["o"])  # stands in for attention
    gate_up = linears["gate_up"](h, weights["gate_up"])
    return linears["down"](silu_and_mul(gate_up), weights["down"])


def config_of(winner: str | None) -> Int4MatmulConfig | None:
    """The configuration a sweep label describes ("sweep dot m64 n128 k64 s1 w4 p3"), or None."""
    if not winner or not winner.startswith("sweep"):
        return None
    mode, m, n, k, s, w, p, *flags = winner.removeprefix("sweep ").split()
    rest = " ".join(flags)
    order_x = False if "x in place" in rest else True if "x ordered" in rest else None
    return Int4MatmulConfig(mode, int(m[1:]), int(n[1:]), int(k[1:]), int(s[1:]), int(w[1:]),
                            int(p[1:]), "scaled" in flags, order_x,
                            "x in loop" not in rest)  # fmt: skip


def bench_layers(bench: Bench, shapes: dict, winners: dict, num_layers: int) -> list[Row]:
    """`num_layers` layers in one graph per format, each layer with weights of its own."""
    hidden, rows = shapes["o"][1], []
    for fmt, linear in (("bf16", bf16_linear), ("int4", int4_linear), ("fp8", fp8_linear)):
        make = functools.partial(make_weight, device=bench.device, slice_major=bench.slice_major)
        layers = [{op: make(fmt, *shapes[op]) for op in shapes} for _ in range(num_layers)]
        total = sum(weight_bytes(w) for layer in layers for w in layer.values())
        for num_rows in LAYER_ROWS:
            x = torch.randn(num_rows, hidden, device=bench.device, dtype=DTYPE)
            runs = {fmt: {op: linear for op in shapes}}
            if fmt == "int4":  # as the engine runs them (`qlinear.QuantizedLinears`, no dequant)
                served = QuantizedLinears(None, not bench.smoke, int4_split_counters(LLAMA3_8B,
                                          torch.device(bench.device)))  # fmt: skip
                runs["int4 as served"] = {op: served for op in shapes}
                if num_rows > INT4_MERGE_ROWS:  # the merge past the rows it is served at
                    merged = functools.partial(int4_linear, counters=int4_split_counters(
                        LLAMA3_8B, torch.device(bench.device), num_rows))  # fmt: skip
                    runs["int4 default merged"] = {op: merged for op in shapes}
            if fmt == "int4" and winners:
                runs["int4 swept best"] = {
                    op: functools.partial(
                        int4_linear, config=config_of(winners.get((op, num_rows)))
                    )
                    for op in shapes
                }
            floor_ms = (total + 8 * num_rows * hidden * num_layers) / bench.copy_gbs / 1e6
            for label, linears in runs.items():
                step = functools.partial(_layer, linears=linears)
                ms = bench.us([functools.partial(functools.reduce, step, layers, x)]) / 1e3
                rows.append(
                    Row(
                        f"{num_layers} layers",
                        num_rows,
                        label,
                        ms,
                        floor_ms / ms,
                        0.0,
                        0.0,
                        f"floor {floor_ms:.3f} ms",
                        unit="ms",
                    )
                )
                print(
                    f"  {num_layers} layers M={num_rows} {label}: {ms:.3f} ms "
                    f"({floor_ms / ms:.1%} of its floor)",
                    flush=True,
                )
        del layers
        if not bench.smoke:
            torch.cuda.empty_cache()
    for num_rows in LAYER_ROWS:  # x bf16 from the bf16 row of each row count
        group = [r for r in rows if r.num_rows == num_rows]
        for r in group:
            r.vs_bf16 = group[0].us / r.us
    return rows


# ------------------------------------------------------------------------------------ report


def print_table(rows: list[Row], copy_gbs: float, device: str) -> None:
    print(
        f"\n{device}  copy {copy_gbs:.0f} GB/s (read + write); of floor = the format's bytes / "
        "copy bandwidth / time; x bf16 = cuBLAS bf16's time / this time"
    )
    print(
        f"{'layer':<10} {'M':>4} {'variant':<40} {'time':>11} {'of floor':>8} {'x bf16':>7} "
        f"{'TFLOP/s':>8}  config / notes"
    )
    for r in rows:
        time_str = f"{r.us:.2f} {r.unit}" if r.unit == "us" else f"{r.us:.3f} {r.unit}"
        tflops = f"{r.tflops:8.1f}" if r.tflops else " " * 8
        print(
            f"{r.layer:<10} {r.num_rows:>4} {r.variant:<40} {time_str:>11} {r.floor_frac:>8.1%} "
            f"{r.vs_bf16:>7.2f} {tflops}  {r.note}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every number here")
    parser.add_argument("--no-sweep", action="store_true", help="INT4 default configs only")
    parser.add_argument("--skip-layers", action="store_true", help="skip the 32-layer graphs")
    parser.add_argument("--rows", default=None,
                        help=f"rows of x per layer (default {','.join(map(str, ROWS))}; "
                             "with --smoke 1,8,32)")  # fmt: skip
    parser.add_argument("--prefill-rows", default=",".join(map(str, PREFILL_ROWS)))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    parser.add_argument("--plain-codes", action="store_true",
                        help="INT4 codes in column order (not slice-major, as served)")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_quant_kernels needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    started = time.perf_counter()
    torch.manual_seed(0)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.rows is None:
        args.rows = "1,8,32" if args.smoke else ",".join(map(str, ROWS))
    prefill = "" if args.smoke else args.prefill_rows
    rows_m = tuple(int(r) for r in f"{args.rows},{prefill}".split(",") if r)
    bench = Bench(args.smoke, 1.0 if args.smoke else copy_bandwidth() / 1e9,  # bytes/s -> GB/s
                  slice_major=not args.plain_codes)  # fmt: skip
    if not args.smoke:
        torch.cuda.empty_cache()  # the copy's buffers go before the weights
    print(f"copy {bench.copy_gbs:.0f} GB/s (read + write)", flush=True)
    rows, winners = [], {}
    for name, shape in shapes.items():
        new_rows, new_winners = bench_shape(bench, name, shape, rows_m, not args.no_sweep)
        rows += new_rows
        winners |= new_winners
        if not args.smoke:
            torch.cuda.empty_cache()
    if not args.skip_layers:
        rows += bench_layers(bench, shapes, winners, 2 if args.smoke else NUM_LAYERS)
    device = (
        "CPU interpreter (smoke: timings meaningless)"
        if args.smoke
        else (torch.cuda.get_device_name())
    )
    results = {
        "device": device,
        "copy_gbs": bench.copy_gbs,
        "rows": [asdict(r) for r in rows],
        "winners": {f"{layer} M={m}": v for (layer, m), v in winners.items()},
        "seconds": time.perf_counter() - started,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print_table(rows, bench.copy_gbs, device)
    print(f"\n{results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
