"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with `launch_pdl=True` may be
scheduled while the kernel before it on the stream is still finishing; it must not touch memory
until that kernel has completed.

Every decode-path kernel takes a `PDL` constexpr and calls `pdl_enter(PDL)` before its first
load or store: it waits for the previous grid (`griddepcontrol.wait`: completion and memory
flush) and then lets the next grid launch early (`griddepcontrol.launch_dependents`). The waits
chain, so a kernel never runs ahead of any earlier one. Inside a CUDA graph the launches become
programmatic edges: the next kernel's launch and ramp-up overlap this kernel's tail instead of
following it. With `PDL` False both calls compile away (and the interpreter never sees them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
