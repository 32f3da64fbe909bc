"""The model's linear layers: gemv and skinny_gemm exactly where the measured tables say,
cuBLAS elsewhere, and the same values either way (CPU interpreter; a `gpu` test on Llama-3-8B
layer shapes)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import sitsd.model.linear as linear_mod
from sitsd.kernels.gemv import GemvConfig
from sitsd.kernels.reference import (
    fused_add_rms_norm_ref,
    norm_gemv_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from sitsd.kernels.skinny_gemm import SkinnyConfig
from sitsd.model.linear import (
    GEMV_MEASURED_FASTER,
    SKINNY_MEASURED_FASTER,
    TunedLinear,
    measured_device,
)
from sitsd.model.ops import norm_linear
from tests.kernels.helpers import assert_close

UNFUSED = partial(norm_linear, rms_norm_ref, fused_add_rms_norm_ref)

N, K = 40, 96
TABLE = {(N, K): (8, GemvConfig(4, 32, 1, 2, use_dot=False))}
SKINNY = {(N, K): {32: SkinnyConfig(16, 16, 2, 1, 2)}}  # 17-32 rows; 9-16 and 33-64 unmeasured


@pytest.fixture
def calls(monkeypatch):
    """Every gemv call's (rows, swiglu, use_dot)."""
    seen: list[tuple[int, bool, bool]] = []
    real = linear_mod.gemv

    def spy(x, weight, *, swiglu=False, **config):
        seen.append((x.shape[0], swiglu, config["use_dot"]))
        return real(x, weight, swiglu=swiglu, **config)

    monkeypatch.setattr(linear_mod, "gemv", spy)
    return seen


@pytest.fixture
def skinny_calls(monkeypatch):
    """Every skinny_gemm call's (rows, split_k)."""
    seen: list[tuple[int, int]] = []
    real = linear_mod.skinny_gemm

    def spy(x, weight, **config):
        seen.append((x.shape[0], config["split_k"]))
        return real(x, weight, **config)

    monkeypatch.setattr(linear_mod, "skinny_gemm", spy)
    return seen


def tuned(use_gemv=True, fuse_norm=False):
    return TunedLinear(use_gemv, silu_and_mul_ref, UNFUSED, TABLE, SKINNY, fuse_norm=fuse_norm)


@pytest.mark.parametrize(("rows", "use_dot"), [(1, False), (3, True), (8, True)])
def test_measured_shapes_up_to_their_row_limit_go_to_gemv(calls, rows, use_dot):
    x = torch.randn(rows, K).bfloat16()
    w = (torch.randn(N, K) / K**0.5).bfloat16()
    assert_close(tuned().linear(x, w), F.linear(x, w), torch.bfloat16)
    assert calls == [(rows, False, use_dot)]


@pytest.mark.parametrize("rows", [17, 24, 32])
def test_measured_row_tiles_go_to_skinny_gemm(calls, skinny_calls, rows):
    x = torch.randn(rows, K).bfloat16()
    w = (torch.randn(N, K) / K**0.5).bfloat16()
    assert_close(tuned().linear(x, w), F.linear(x, w), torch.bfloat16)
    assert skinny_calls == [(rows, 2)]
    assert calls == []


def test_everything_else_goes_to_cublas(calls, skinny_calls):
    x, w = torch.randn(9, K).bfloat16(), (torch.randn(N, K) / K**0.5).bfloat16()
    tuned().linear(x, w)  # past gemv's row limit, below skinny's measured tile
    tuned().linear(torch.randn(33, K).bfloat16(), w)  # past skinny's measured tiles
    tuned().linear(x[:1], (torch.randn(N + 1, K) / K**0.5).bfloat16())  # an unmeasured shape
    tuned().linear(x[:1], w, torch.zeros(N).bfloat16())  # a bias
    tuned().linear(x[:1].float(), w.float())  # float32: measured in 16 bits only
    tuned(use_gemv=False).linear(x[:1], w)  # an unmeasured device
    tuned(use_gemv=False).linear(torch.randn(20, K).bfloat16(), w)
    assert calls == []
    assert skinny_calls == []


def test_swiglu_is_fused_at_one_row_and_separate_from_two(calls):
    w = (torch.randn(N, K) / K**0.5).bfloat16()
    for rows in (1, 2):
        gate_up = torch.randn(rows, 2 * K).bfloat16()
        want = F.linear(silu_and_mul_ref(gate_up), w)
        assert_close(tuned().swiglu_linear(gate_up, w), want, torch.bfloat16)
    assert calls == [(1, True, False), (2, False, True)]


@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_linear_fuses_the_norm_at_one_row_only_when_asked(monkeypatch, with_residual):
    fused: list[int] = []
    real = linear_mod.norm_gemv

    def spy(hidden, *args, **kwargs):
        fused.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(linear_mod, "norm_gemv", spy)
    w = (torch.randn(N, K) / K**0.5).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(K)).bfloat16()
    for rows, fuse in ((1, True), (1, False), (2, True)):
        hidden = torch.randn(rows, K).bfloat16()
        residual = torch.randn(rows, K).bfloat16() if with_residual else None
        out, res = tuned(fuse_norm=fuse).norm_linear(hidden, residual, norm_w, 1e-5, w)
        want, want_res = norm_gemv_ref(hidden, residual, norm_w, 1e-5, w)
        assert_close(out, want, torch.bfloat16, scale=2.0)
        assert_close(res, want_res, torch.bfloat16)
    assert fused == [1]


@pytest.mark.parametrize(
    ("available", "capability", "measured"),
    [(True, (9, 0), True), (True, (8, 0), False), (True, (10, 0), False), (False, None, False)],
)
def test_the_table_applies_to_sm90_devices_only(monkeypatch, available, capability, measured):
    # Measured on an H200: an A100 or a Blackwell card keeps cuBLAS until measured there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert measured_device() is measured


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
def test_gpu_llama_3_8b_layer_shapes_give_cublas_values(calls, rows):
    on, off = (TunedLinear(use, silu_and_mul_ref, UNFUSED, skinny={}) for use in (True, False))
    for n, k in GEMV_MEASURED_FASTER:
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        x = torch.randn(rows, k, device="cuda").bfloat16()
        assert_close(on.linear(x, w), off.linear(x, w), torch.bfloat16)
        if k == 14336:
            gate_up = torch.randn(rows, 2 * k, device="cuda").bfloat16()
            got, want = on.swiglu_linear(gate_up, w), off.swiglu_linear(gate_up, w)
            assert_close(got, want, torch.bfloat16)
    if rows > 8:  # past every row limit in the table
        assert calls == []
    else:
        assert calls, "no shape went to gemv"
        assert all(r == rows for r, _, _ in calls)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [9, 16, 24, 32, 40, 64])
def test_gpu_skinny_routes_give_cublas_values(skinny_calls, rows):
    on, off = (TunedLinear(use, silu_and_mul_ref, UNFUSED) for use in (True, False))
    tile = max(16, 1 << (rows - 1).bit_length())
    want = []
    for (n, k), tiles in SKINNY_MEASURED_FASTER.items():
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        x = torch.randn(rows, k, device="cuda").bfloat16()
        assert_close(on.linear(x, w), off.linear(x, w), torch.bfloat16)
        if tile in tiles:
            want.append((rows, tiles[tile].split_k))
    assert skinny_calls == want
    assert want, "no shape went to skinny_gemm"
