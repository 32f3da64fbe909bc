"""The plan a child process compiles INT4 kernels from, and how its failure reaches the parent
(`sitsd.runtime.precompile`; the compiles themselves: `test_gpu_precompile.py`)."""

from __future__ import annotations

import pytest
import torch

from sitsd.quant.layout import Int4Weight
from sitsd.runtime.precompile import (
    Int4Launches,
    Int4Plan,
    Int4Structure,
    compile_in_child,
    int4_structures,
    random_int4_weight,
)

LAUNCHES = Int4Launches(0, "bfloat16", None, 117_440_512, 7_168)


class Linears:
    """What `int4_structures` reads of a model's weights: its linears, in order."""

    def __init__(self, *weights: Int4Weight | torch.Tensor) -> None:
        self._weights = weights

    def linears(self):
        return iter(self._weights)


@pytest.mark.parametrize(("offsets", "zeros", "perm"), [("", False, False), ("float32", True, True),
                                                ("float16", False, False)])  # fmt: skip
def test_a_random_weight_has_the_structure_it_was_made_for(offsets, zeros, perm):
    s = Int4Structure(96, 256, 64, "float16", offsets, zeros, perm)
    w = random_int4_weight(s, torch.device("cpu"))  # Int4Weight checks its own shapes
    assert w.shape == (96, 256)
    assert w.group_size == 64
    assert w.scales.dtype == torch.float16
    has = (w.offsets is not None, w.zeros is not None, w.perm is not None)
    assert has == (bool(offsets), zeros, perm)
    if offsets:  # each pointer's dtype is part of what a kernel is compiled for
        assert str(w.offsets.dtype) == f"torch.{offsets}"  # type: ignore[union-attr]
    if zeros:  # integer zero points, exactly as `mark_integer_zeros` would find them
        assert w.offsets is not None
        assert w.zeros is not None
        assert torch.equal(w.offsets, -w.zeros.float() * w.scales.float())
    if perm:
        assert sorted(w.perm.tolist()) == list(range(256))  # type: ignore[union-attr]


def test_structures_are_the_distinct_int4_linears_in_order_and_the_plan_survives_json():
    cpu = torch.device("cpu")
    qkv = Int4Structure(96, 64, 32, "bfloat16", "", False, False)
    down = Int4Structure(64, 128, 32, "bfloat16", "float32", True, False)
    weights = Linears(random_int4_weight(qkv, cpu), torch.zeros(64, 64),
                      random_int4_weight(down, cpu), random_int4_weight(qkv, cpu),
                      torch.zeros(500, 64))  # fmt: skip
    structures = int4_structures(weights)  # type: ignore[arg-type]
    assert structures == (qkv, down)
    plan = Int4Plan(LAUNCHES, structures, (1, 8, 256))
    assert Int4Plan.from_json(plan.to_json()) == plan


def test_a_plan_with_nothing_to_compile_starts_no_child():
    assert compile_in_child(Int4Plan(LAUNCHES, (), (1, 2))) == 0.0
    structure = Int4Structure(64, 64, 32, "bfloat16", "", False, False)
    assert compile_in_child(Int4Plan(LAUNCHES, (structure,), ())) == 0.0


def test_a_child_that_fails_says_why():
    # No machine has a CUDA device 99 (nor one at all, on CI): the child's first CUDA call fails.
    structure = Int4Structure(64, 64, 32, "bfloat16", "", False, False)
    launches = Int4Launches(99, "bfloat16", None, 0, 0)
    with pytest.raises(RuntimeError, match=r"the INT4 compiles failed \(exit 1\): .+"):
        compile_in_child(Int4Plan(launches, (structure,), (1,)))
