"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with `launch_pdl=True` may be
scheduled while the kernel before it on the stream is still finishing; it must not touch memory
that kernel may write until it has completed.

Every decode-path kernel takes a `PDL` constexpr and calls `pdl_enter(PDL)` before its first
load or store: it waits for the previous grid (`griddepcontrol.wait`: completion and memory
flush) and then lets the next grid launch early (`griddepcontrol.launch_dependents`). The waits
chain, so a kernel never runs ahead of any earlier one. Inside a CUDA graph the launches become
programmatic edges: the next kernel's launch and ramp-up overlap this kernel's tail instead of
following it. With `PDL` False both calls compile away (and the interpreter never sees them).

Before it waits, a kernel may already read memory that no decode kernel writes: its weights
(`prefetch_l2_runs` and `prefetch_l2_lines` ask L2 for them). It can start early only once the
kernel before it has passed its own wait (everything before that one has completed) or has
ended, and that kernel does not write weights either.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2_runs(ptrs, NBYTES: tl.constexpr):
    """Ask L2 for `NBYTES` from each of `ptrs` (16-byte aligned, NBYTES a multiple of 16), one
    bulk prefetch each (`cp.async.bulk.prefetch.L2`, sm_90+): nothing is waited for and no
    register is filled. ptxas issues one prefetch per distinct address in a warp, in turn."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;",
        "=r,l,r",
        [ptrs.to(tl.int64), tl.full(ptrs.shape, NBYTES, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_l2_lines(ptrs):
    """Ask L2 for the cache line that holds each of `ptrs` (`prefetch.global.L2`, any
    alignment), each thread for its own elements."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\nmov.u32 $0, 0;",
        "=r,l",
        [ptrs.to(tl.int64)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
