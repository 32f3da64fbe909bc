"""GPU benchmark: the Triton `gemv` against cuBLAS (`F.linear`) on Llama-3-8B's decode-time linears.

Ceiling: device-to-device copy bandwidth, bytes read + written over time
(`bench.floors.copy_bandwidth`, measured in the same run). GB/s below are *weight* bytes over
time, so "of copy" is the share of that ceiling the layer reaches (activations are a rounding
error at M <= 8).

Every timing is a CUDA graph of back-to-back calls (no launch overhead, as the runtime decodes),
replayed several times and timed with CUDA events (`bench.timing.graph_ms`); the figure is the
median replay over the calls in it. So that no call finds its weight in the 50 MB L2, the calls
of one graph cycle through enough copies of the weight to span `_ROTATE_BYTES`.

1. Single layers: qkv, o, gate_up, down, lm_head (bf16 random weights) at M = 1, 2, 4, 8
   (`--rows` for others):
   `F.linear`, `gemv` with its default config, and the best of a small config sweep (the
   winner's config is printed); for down also `silu_and_mul` + `F.linear` against `gemv(...,
   swiglu=True)`, default and swept. Every gemv config is checked against `F.linear` first.
2. Back-to-back layers: one graph runs qkv -> o -> gate_up -> down for 32 layers with a weight
   set of their own (about 14 GB, so nothing stays in L2), at M = 1 and 4: `F.linear` with
   `silu_and_mul` (today's runtime), gemv everywhere with SwiGLU fused into down (defaults, and
   the sweep's winners), gemv with a separate `silu_and_mul`, and gemv for qkv/o/gate_up with
   `silu_and_mul` + `F.linear` for down. Reported as ms per 32 layers and as the fraction of the
   floor weight bytes / copy bandwidth.
3. The same 32 layers at M = 1 with their two pre-norms, routed as the model routes them
   (`sitsd.model.linear`): `fused_add_rms_norm` + gemv against `norm_gemv` (add and norm inside
   the qkv and gate_up kernels), which decides `TunedLinear.fuse_norm`.

GPU only: `python3 -m bench.bench_gemv [--no-sweep] [--skip-layers] [--rows 1,2,4,8,16,32]
[--json PATH]`; prints a table last. Most of the run time is Triton compiling the swept configs
(a warm ~/.triton cache halves it).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.floors import copy_bandwidth
from bench.shapes import LLAMA3_8B, linear_shapes
from bench.timing import graph_ms, now
from sitsd.kernels import silu_and_mul
from sitsd.kernels.gemv import MAX_ROWS, GemvConfig, choose_gemv_config, gemv

DTYPE = torch.bfloat16
HIDDEN, NUM_LAYERS = LLAMA3_8B.hidden_size, LLAMA3_8B.num_layers
SHAPES = linear_shapes(LLAMA3_8B)  # layer: (N, K) of its weight
BATCHES = (1, 2, 4, 8)  # --rows adds more (up to gemv.MAX_ROWS)
LAYER_BATCHES = (1, 4)
_CALLS_PER_GRAPH = 20
_REPLAYS = 10
_ROTATE_BYTES = 256 * 2**20  # > 4x the H200's L2
# The sweep: a fixed list per M so that layers sharing K share compiled variants (compiling is
# most of this script's time). It holds every default `choose_gemv_config` gives these shapes.
_FMA_SWEEP = (GemvConfig(4, 1024, 4, 2, False), GemvConfig(8, 1024, 4, 2, False),
              GemvConfig(4, 2048, 8, 2, False))  # fmt: skip
_DOT_SWEEP = tuple(GemvConfig(n, k, warps, stages) for n, k, warps, stages in (
    (8, 256, 4, 4), (16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 4), (16, 256, 2, 4),
    (16, 128, 4, 6)))  # fmt: skip


@dataclass
class Row:
    layer: str
    num_rows: int
    variant: str
    us: float  # per call (per 32 layers in ms for the layer rows, see `unit`)
    gbs: float  # weight bytes / time
    frac: float  # of the copy bandwidth
    vs_linear: float  # F.linear's time / this time
    note: str = ""
    unit: str = "us"


def random_weight(n: int, k: int) -> torch.Tensor:
    """[n, k] with std 1/sqrt(k): outputs of order 1, layer after layer."""
    return torch.empty(n, k, device="cuda", dtype=DTYPE).normal_(0.0, k**-0.5)


def check_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Abort the run unless a gemv variant matches F.linear to bf16 accuracy."""
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=2e-2, msg=lambda m: f"{what}: {m}")


def sweep(num_rows: int) -> list[GemvConfig]:
    fma = _FMA_SWEEP if num_rows == 1 else _FMA_SWEEP[:1] if num_rows == 2 else ()
    return [*fma, *_DOT_SWEEP]


def describe(config: GemvConfig) -> str:
    path = "dot" if config.use_dot else "fma"
    return (f"{path} n{config.block_n} k{config.block_k} w{config.num_warps} "
            f"s{config.num_stages}")  # fmt: skip


@dataclass
class LayerCase:
    """One layer shape: its rotating weight copies and the ceiling to report against."""

    name: str
    weights: list[torch.Tensor]  # copies of one [N, K] weight, cycled through by each graph
    copy_gbs: float

    @property
    def weight_gb(self) -> float:
        return self.weights[0].numel() * self.weights[0].element_size() / 1e9

    def time_us(self, fn: Callable[[torch.Tensor], object]) -> float:
        """Graph-timed microseconds of `fn(weight)`, the calls cycling through the copies."""
        copies = self.weights
        calls = [functools.partial(fn, copies[i % len(copies)]) for i in range(_CALLS_PER_GRAPH)]
        return graph_ms(calls, replays=_REPLAYS) * 1e3

    @classmethod
    def random(cls, name: str, copy_gbs: float) -> LayerCase:
        """Random weights of layer `name`'s shape: as many copies as span `_ROTATE_BYTES`."""
        n, k = SHAPES[name]
        num_copies = min(max(_ROTATE_BYTES // (n * k * 2), 1), _CALLS_PER_GRAPH)
        return cls(name, [random_weight(n, k) for _ in range(num_copies)], copy_gbs)

    def row(self, num_rows: int, variant: str, us: float, t_ref: float, note: str = "") -> Row:
        gbs = self.weight_gb / us * 1e6
        return Row(self.name, num_rows, variant, us, gbs, gbs / self.copy_gbs, t_ref / us, note)


def time_gemv(
    case: LayerCase,
    x: torch.Tensor,
    ref: torch.Tensor,
    t_ref: float,
    *,
    swiglu: bool,
    do_sweep: bool,
) -> tuple[list[Row], GemvConfig]:
    """Rows for gemv's default config and the sweep's winner (each config checked against
    `ref` first); returns the winner too."""
    num_rows = x.shape[0]
    n, k = case.weights[0].shape
    default = choose_gemv_config(num_rows, n, k, DTYPE, swiglu=swiglu)
    configs = [default] + [c for c in (sweep(num_rows) if do_sweep else []) if c != default]
    times = {}
    for config in configs:
        fn = functools.partial(gemv, x, swiglu=swiglu, **asdict(config))
        check_close(fn(case.weights[0]), ref, f"{case.name} M={num_rows} {describe(config)}")
        times[config] = case.time_us(fn)
    best = min(times, key=times.__getitem__)
    label = "gemv swiglu" if swiglu else "gemv"
    rows = [case.row(num_rows, f"{label} default", times[default], t_ref, describe(default))]
    if do_sweep:
        variant = f"{label} best of {len(configs)}"
        rows.append(case.row(num_rows, variant, times[best], t_ref, describe(best)))
    return rows, best


def bench_layer(
    name: str, copy_gbs: float, do_sweep: bool, batches: tuple[int, ...] = BATCHES
) -> tuple[list[Row], dict]:
    """One layer shape at each batch: F.linear, gemv (and, for down, the SwiGLU variants).

    Returns the rows and the sweep's winners, keyed by (layer, M, swiglu).
    """
    k = SHAPES[name][1]
    case = LayerCase.random(name, copy_gbs)
    rows, winners = [], {}
    for num_rows in batches:
        x = torch.randn(num_rows, k, device="cuda", dtype=DTYPE)
        linear = functools.partial(F.linear, x)
        t_linear = case.time_us(linear)
        rows.append(case.row(num_rows, "F.linear", t_linear, t_linear))
        ref = linear(case.weights[0])
        new_rows, winners[(name, num_rows, False)] = time_gemv(
            case, x, ref, t_linear, swiglu=False, do_sweep=do_sweep
        )
        rows += new_rows
        if name != "down" or num_rows > 8:  # SwiGLU fusion: measured slower from two rows
            continue
        gate_up = torch.randn(num_rows, 2 * k, device="cuda", dtype=DTYPE)
        unfused = lambda w, gate_up=gate_up: F.linear(silu_and_mul(gate_up), w)
        t_unfused = case.time_us(unfused)
        rows.append(case.row(num_rows, "silu_and_mul+F.linear", t_unfused, t_linear))
        new_rows, winners[(name, num_rows, True)] = time_gemv(
            case, gate_up, unfused(case.weights[0]), t_unfused, swiglu=True, do_sweep=do_sweep
        )
        for r in new_rows:
            r.note += "  (x: vs silu_and_mul+F.linear)"
        rows += new_rows
    return rows, winners


# ------------------------------------------------------------------------- 32 layers in a row

_LAYER_OPS = ("qkv", "o", "gate_up", "down")


def _step(x, w, *, linear, activation_into_down):
    """One decoder layer's linears (no attention or norms): qkv -> o -> gate_up -> down.

    `linear(name, x, weight, swiglu)` runs one layer; with `activation_into_down` the down
    projection takes the fused [gate | up] rows (swiglu=True), else `silu_and_mul` runs first.
    """
    qkv = linear("qkv", x, w["qkv"], False)  # [M, 6144]
    h = linear("o", qkv[:, :HIDDEN], w["o"], False)  # stands in for the attention output
    gate_up = linear("gate_up", h, w["gate_up"], False)  # [M, 2 * 14336]
    if activation_into_down:
        return linear("down", gate_up, w["down"], True)
    return linear("down", silu_and_mul(gate_up), w["down"], False)


def _layer_variants(num_rows: int, winners: dict) -> dict[str, tuple[Callable, bool]]:
    """Variant name -> (linear(name, x, weight, swiglu), SwiGLU fused into down?)."""
    cublas = lambda name, x, w, swiglu: F.linear(x, w)
    default = lambda name, x, w, swiglu: gemv(x, w, swiglu=swiglu)

    def tuned(name, x, w, swiglu):
        config = winners.get((name, num_rows, swiglu))
        return gemv(x, w, swiglu=swiglu, **(asdict(config) if config else {}))

    mixed = lambda name, x, w, swiglu: (F.linear if name == "down" else gemv)(x, w)
    variants = {
        "F.linear (+silu_and_mul)": (cublas, False),
        "gemv, SwiGLU fused": (default, True),
        "gemv + silu_and_mul": (default, False),
        "gemv; silu_and_mul+F.linear down": (mixed, False),
    }
    if winners:
        variants["gemv swept best, SwiGLU fused"] = (tuned, True)
    return variants


def bench_layers(copy_gbs: float, winners: dict) -> list[Row]:
    """32 layers of qkv -> o -> gate_up -> down in one graph, each layer with its own weights."""
    layers = [{op: random_weight(*SHAPES[op]) for op in _LAYER_OPS} for _ in range(NUM_LAYERS)]
    total_gb = NUM_LAYERS * sum(n * k * 2 for n, k in (SHAPES[op] for op in _LAYER_OPS)) / 1e9
    floor_ms = total_gb / copy_gbs * 1e3
    rows = []
    for num_rows in LAYER_BATCHES:
        x = torch.randn(num_rows, HIDDEN, device="cuda", dtype=DTYPE)
        t_ref = None
        for variant, (linear, fused) in _layer_variants(num_rows, winners).items():
            step = functools.partial(_step, linear=linear, activation_into_down=fused)
            ms = graph_ms([functools.partial(functools.reduce, step, layers, x)], replays=_REPLAYS)
            t_ref = t_ref or ms
            note = f"floor {floor_ms:.3f} ms"
            rows.append(Row(f"{NUM_LAYERS} layers", num_rows, variant, ms, total_gb / ms * 1e3,
                            floor_ms / ms, t_ref / ms, note, unit="ms"))  # fmt: skip
            print(f"  {NUM_LAYERS} layers M={num_rows} {variant}: {ms:.3f} ms "
                  f"({floor_ms / ms:.1%} of the floor)", flush=True)  # fmt: skip
    return rows


def bench_norm_layers(copy_gbs: float) -> list[Row]:
    """32 layers at one row with their two pre-norms, as the model runs them with the measured
    gemv table (`sitsd.model.linear`): `fused_add_rms_norm` then gemv, against `norm_gemv`
    (the add and the norm inside the qkv and gate_up kernels: two launches fewer per layer).
    `TunedLinear.fuse_norm` goes on if the second is faster."""
    from sitsd.kernels import fused_add_rms_norm, rms_norm
    from sitsd.kernels.reference import silu_and_mul_ref
    from sitsd.model.linear import TunedLinear
    from sitsd.model.ops import norm_linear

    layers = [{op: random_weight(*SHAPES[op]) for op in _LAYER_OPS} for _ in range(NUM_LAYERS)]
    norms = [(1 + 0.1 * torch.randn(2, HIDDEN, device="cuda")).to(DTYPE) for _ in layers]
    total_gb = NUM_LAYERS * sum(n * k * 2 for n, k in (SHAPES[op] for op in _LAYER_OPS)) / 1e9
    floor_ms = total_gb / copy_gbs * 1e3
    unfused = functools.partial(norm_linear, rms_norm, fused_add_rms_norm)
    rows, t_ref = [], None
    for variant, fuse in (("gemv table, add+norm kernels", False),
                          ("gemv table, norms in norm_gemv", True)):  # fmt: skip
        tuned = TunedLinear(True, silu_and_mul_ref, unfused, fuse_norm=fuse)

        def forward(h, tuned=tuned):
            res = None  # the first layer has no residual to add, as in the model
            for w, nw in zip(layers, norms, strict=True):
                qkv, res = tuned.norm_linear(h, res, nw[0], 1e-5, w["qkv"])
                h = tuned.linear(qkv[:, :HIDDEN], w["o"])  # stands in for attention's output
                gate_up, res = tuned.norm_linear(h, res, nw[1], 1e-5, w["gate_up"])
                h = tuned.swiglu_linear(gate_up, w["down"])
            return h

        h0 = torch.randn(1, HIDDEN, device="cuda", dtype=DTYPE)
        ms = graph_ms([functools.partial(forward, h0)], replays=_REPLAYS)
        t_ref = t_ref or ms
        note = f"floor {floor_ms:.3f} ms"
        rows.append(Row(f"{NUM_LAYERS} layers", 1, variant, ms, total_gb / ms * 1e3,
                        floor_ms / ms, t_ref / ms, note, unit="ms"))  # fmt: skip
        print(f"  {NUM_LAYERS} layers M=1 {variant}: {ms:.3f} ms", flush=True)
    return rows


# ------------------------------------------------------------------------------------ report


def print_table(rows: list[Row], copy_gbs: float) -> None:
    print(f"\n{torch.cuda.get_device_name()}  copy {copy_gbs:.0f} GB/s (read + write); "
          f"GB/s = weight bytes / time; x F.linear = F.linear's time / this time")  # fmt: skip
    print(f"{'layer':<10} {'M':>2} {'variant':<33} {'time':>11} {'GB/s':>6} {'of copy':>7} "
          f"{'x F.linear':>10}  config / notes")  # fmt: skip
    for r in rows:
        time_str = f"{r.us:.2f} {r.unit}" if r.unit == "us" else f"{r.us:.3f} {r.unit}"
        print(f"{r.layer:<10} {r.num_rows:>2} {r.variant:<33} {time_str:>11} {r.gbs:>6.0f} "
              f"{r.frac:>7.1%} {r.vs_linear:>10.2f}  {r.note}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every number here")
    parser.add_argument("--no-sweep", action="store_true", help="time gemv's default configs only")
    parser.add_argument("--skip-layers", action="store_true", help="skip the 32-layer sequences")
    parser.add_argument(
        "--rows",
        default=",".join(map(str, BATCHES)),
        help="rows of x per single-layer case, comma-separated (default: %(default)s; "
        "e.g. 1,2,4,8,16,32 to see where cuBLAS takes over)",
    )
    args = parser.parse_args(argv)
    batches = tuple(int(r) for r in args.rows.split(","))
    if not all(1 <= r <= MAX_ROWS for r in batches):
        parser.error(f"--rows: each between 1 and {MAX_ROWS}")
    if not torch.cuda.is_available():
        sys.exit("bench.bench_gemv needs a CUDA GPU")
    started = now()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth() / 1e9
    torch.cuda.empty_cache()  # the 8 GiB of the copy go before the weights
    print(f"copy {copy_gbs:.0f} GB/s (read + write)", flush=True)
    rows, winners = [], {}
    for name in SHAPES:
        new_rows, new_winners = bench_layer(name, copy_gbs, not args.no_sweep, batches)
        for r in new_rows:
            print(f"  {name} M={r.num_rows} {r.variant}: {r.us:.2f} us, {r.frac:.1%} of copy, "
                  f"x{r.vs_linear:.2f}  {r.note}", flush=True)  # fmt: skip
        rows += new_rows
        winners |= new_winners
        torch.cuda.empty_cache()
    if not args.skip_layers:
        rows += bench_layers(copy_gbs, {} if args.no_sweep else winners)
        rows += bench_norm_layers(copy_gbs)
    results = {
        "device": torch.cuda.get_device_name(),
        "copy_gbs": copy_gbs,
        "rows": [asdict(r) for r in rows],
        "winners": {
            f"{layer} M={m}{' swiglu' if sw else ''}": asdict(c)
            for (layer, m, sw), c in winners.items()
        },
        "seconds": now() - started,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print_table(rows, copy_gbs)
    print(f"\n{results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
