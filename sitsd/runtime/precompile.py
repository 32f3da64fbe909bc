"""INT4 kernels compiled in a child process, ahead of a capture beside serving.

A weight slot restaged with a version of another precision has its CUDA graphs captured again
on the stager's thread while the engine serves from the other slot (`ModelRunner.
recapture_graphs`). The warm-ups of that capture are the first launches of the INT4 kernels in
this process, and Triton compiles each one then: its passes hold the interpreter 18-80 ms at a
time (measured on an H100: `make_llir`, in C++, never lets go of it), and the engine's thread
waits on each, so a swap into INT4 stretched steps by that much, dozens of times. Here a child
process makes the same launches first, with random weights of the same structure at every row
count the capture will run: its compiles land in Triton's on-disk cache, from which the
capture then loads them (a file read per kernel). The child shares the parent's environment,
so its cache directory and compile options are the parent's.

    parent (stager thread)                child (`python -m sitsd.runtime.precompile`)
    int4_structures(weights) ----JSON---> one Int4Weight per structure, random codes
    waits on the child (no lock held)     QuantizedLinears(...)(x, w) for every row count
    capture: kernels from the disk cache  exits; what it compiled stays on disk

What it leaves to others: which linears are INT4 (the slot's weights), the row counts and the
launch options (the runner and the builder: `Int4Launches`), and what happens when the child
fails (nothing: the capture compiles in-process as before, and the caller logs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from sitsd.children import module_command
from sitsd.kernels.quant_layout import slice_major_perm
from sitsd.model.weights import LlamaWeights
from sitsd.quant.layout import Int4Weight

# A child that takes longer is stopped: the capture then compiles what is left in-process.
CHILD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Int4Structure:
    """What an INT4 linear's kernels are compiled for, besides the rows of x."""

    n: int  # output features
    k: int  # input features
    group_size: int
    scale_dtype: str  # "bfloat16", "float16" or "float32"
    # The offsets' dtype, "" without (zero point 8): a kernel is compiled per pointer type,
    # and converted checkpoints keep float32 offsets beside 16-bit scales
    offset_dtype: str
    zeros: bool  # the zero points are integers (`Int4Weight.zeros`)
    perm: bool  # act-order (`Int4Weight.perm`)
    slice_major: bool = False  # the codes are slice-major (`Int4Weight.slice_major`)


@dataclass(frozen=True)
class Int4Launches:
    """How a runner launches its INT4 linears (`sitsd.model.qlinear.QuantizedLinears`)."""

    device_index: int
    dtype: str  # the activations' ("bfloat16")
    pdl: bool | None  # programmatic dependent launch where it pays; None: if the device has it
    workspace_numel: int  # the dequantize workspace's elements; 0: none
    counters_numel: int  # split-K counters; 0: none


@dataclass(frozen=True)
class Int4Plan:
    """What the child compiles: every structure at every row count, launched as `launches`."""

    launches: Int4Launches
    structures: tuple[Int4Structure, ...]
    rows: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Int4Plan:
        raw = json.loads(text)
        return Int4Plan(
            Int4Launches(**raw["launches"]),
            tuple(Int4Structure(**s) for s in raw["structures"]),
            tuple(int(r) for r in raw["rows"]),
        )


def int4_structures(weights: LlamaWeights) -> tuple[Int4Structure, ...]:
    """The distinct structures of `weights`' INT4 linears, in the order they first appear."""
    seen: dict[Int4Structure, None] = {}
    for w in weights.linears():
        if isinstance(w, Int4Weight):
            n, k = w.shape
            offsets = "" if w.offsets is None else _dtype_name(w.offsets.dtype)
            structure = Int4Structure(n, k, w.group_size, _dtype_name(w.scales.dtype), offsets,
                                      w.zeros is not None, w.perm is not None,
                                      w.slice_major)  # fmt: skip
            seen.setdefault(structure, None)
    return tuple(seen)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compile_in_child(plan: Int4Plan, timeout_s: float = CHILD_TIMEOUT_S) -> float:
    """Run `plan` in a child process; returns its wall seconds (0.0 with nothing to compile).

    Raises:
        RuntimeError: the child failed or ran past `timeout_s` (its last output says why).
    """
    if not plan.structures or not plan.rows:
        return 0.0
    argv, env = module_command("sitsd.runtime.precompile")
    start = time.perf_counter()
    try:
        done = subprocess.run(
            argv, input=plan.to_json(), capture_output=True, text=True, env=env,
            timeout=timeout_s, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the INT4 compiles ran past {timeout_s:.0f}s") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout or "no output").strip().splitlines()[-1]
        raise RuntimeError(f"the INT4 compiles failed (exit {done.returncode}): {last}")
    return time.perf_counter() - start


def precompile_int4(launches: Int4Launches, weights: LlamaWeights, rows: Sequence[int]) -> float:
    """Compile the kernels of `weights`' INT4 linears at `rows` in a child process
    (`compile_in_child`); returns its seconds, 0.0 when they have none."""
    return compile_in_child(Int4Plan(launches, int4_structures(weights), tuple(rows)))


def random_int4_weight(s: Int4Structure, device: torch.device) -> Int4Weight:
    """An Int4Weight of structure `s` with random codes, scales in [0.01, 0.02) and integer
    zero points (offsets = -zeros * scales, as `mark_integer_zeros` would find them).
    Its tensors have the dtypes `s` names, contiguous, freshly allocated (16-byte aligned):
    what Triton specializes a launch on besides the shapes, as the slot's own have."""
    groups = -(-s.k // s.group_size)
    dtype = getattr(torch, s.scale_dtype)
    qweight = torch.randint(-(2**31), 2**31 - 1, (s.n, s.k // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(groups, s.n, device=device) * 0.01 + 0.01).to(dtype)
    zeros = torch.randint(0, 16, (groups, s.n), dtype=torch.int32, device=device)
    offsets = None
    if s.offset_dtype:
        offsets = (-zeros.float() * scales.float()).to(getattr(torch, s.offset_dtype))
    perm = torch.randperm(s.k, device=device).to(torch.int32) if s.perm else None
    if s.slice_major:
        perm = slice_major_perm(s.k, device)
    return Int4Weight(qweight, scales, offsets, s.group_size, perm, zeros if s.zeros else None,
                      s.slice_major)  # fmt: skip


@torch.inference_mode()
def run_plan(plan: Int4Plan) -> int:
    """Launch every structure at every row count as `plan.launches` says (the child's work);
    returns the number of launches."""
    from sitsd.kernels._utils import supports_pdl
    from sitsd.model.qlinear import QuantizedLinears

    spec = plan.launches
    device = torch.device("cuda", spec.device_index)
    torch.cuda.set_device(device)
    dtype = getattr(torch, spec.dtype)  # the activations'
    workspace = (torch.empty(spec.workspace_numel, dtype=dtype, device=device)
                 if spec.workspace_numel else None)  # fmt: skip
    counters = (torch.zeros(spec.counters_numel, dtype=torch.int32, device=device)
                if spec.counters_numel else None)  # fmt: skip
    pdl = supports_pdl() if spec.pdl is None else spec.pdl  # as `triton_kernels` decides
    linears = QuantizedLinears(workspace, pdl, counters)
    launches = 0
    for structure in plan.structures:
        weight = random_int4_weight(structure, device)
        for rows in plan.rows:
            linears(torch.randn(rows, structure.k, dtype=dtype, device=device), weight)
            launches += 1
        del weight
    torch.cuda.synchronize(device)
    return launches


def _main(argv: Sequence[str]) -> int:
    del argv  # the plan comes on stdin
    plan = Int4Plan.from_json(sys.stdin.read())
    start = time.perf_counter()
    launches = run_plan(plan)
    print(f"{launches} INT4 launches compiled in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
