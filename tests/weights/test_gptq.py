"""`sitsd quantize --method gptq` on the tiny Llama: GPTQ's rounding with error feedback gives a
lower output error on the calibration activations than RTN at the same bits and group (and is RTN
when the Hessian says the inputs are independent); the directories it writes (AWQ layout, GPTQ
layout with act-order's g_idx) load back in sitsd with the logits of their dequantized weights;
the GPTQ packing is what GPTQModel's own dequantization reads; bad input is one line."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from sitsd.model.llama import build_weights
from sitsd.quant.cpu import CpuInt4Weight
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.export import gptq_module
from sitsd.quant.from_gptq import int4_from_gptq
from sitsd.quant.rtn import Int4Codes, quantize_int4
from sitsd.weights import load_checkpoint
from sitsd.weights.checks import load_version
from sitsd.weights.gptq import gptq_quantize, hessian
from sitsd.weights.quantize import (
    QuantizeConfig,
    calibration_windows,
    quantize_checkpoint,
)
from sitsd.weights.reference_llama import LayerInputs, ReferenceLlama, dense_tensors
from tests.kernels.helpers import assert_close
from tests.model.test_quantized_model import dequantized_logits, prompt_logits, random_prompt
from tests.quant.format_code import gptq_dequantize, gptq_pack
from tests.weights.test_quantize import TEXT
from tests.weights.tiny_models import write_tiny_llama


@pytest.fixture
def tiny(tmp_path):
    write_tiny_llama(tmp_path / "src", seed=random.randrange(1000))
    return load_checkpoint(tmp_path / "src")


def _rtn(group_size: int):
    def grid(w: torch.Tensor, energy: torch.Tensor) -> Int4Codes:
        return quantize_int4(w, group_size)

    return grid


def _output_error(x: torch.Tensor, w: torch.Tensor, codes: Int4Codes) -> float:
    return float(((x @ (w - codes.dequantize()).T) ** 2).sum())


def _calibration_inputs(ckpt, n_layer: int = 0) -> LayerInputs:
    """Every linear module's inputs in layer `n_layer` on the calibration text (16-bit)."""
    config = QuantizeConfig(window=64)
    windows = calibration_windows(ckpt, TEXT, config)
    model = ReferenceLlama(ckpt.arch, ckpt.tensors, windows.shape[1])
    inputs = LayerInputs(keep=windows.numel())
    with torch.inference_mode():
        h = model.embed(windows)
        for n in range(n_layer + 1):
            h = model.layer(n, h, on_input=inputs if n == n_layer else None)
    return inputs


@pytest.mark.parametrize(("act_order", "static_groups"), [(False, False), (True, False),
                                                         (True, True)])  # fmt: skip
def test_gptq_output_error_on_the_calibration_activations_is_below_rtns(
    tiny, act_order, static_groups
):
    inputs = _calibration_inputs(tiny, n_layer=random.randrange(tiny.arch.num_layers))
    gptq_total = rtn_total = 0.0
    for module, x in inputs.samples.items():
        w = tiny.tensors[f"{module}.weight"].float()
        rtn = quantize_int4(w, 32)
        gptq = gptq_quantize(w, hessian(x), 32, _rtn(32), act_order=act_order,
                             static_groups=static_groups, name=module)  # fmt: skip
        assert (gptq.perm is not None) == (act_order and not static_groups)
        gptq_error, rtn_error = _output_error(x, w, gptq), _output_error(x, w, rtn)
        assert gptq_error < rtn_error, module
        gptq_total += gptq_error
        rtn_total += rtn_error
    assert gptq_total < 0.7 * rtn_total  # the error feedback, not a lucky rounding


def test_gptq_with_independent_unit_inputs_is_rtn():
    # H = I: no column's error is handed to another, so every code is RTN's.
    w = torch.randn(48, 256)
    codes = gptq_quantize(w, torch.eye(256) * 2, 64, _rtn(64))
    assert torch.equal(codes.codes, quantize_int4(w, 64).codes)
    assert torch.equal(codes.dequantize(), quantize_int4(w, 64).dequantize())


def test_gptq_act_order_quantizes_the_loudest_inputs_first_and_groups_them_so():
    k = 128
    x = torch.randn(512, k) * torch.rand(k) * 4
    w = torch.randn(24, k)
    codes = gptq_quantize(w, hessian(x), 32, _rtn(32), act_order=True)
    energy = x.pow(2).mean(0)
    assert torch.equal(codes.perm.long(), torch.argsort(energy, descending=True, stable=True))
    g_idx = codes.group_index()
    assert torch.equal(g_idx[codes.perm.long()], torch.arange(k, dtype=torch.int32) // 32)
    # The layout with its permutation computes x @ W.T with W in the inputs' order.
    layout = codes.to_layout()
    torch.testing.assert_close(x @ layout.dequantize().T, x @ codes.dequantize().T)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_packing_is_what_gptqmodel_dequantizes(act_order):
    k, n = 256, 64  # AutoGPTQ's loops pack whole words of 32 columns
    x = torch.randn(300, k) @ (torch.randn(k, k) * 0.2 + torch.eye(k))
    codes = gptq_quantize(torch.randn(n, k), hessian(x), 64, _rtn(64), act_order=act_order)
    t = gptq_module(codes)
    theirs = gptq_dequantize(t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"],
                             minus_one=True)  # fmt: skip
    assert torch.equal(theirs.T, codes.dequantize())
    # AutoGPTQ's own packing loops write the same words.
    qweight, qzeros = gptq_pack(codes.natural_codes().T.contiguous(), codes.zeros, minus_one=True)
    assert torch.equal(qweight, t["qweight"])
    assert torch.equal(qzeros, t["qzeros"])
    back = int4_from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], shape=(n, k),
                          group_size=64, symmetric=False, zeros_minus_one=True,
                          name="m")  # fmt: skip
    assert torch.equal(back.dequantize(), codes.dequantize())


def _served_logits_match_the_dequantized(directory):
    """Load the version (its manifest verifies), serve it in its own bits on the CPU, and check
    its logits against the same model with the dequantized weights in 16 bits."""
    ckpt = load_version(directory).checkpoint
    arch = ckpt.arch
    reference = {n: t.float() for n, t in dense_tensors(arch, ckpt.tensors, ckpt.quant).items()}
    weights = build_weights(arch, ckpt.tensors, "cpu", torch.float32, source=ckpt.quant)
    ids = random_prompt(arch.vocab_size)
    assert_close(prompt_logits(arch, weights, ids), dequantized_logits(arch, reference, ids),
                 torch.bfloat16)  # fmt: skip
    return ckpt, weights, reference


@pytest.mark.parametrize(("fmt", "act_order"), [("awq", False), ("gptq", False), ("gptq", True)])
def test_the_gptq_directory_loads_back_with_the_logits_of_its_dequantized_weights(
    tiny, tmp_path, fmt, act_order
):
    config = QuantizeConfig(method="gptq", group_size=32, window=64, format=fmt,
                            act_order=act_order)  # fmt: skip
    layers = []
    quantize_checkpoint(tiny, config, TEXT, tmp_path / "q", on_layer=lambda d, t: layers.append(d))
    assert layers == [1, 2]  # one progress call per layer
    hf = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert (hf["quant_method"], hf["bits"], hf["group_size"]) == (fmt, 4, 32)
    if fmt == "gptq":
        assert (hf["desc_act"], hf["sym"]) == (act_order, False)
    _, weights, reference = _served_logits_match_the_dequantized(tmp_path / "q")
    assert all(isinstance(w, CpuInt4Weight) for w in list(weights.linears())[:-1])
    assert (weights.layers[0].down_proj.perm is not None) == act_order
    for name, w in tiny.tensors.items():  # the 4-bit weights are the model's, rounded
        if name in reference and name.endswith("_proj.weight"):
            # (GPTQ moves single weights far to make up for others: the whole matrix is close)
            assert (reference[name] - w.float()).norm() < 0.3 * w.float().norm()


def test_gptq_directory_has_a_lower_output_error_than_rtns_on_the_calibration_text(tiny, tmp_path):
    # The whole command: the last layer's output on the calibration windows is closer to the
    # 16-bit model's from GPTQ's directory than from RTN's (same bits, group, no clipping).
    errors = {}
    windows = calibration_windows(tiny, TEXT, QuantizeConfig(window=64))
    with torch.inference_mode():
        model = ReferenceLlama(tiny.arch, tiny.tensors, 64)
        want = model.embed(windows)
        for n in range(tiny.arch.num_layers):
            want = model.layer(n, want)
        for method in ("rtn", "gptq"):
            config = QuantizeConfig(method=method, group_size=32, window=64, scale_search="none")
            quantize_checkpoint(tiny, config, TEXT, tmp_path / method)
            _, _, reference = _served_logits_match_the_dequantized(tmp_path / method)
            quantized = ReferenceLlama(tiny.arch, reference, 64)
            got = quantized.embed(windows)
            for n in range(tiny.arch.num_layers):
                got = quantized.layer(n, got)
            errors[method] = float(((got - want) ** 2).sum())
    assert errors["gptq"] < 0.8 * errors["rtn"]


def test_gptq_refuses_bad_requests_naming_what_does_not_fit(tiny, tmp_path):
    def refused(match: str, text: str = TEXT, **fields) -> None:
        with pytest.raises(QuantFormatError, match=match):
            quantize_checkpoint(tiny, QuantizeConfig(method="gptq", window=64, **fields), text,
                                tmp_path / "x")  # fmt: skip
        assert not (tmp_path / "x").exists()

    refused("q_proj: K = 64 is not a multiple of the group size 128", group_size=128)
    refused("method gptq needs calibration text", text="", group_size=32)
    refused("--act-order needs a layout that records it", group_size=32, act_order=True)
    refused(r"--gptq-damp 0.0: a fraction in \(0, 1\]", group_size=32, gptq_damp=0.0)
    refused("scale search kl is per layer", group_size=32, scale_search="kl")
    with pytest.raises(QuantFormatError, match="--act-order is GPTQ's"):
        quantize_checkpoint(tiny, QuantizeConfig(group_size=32, act_order=True, format="gptq"),
                            TEXT, tmp_path / "y")  # fmt: skip
    with pytest.raises(QuantFormatError, match="w: K = 96 is not a multiple"):
        gptq_quantize(torch.randn(8, 96), torch.eye(96), 64, _rtn(64), name="w")


def _quantize_command(tmp_path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sitsd", "quantize", "--model", str(tmp_path / "src"), *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_command_runs_gptq_with_a_bar_per_layer_and_refuses_bad_input_in_one_line(
    tiny, tmp_path
):
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(TEXT)
    done = _quantize_command(tmp_path, "--method", "gptq", "--group-size", "32", "--calibration",
                             str(calibration), "--act-order", "--format", "gptq", "--gptq-damp",
                             "0.05", "--out", str(tmp_path / "out"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "gptq int4 g32 (gptq layout)" in done.stdout
    assert "2/2" in done.stderr  # the bar, per layer
    how = json.loads((tmp_path / "out" / "quantize.json").read_text())
    assert (how["method"], how["act_order"], how["gptq_damp"]) == ("gptq", True, 0.05)
    assert load_version(tmp_path / "out").checkpoint.quant.scheme.act_order
    missing = tmp_path / "no-such-calibration.txt"
    for flags, message in [
        (("--group-size", "128", "--calibration", str(calibration)),
         "model.layers.0.self_attn.q_proj: K = 64 is not a multiple of the group size 128"),
        (("--group-size", "32", "--calibration", str(missing)),
         f"--calibration {missing}: No such file or directory"),
    ]:  # fmt: skip
        bad = _quantize_command(tmp_path, "--method", "gptq", *flags, "--out", str(tmp_path / "b"))
        assert bad.returncode == 1
        assert bad.stderr.strip().splitlines() == [f"sitsd quantize: {message}"]
        assert not (tmp_path / "b").exists()
