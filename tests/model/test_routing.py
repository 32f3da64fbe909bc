"""Programmatic dependent launch goes on at the decode row counts where it measured faster (1-2
and from 32), for the kernel set's calls and for the linear layers' gemv and skinny_gemm (INT4
layers up to 32 rows), and never with the runner's switch off; INT4 layers merge their split-K
partials in the kernel up to 16 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sitsd.model.linear as linear_mod
from sitsd.kernels.gemv import GemvConfig
from sitsd.kernels.reference import silu_and_mul_ref
from sitsd.kernels.skinny_gemm import SkinnyConfig
from sitsd.model.linear import TunedLinear
from sitsd.model.ops import with_pdl
from sitsd.model.qlinear import INT4_MERGE_ROWS, QuantizedLinears, int4_pdl_pays
from sitsd.model.routing import pdl_pays
from tests.kernels.helpers import assert_close

N, K = 40, 64
# gemv up to 8 rows, skinny_gemm for 17-32 (the row tile of 32)
GEMV = {(N, K): (8, GemvConfig(4, 32, 1, 2, use_dot=False))}
SKINNY = {(N, K): {32: SkinnyConfig(16, 16, 2, 1, 2)}}
# the GPU where there is one; else the CPU, where Triton runs in its interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pdl_goes_on_at_the_decode_batches_where_it_measured_faster():
    measured = (1, 2, 4, 8, 16, 24, 32, 64, 128)  # bench/results/pdl-h200.txt
    assert [rows for rows in measured if pdl_pays(rows)] == [1, 2, 32, 64, 128]
    assert [rows for rows in (3, 23, 25, 31, 33, 200) if pdl_pays(rows)] == [33, 200]


def test_int4_layers_get_pdl_where_it_pays_up_to_32_rows():
    measured = (1, 2, 8, 32, 64, 128)  # bench/results/quant-kernels-h100.txt: 64, 128 slower
    assert [rows for rows in measured if int4_pdl_pays(rows)] == [1, 2, 32]
    assert [rows for rows in (3, 31, 33, 64, 65, 255) if int4_pdl_pays(rows)] == []


def test_kernel_set_calls_get_pdl_by_their_first_dimension():
    seen = []

    def kernel(x, scale, *, pdl, out=None):
        seen.append((x.shape[0], scale, pdl, out))

    for rows in (1, 8, 32):
        with_pdl(kernel, True, torch.zeros(rows, 4), 0.5, out="o")
    with_pdl(kernel, False, torch.zeros(1, 4), 0.5)  # off: never, whatever the rows
    assert seen == [(1, 0.5, True, "o"), (8, 0.5, False, "o"), (32, 0.5, True, "o"),
                    (1, 0.5, False, None)]  # fmt: skip


@pytest.mark.parametrize("switch", [True, False])
def test_linear_layers_get_pdl_where_it_pays(monkeypatch, switch):
    launches: list[tuple[str, int, bool]] = []
    real_gemv, real_skinny = linear_mod.gemv, linear_mod.skinny_gemm

    def gemv(x, weight, *, pdl, **config):
        launches.append(("gemv", x.shape[0], pdl))
        return real_gemv(x, weight, **config)  # recorded, then run plainly (CPU: no PDL there)

    def skinny_gemm(x, weight, *, pdl, **config):
        launches.append(("skinny", x.shape[0], pdl))
        return real_skinny(x, weight, **config)

    monkeypatch.setattr(linear_mod, "gemv", gemv)
    monkeypatch.setattr(linear_mod, "skinny_gemm", skinny_gemm)
    tuned = TunedLinear(True, silu_and_mul_ref, F.linear, GEMV, SKINNY, pdl=switch)
    w = (torch.randn(N, K, device=DEVICE) / K**0.5).bfloat16()
    for rows in (1, 2, 8, 24, 32):
        x = torch.randn(rows, K, device=DEVICE).bfloat16()
        assert_close(tuned.linear(x, w), F.linear(x, w), torch.bfloat16)
    gate_up = torch.randn(1, 2 * K, device=DEVICE).bfloat16()
    want = F.linear(silu_and_mul_ref(gate_up), w)
    # On the CPU the interpreter truncates the prologue's two roundings to bfloat16 (the GPU
    # rounds to nearest, as the reference does): one seed in ~60 took the relative norm of these
    # 40 outputs past the bound (1.07x).
    scale = 1.5 if DEVICE == "cpu" else 1.0
    assert_close(tuned.swiglu_linear(gate_up, w), want, torch.bfloat16, scale=scale)
    assert launches == [
        ("gemv", 1, switch), ("gemv", 2, switch), ("gemv", 8, False), ("skinny", 24, False),
        ("skinny", 32, switch), ("gemv", 1, switch),
    ]  # fmt: skip


def test_int4_layers_merge_their_splits_in_the_kernel_up_to_16_rows():
    # The runner's counters (enough for 16 rows of the widest layer) go to int4_matmul up to
    # INT4_MERGE_ROWS rows, where they cover the call's tiles; past them a second kernel sums
    # the splits (the merge measured slower at 32 and 64 rows).
    counters = torch.zeros(-(-4096 // 16), dtype=torch.int32)
    linears = QuantizedLinears(split_counters=counters)
    assert INT4_MERGE_ROWS == 16
    assert [rows for rows in (1, 2, 8, 16, 17, 32, 64) if linears.counters_for(rows, 4096)
            is counters] == [1, 2, 8, 16]  # fmt: skip
    assert linears.counters_for(1, 4097) is None  # one tile more than the counters hold
    assert QuantizedLinears().counters_for(1, 64) is None
