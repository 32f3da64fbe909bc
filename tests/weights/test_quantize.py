"""`sitsd quantize` on the tiny Llama: the AWQ directory it writes verifies as a version (manifest
and all), serves in its own bits with the logits of its dequantized weights, keeps the modules
the precision map keeps 16-bit; the AWQ packing round-trips the codes exactly; the scale search
lowers the output error; bad requests are refused naming what does not fit."""

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
from sitsd.quant.export import awq_module
from sitsd.quant.from_awq import int4_from_awq
from sitsd.quant.precision import PrecisionMap
from sitsd.quant.rtn import quantize_int4
from sitsd.weights import kl_search, load_checkpoint
from sitsd.weights.awq_scales import fold_layer_scales, search_scales
from sitsd.weights.checks import load_version
from sitsd.weights.quantize import (
    LINEAR_MODULES,
    QuantizeConfig,
    quantize_checkpoint,
    quantize_module,
)
from sitsd.weights.reference_llama import LayerInputs, ReferenceLlama
from tests.kernels.helpers import assert_close
from tests.model.test_quantized_model import dequantized_logits, prompt_logits, random_prompt
from tests.weights.tiny_models import write_tiny_llama

QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales")
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 20


@pytest.fixture
def tiny(tmp_path):
    write_tiny_llama(tmp_path / "src", seed=random.randrange(1000))
    return load_checkpoint(tmp_path / "src")


def test_the_written_awq_directory_loads_back_with_its_codes_and_their_logits(tiny, tmp_path):
    keep = PrecisionMap.from_mapping({"*.o_proj.weight": "bf16", "*": "int4-g32"})
    config = QuantizeConfig(group_size=32, precision=keep, window=64)
    layers = []
    quantize_checkpoint(tiny, config, TEXT, tmp_path / "q", on_layer=lambda d, t: layers.append(d))
    assert layers == [1, 2]  # one progress call per layer
    loaded = load_version(tmp_path / "q")  # the manifest verifies: deployable
    ckpt = loaded.checkpoint
    hf = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert (hf["quant_method"], hf["bits"], hf["group_size"]) == ("awq", 4, 32)
    assert hf["modules_to_not_convert"] == [f"model.layers.{n}.self_attn.o_proj" for n in (0, 1)]
    assert "model.layers.0.self_attn.o_proj.weight" in ckpt.tensors  # kept 16-bit
    assert "model.layers.0.mlp.down_proj.qweight" in ckpt.tensors
    # Served in its own bits, it computes the logits of its dequantized weights.
    reference = {n: t.float() for n, t in ckpt.tensors.items() if not n.endswith(QUANT_SUFFIXES)}
    for name, w in tiny.tensors.items():
        module = name.removesuffix(".weight")
        if ckpt.quant.is_quantized(ckpt.tensors, module):
            layout = ckpt.quant.convert(ckpt.tensors, module, tuple(w.shape), torch.device("cpu"))
            reference[name] = layout.dequantize().float()
            assert (reference[name] - w.float()).abs().max() < 0.25 * w.abs().max()
    weights = build_weights(ckpt.arch, ckpt.tensors, "cpu", torch.float32, source=ckpt.quant)
    assert isinstance(weights.layers[0].down_proj, CpuInt4Weight)
    assert isinstance(weights.layers[0].o_proj, torch.Tensor)
    ids = random_prompt(ckpt.arch.vocab_size)
    got = prompt_logits(ckpt.arch, weights, ids)
    assert_close(got, dequantized_logits(ckpt.arch, reference, ids), torch.bfloat16)


def test_awq_packing_round_trips_the_codes_exactly():
    w = torch.randn(40, 192)
    for symmetric in (False, True):
        codes = quantize_int4(w, 64, symmetric=symmetric)
        t = awq_module(codes)
        back = int4_from_awq(t["qweight"], t["qzeros"], t["scales"], shape=(40, 192),
                             group_size=64, name="m")  # fmt: skip
        assert torch.equal(back.dequantize(), codes.dequantize())


def test_the_scale_search_lowers_the_weighted_output_error_of_rtn():
    w = torch.randn(48, 256) * torch.rand(1, 256) * 3
    w[:, random.randrange(256)] *= 20  # an outlier input channel
    energy = torch.rand(256) ** 4 * 10
    searched = quantize_module(w, 64, energy, "mse", "w")
    plain = quantize_int4(w, 64)

    def err(codes) -> float:
        return float((((codes.dequantize() - w) ** 2) * energy).sum())

    assert err(searched) < err(plain)
    assert quantize_module(w, 64, energy, "none", "w").codes.equal(plain.codes)


def test_bad_requests_are_refused_naming_what_does_not_fit(tiny, tmp_path):
    with pytest.raises(QuantFormatError, match="not a multiple of the group size 128"):
        quantize_checkpoint(tiny, QuantizeConfig(group_size=128), TEXT, tmp_path / "a")
    int8 = PrecisionMap.from_mapping({"*.mlp.*": "int8"})
    with pytest.raises(QuantFormatError, match=r"gate_proj.weight: sitsd quantize writes int4 and"):
        quantize_checkpoint(tiny, QuantizeConfig(group_size=32, precision=int8), TEXT,
                            tmp_path / "b")  # fmt: skip
    sym = PrecisionMap.from_mapping({"*.mlp.*": "int4-g32-sym"})
    with pytest.raises(QuantFormatError, match=r"gate_proj.weight: sitsd quantize writes int4 "
                       r"with zero points, not int4-g32-sym"):  # fmt: skip
        quantize_checkpoint(tiny, QuantizeConfig(group_size=32, precision=sym), TEXT,
                            tmp_path / "s")  # fmt: skip
    with pytest.raises(QuantFormatError, match="method 'hqq'"):
        quantize_checkpoint(tiny, QuantizeConfig(method="hqq"), TEXT, tmp_path / "c")
    with pytest.raises(QuantFormatError, match="format 'exl2'"):
        quantize_checkpoint(tiny, QuantizeConfig(group_size=32, format="exl2"), TEXT,
                            tmp_path / "d")  # fmt: skip


def test_the_command_writes_a_version_and_says_so(tiny, tmp_path):
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(TEXT)
    done = subprocess.run(
        [sys.executable, "-m", "sitsd", "quantize", "--model", str(tmp_path / "src"),
         "--method", "rtn", "--bits", "4", "--group-size", "32", "--calibration",
         str(calibration), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rtn int4 g32 (awq layout)" in done.stdout
    assert "2/2" in done.stderr  # the bar, per layer
    assert load_version(tmp_path / "out").checkpoint.quant is not None
    bad = subprocess.run(
        [sys.executable, "-m", "sitsd", "quantize", "--model", str(tmp_path / "src"),
         "--group-size", "128", "--out", str(tmp_path / "bad")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 1
    assert "not a multiple of the group size 128" in bad.stderr


def test_awq_scales_folded_into_a_layer_leave_its_16_bit_outputs_unchanged(tiny):
    tensors = {n: t.float() for n, t in tiny.tensors.items()}
    model = ReferenceLlama(tiny.arch, tensors, 64)
    ids = torch.tensor([tiny.tokenizer.encode(TEXT, add_special_tokens=False)[:48]])
    with torch.inference_mode():
        h = model.embed(ids)
        inputs = LayerInputs(keep=48)
        want = model.layer(0, h, on_input=inputs)
        every = {f"model.layers.0.{m}" for m in LINEAR_MODULES}
        # A few loud input channels in the samples the search sees, so that every group's
        # scales are far from 1 (on a random model's own inputs they may all be 1: alpha 0)
        loud = {m: x * (torch.rand(x.shape[-1]) ** 3 * 8 + 0.1) for m, x in inputs.samples.items()}
        fold_layer_scales(tensors, tiny.arch, 0, loud, 32, every)
        got = model.layer(0, h)
    changed = [n for n in tensors if not torch.equal(tensors[n], tiny.tensors[n].float())]
    assert "model.layers.0.input_layernorm.weight" in changed  # the scales went somewhere
    assert "model.layers.0.mlp.up_proj.weight" in changed
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_awq_scales_never_raise_the_output_error_of_rtn_on_their_samples():
    k = 128
    x = torch.randn(200, k) * (torch.rand(k) ** 3 * 8)  # a few loud input channels
    ws = [torch.randn(64, k), torch.randn(32, k)]
    s = search_scales(x, ws, 32)
    plain = sum(float(((x @ (w - quantize_int4(w, 32).dequantize()).T) ** 2).sum()) for w in ws)
    scaled = sum(
        float(((x @ (w - quantize_int4(w * s, 32).dequantize() / s).T) ** 2).sum()) for w in ws
    )
    assert scaled <= plain
    assert not torch.allclose(s, torch.ones_like(s))  # loud channels: alpha 0 did not win


def test_method_awq_writes_a_version_that_serves_in_its_own_bits(tiny, tmp_path):
    config = QuantizeConfig(method="awq", group_size=32, window=64)
    quantize_checkpoint(tiny, config, TEXT, tmp_path / "awq")
    ckpt = load_version(tmp_path / "awq").checkpoint
    weights = build_weights(ckpt.arch, ckpt.tensors, "cpu", torch.float32, source=ckpt.quant)
    assert all(isinstance(w, CpuInt4Weight) for w in list(weights.linears())[:-1])
    ids = random_prompt(ckpt.arch.vocab_size)
    assert torch.isfinite(prompt_logits(ckpt.arch, weights, ids)).all()
    with pytest.raises(QuantFormatError, match="awq needs calibration"):
        quantize_checkpoint(tiny, config, "", tmp_path / "none")


def test_the_kl_search_keeps_the_clipping_closest_to_the_16_bit_distributions(tiny, tmp_path):
    model = ReferenceLlama(tiny.arch, tiny.tensors, 64)
    ids = torch.tensor([tiny.tokenizer.encode(TEXT, add_special_tokens=False)[:64]])
    modules = [f"model.layers.1.{m}" for m in LINEAR_MODULES]

    def quantize_at(clip: float) -> dict[str, torch.Tensor]:
        return {m: quantize_module(model.weight(f"{m}.weight"), 32, None, "kl", m, clip=clip)
                .dequantize() for m in modules}  # fmt: skip

    with torch.inference_mode():
        reference = kl_search.reference_logprobs(model, ids)
        h = model.layer(0, model.embed(ids))
        chosen = kl_search.choose_clip(model, 1, h, reference, quantize_at)
        kls = {}
        for clip in kl_search.CLIPS:
            trial = quantize_at(clip)
            x = model.layer(1, h, linear=lambda m, x, t=trial: x @ t[m].T)
            logprobs = model.logits(x).log_softmax(-1)
            kls[clip] = float((reference.exp() * (reference - logprobs)).sum(-1).mean())
    assert chosen == min(kls, key=kls.get)
    assert len(set(kls.values())) > 1  # the clippings differ
    config = QuantizeConfig(group_size=32, scale_search="kl", window=64)
    quantize_checkpoint(tiny, config, TEXT, tmp_path / "kl")
    assert load_version(tmp_path / "kl").checkpoint.quant is not None
    with pytest.raises(QuantFormatError, match="scale search kl needs calibration"):
        quantize_checkpoint(tiny, config, "", tmp_path / "none")
