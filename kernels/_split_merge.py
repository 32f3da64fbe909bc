"""Split-K merged inside the kernel that split it (a `@triton.jit` helper): the last program
of a tile to finish sums the tile's float32 partials and writes the output, instead of a
second kernel launched after it.

Each program along K stores its partial into the `[SPLIT_K, M, N]` slabs as before, then
counts itself in on its tile's counter: a barrier (every thread's stores done), one atomic
increment with release and acquire semantics at GPU scope. The program that counts last
acquires the other programs' partials, zeroes the counter for the next launch (which the
stream orders after this one), and sums the slabs from split 0 up, reading through L2 (`.cg`:
other SMs wrote them), the order the two-kernel path's sum kernel uses: the same bits
whichever program comes last. The counters are the caller's (int32 zeros, one per output
tile, left zero); a program's tile is its place on the grid's first two axes (the third is the
split, as `int4_matmul` launches every mode), and which outputs the tile holds is the calling
kernel's business.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_splits(part_ptr, out_ptr, counters_ptr, offs, mask, M, N, SPLIT_K: tl.constexpr):
    """After this program stored its partial at `part_ptr + split * M * N + offs`: if it is
    the tile's last, `out[offs] = sum over splits of the partials` (in out's dtype)."""
    counter_ptr = counters_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        tl.debug_barrier()
        tl.store(counter_ptr, 0)
        acc = tl.full(offs.shape, 0.0, tl.float32)  # from 0, as the sum kernel: -0.0 stays 0.0
        for split in tl.static_range(SPLIT_K):  # a fixed order: the same bits every time
            acc += tl.load(part_ptr + split * M * N + offs, mask=mask, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
