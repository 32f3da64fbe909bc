"""Instructions per code in the INT4 kernels' main loops, from their SASS for sm_90, compiled
here without a GPU (Triton's offline compile; its own `nvdisasm`).

For each kernel and tile it prints the loop's instruction count, that count per code each thread
multiplies (a code times a row of x), the registers, the stack (spills) and the most frequent
opcodes. A proxy for the GPU's time where a kernel is issue-bound, and a check that a change
compiles for sm_90 with the Triton at hand (the device has its own: put another version first
on PYTHONPATH to count for it).

    python -m bench.sass_int4 [--mode gemv|mma|dot|all] [--rows 1] [--k 4096]

Pointer and stride arguments are marked 16-byte divisible, as the JIT marks them at run time
for aligned tensors (without it every load is scalar and the counts mislead).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sitsd.kernels._int4_mma import int4_mma_kernel
from sitsd.kernels._int4_sliced import int4_gemv_kernel
from sitsd.kernels.int4_matmul import _MODE_IDS, _int4_matmul_kernel

_TARGET = GPUTarget("cuda", 90, 32)
_ALIGNED = {"x_ptr", "qw_ptr", "s_ptr", "o_ptr", "z_ptr", "perm_ptr", "out_ptr", "N",
            "stride_xm"}  # fmt: skip
_TYPES = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp32", "z_ptr": "*i32",
          "perm_ptr": "*i32", "merged_ptr": "*bf16",  # out_ptr's: by the split (`compile_sass`)
          "counters_ptr": "*i32"}  # fmt: skip


@dataclass(frozen=True)
class LoopCount:
    """One compiled kernel's main loop."""

    instructions: int  # in the loop body, NOPs left out
    per_code: float  # instructions / (codes x rows of x) each thread multiplies per iteration
    registers: int
    stack: int  # bytes of local memory per thread (spills)
    opcodes: list[tuple[str, int]]  # the most frequent, with their counts


def compile_sass(fn: triton.JITFunction, constants: dict[str, object], num_warps: int,
                 max_registers: int | None = None) -> str:  # fmt: skip
    """`fn` compiled for sm_90 with `constants` (and ptxas's register cap), disassembled."""
    names = list(fn.arg_names)
    constants = {c: v for c, v in constants.items() if c in names}  # what this version takes
    # Unsplit, the kernel stores the output in x's dtype, split the float32 partials: the two
    # stores take different registers (gate_up's zero-point tile: 135 against 128)
    types = dict(_TYPES, out_ptr="*bf16" if constants.get("SPLIT_K", 1) == 1 else "*fp32")
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in _ALIGNED}
    fixed = {(names.index(c),): v for c, v in constants.items()}
    kernel = triton.compile(ASTSource(fn, signature, fixed, attrs), target=_TARGET,
                            options={"num_warps": num_warps, "maxnreg": max_registers})  # fmt: skip
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = _run(tools / "nvdisasm", "-c", str(cubin))
        usage = _run(tools / "cuobjdump", "-res-usage", str(cubin))
    return sass + "\n" + usage


def loop_count(sass: str, codes_per_thread: float) -> LoopCount:
    """The longest loop of `sass` (a label and the backward branch to it)."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    best: list[str] = []
    for line in sass.splitlines():
        if label := re.match(r"\s*(\.L_x_\d+):", line):
            labels[label.group(1)] = len(instructions)
            continue
        if found := re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);", line):
            instructions.append(found.group(1).strip())
            branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", found.group(1))
            if branch and labels.get(branch.group(1), len(instructions)) < len(instructions) - 1:
                body = instructions[labels[branch.group(1)] :]
                best = body if len(body) > len(best) else best
    ops = collections.Counter(_opcode(i) for i in best if "NOP" not in i)
    used = re.search(r"REG:(\d+) STACK:(\d+)", sass)
    total = sum(ops.values())
    return LoopCount(
        instructions=total,
        per_code=total / codes_per_thread,
        registers=int(used.group(1)) if used else -1,
        stack=int(used.group(2)) if used else -1,
        opcodes=ops.most_common(8),
    )


def gemv(
    rows: int, block_n: int, k: int, offsets: bool, num_warps: int = 2, block_k: int = 128,
    prefetch: bool = True, sliced: bool = False,
) -> LoopCount:  # fmt: skip
    """`int4_gemv_kernel` (mode gemv) on `block_k`-column chunks, split 8 ways, as the engine
    launches it (PDL, the splits merged in the kernel)."""
    constants = dict(K=k, GROUP=128, ROWS=rows, BLOCK_N=block_n, WORDS=block_k // 8, SPLIT_K=8,
                     K_SPLIT=k // 8, HAS_OFFSETS=offsets, HAS_PERM=False, SLICED=sliced, EVEN=True,
                     EVEN_K=True, PREFETCH=prefetch, MERGE=True, PDL=True)  # fmt: skip
    sass = compile_sass(int4_gemv_kernel, constants, num_warps)
    return loop_count(sass, block_n * block_k * rows / (32 * num_warps))


def mma(
    block_m: int, block_n: int, k: int, zeros: bool, ordered: bool, scaled: bool = False,
    ahead: bool = True,
) -> LoopCount:  # fmt: skip
    """`int4_mma_kernel` (mode mma), 4 warps, split 8 ways, as the engine launches it (PDL, the
    splits merged in the kernel); per code of the weight tile (its MMA covers all block_m rows
    of x at once). `ahead` False: x loaded where it is used (`Int4MatmulConfig.x_ahead`)."""
    constants = dict(K=k, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=8, K_SPLIT=k // 8,
                     HAS_OFFSETS=zeros, HAS_ZEROS=zeros, HAS_PERM=False, EVEN=True, EVEN_K=True,
                     ASM=True, X_ORDERED=ordered, KX=k, MERGE=True, SCALED=scaled,
                     X_AHEAD=ahead, PDL=True)  # fmt: skip
    sass = compile_sass(int4_mma_kernel, constants, 4)
    return loop_count(sass, block_n * 128 / 128)


def dot(mode: str, block_m: int, block_n: int, block_k: int, num_warps: int, k: int) -> LoopCount:
    """`_int4_matmul_kernel` in a dot mode, one split; per weight code for 128 rows of x (a
    tile of fewer rows dequantizes each code once per tile)."""
    constants = dict(K=k, GROUP=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                     SPLIT_K=1, K_SPLIT=k, MODE=_MODE_IDS[mode], HAS_OFFSETS=False,
                     HAS_PERM=False, EVEN=True, EVEN_K=True, UPCAST=False, MERGE=False,
                     PDL=False)  # fmt: skip
    sass = compile_sass(_int4_matmul_kernel, constants, num_warps)
    return loop_count(sass, block_n * block_k / (32 * num_warps) * block_m / 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("gemv", "mma", "dot", "all"), default="all")
    parser.add_argument("--rows", type=int, default=1, help="rows of x per gemv program")
    parser.add_argument("--k", type=int, default=4096)
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90, K = {args.k}")
    if args.mode in ("gemv", "all"):
        # (rows of W, chunk, loads one chunk ahead): the 1-row defaults among them (gate_up
        # without offsets: n32 without loads ahead; down: n64 k256; with offsets: n64 k128)
        for block_n, block_k, ahead in ((32, 128, True), (32, 128, False), (64, 128, True),
                                        (128, 128, True), (64, 256, True)):  # fmt: skip
            for offsets in (False, True):
                for sliced in (False, True):
                    count = gemv(args.rows, block_n, args.k, offsets, block_k=block_k,
                                 prefetch=ahead, sliced=sliced)  # fmt: skip
                    label = f"gemv rows {args.rows} n{block_n} k{block_k}"
                    label += ("" if ahead else " p1") + (" sliced" if sliced else "")
                    _show(f"{label} {'offsets' if offsets else 'sym'}", count, "code x row")
    if args.mode in ("mma", "all"):
        for block_m, block_n in ((16, 64), (16, 128), (32, 64), (64, 64), (128, 64)):
            for ordered in (False, True) if block_m >= 32 else (False,):
                for scaled in (False, True):
                    for ahead in (True, False) if ordered else (True,):
                        count = mma(block_m, block_n, args.k, False, ordered, scaled, ahead)
                        label = (f"mma m{block_m} n{block_n}" + (" x ordered" if ordered else "")
                                 + (" scaled" if scaled else "")
                                 + ("" if ahead else " x in loop"))  # fmt: skip
                        _show(label, count, "code")
    if args.mode in ("dot", "all"):  # the dot modes for 128 rows of x (mma m128 above)
        for mode, block_m, block_n, block_k, num_warps in (
            ("dot", 64, 128, 64, 4),  # choose_int4_config's at 65-128 rows
            ("dot", 128, 128, 64, 8),
            ("dot_swapped", 128, 128, 64, 8),
            ("dot_swapped", 128, 64, 128, 4),
        ):
            count = dot(mode, block_m, block_n, block_k, num_warps, args.k)
            label = f"{mode} m{block_m} n{block_n} k{block_k} w{num_warps}"
            _show(label, count, "code/128r")


def _show(label: str, count: LoopCount, unit: str) -> None:
    ops = ", ".join(f"{op} {n}" for op, n in count.opcodes)
    print(f"{label:28s} loop {count.instructions:5d}  {count.per_code:5.2f} per {unit:10s} "
          f"regs {count.registers:3d} stack {count.stack:4d}  {ops}", flush=True)  # fmt: skip


def _opcode(instruction: str) -> str:
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def _run(*command: Path | str) -> str:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


if __name__ == "__main__":
    main()
