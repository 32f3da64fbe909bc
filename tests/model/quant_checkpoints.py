"""Tiny quantized checkpoints written the way each format's producer writes them, and the same
model with the dequantized weights, for the model and hot-swap tests.

`write_quantized_llama(dir, fmt)` writes a tiny random Llama (`tests.weights.tiny_models`) as a
Hugging Face directory whose linear layers (not the lm_head) are AWQ (AutoAWQ's GEMM packing),
GPTQ (AutoGPTQ's packing, `sym` true or false, act-order with a shuffled `g_idx`),
compressed-tensors `pack-quantized` (symmetric or not) or FP8 (per channel or per tensor), with
the `quantization_config` each producer writes; it returns the HF-named float32 state dict with
every quantized weight replaced by its exact dequantization (what the tests compare with).
The packers are the producers' own loops (`tests.quant.format_code`); the codes come from
round-to-nearest (`sitsd.quant.rtn`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from sitsd.kernels.quant_layout import pack_int4
from sitsd.quant.rtn import quantize_fp8, quantize_int4
from tests.quant.format_code import awq_pack, gptq_pack
from tests.weights.tiny_models import write_tiny_llama

FORMATS = ("awq", "gptq", "gptq-sym-act-order", "ct", "ct-sym", "fp8", "fp8-tensor")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in _LINEARS


def _config(fmt: str, group: int, skip: tuple[str, ...]) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": list(skip)}  # fmt: skip
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group,
                "desc_act": fmt.endswith("act-order"), "sym": "sym" in fmt,
                "checkpoint_format": "gptq"}  # fmt: skip
    if fmt.startswith("ct"):
        weights = {"num_bits": 4, "type": "int", "symmetric": fmt == "ct-sym",
                   "strategy": "group", "group_size": group}  # fmt: skip
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                "ignore": ["lm_head", *skip]}  # fmt: skip
    return {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _module_tensors(
    fmt: str, w: torch.Tensor, group: int, perm: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The module's tensors in `fmt` (suffix -> tensor) and its dequantized W (float32);
    `perm` is the act-order of its input channels (GPTQ's, from the Hessian of the layer's
    input: modules that share an input, q/k/v and gate/up, share it)."""
    n, k = w.shape
    if fmt == "fp8-tensor":  # one scale for the whole tensor
        one = w.abs().max() / 448
        codes = (w / one).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale": one.reshape(1)}, codes.float() * one
    if fmt == "fp8":  # one scale per output row, stored [N, 1]
        q = quantize_fp8(w)
        return {"weight": q.weight, "weight_scale": q.scale[:, None]}, q.dequantize()
    c = quantize_int4(w[:, perm], group, symmetric="sym" in fmt)
    codes = torch.empty_like(c.codes)
    codes[:, perm] = c.codes  # [N, K] in the input order
    deq = torch.empty(n, k)
    deq[:, perm] = c.dequantize()
    zeros = c.zeros if c.zeros is not None else torch.full_like(c.scales, 8, dtype=torch.uint8)
    if fmt == "awq":
        qweight, qzeros = awq_pack(codes.T.contiguous(), zeros)
        return {"qweight": qweight, "qzeros": qzeros, "scales": c.scales}, deq
    if fmt.startswith("gptq"):
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        qweight, qzeros = gptq_pack(codes.T.contiguous(), zeros.to(torch.int32), minus_one=True)
        return {"qweight": qweight, "qzeros": qzeros, "scales": c.scales, "g_idx": g_idx}, deq
    tensors = {"weight_packed": pack_int4(codes), "weight_scale": c.scales.T.contiguous(),
               "weight_shape": torch.tensor([n, k])}  # fmt: skip
    if fmt == "ct":
        tensors["weight_zero_point"] = pack_int4(zeros).T.contiguous()  # [N / 8, G]
    return tensors, deq


def write_quantized_llama(
    directory: Path,
    fmt: str,
    *,
    group_size: int = 32,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    skip: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Write the tiny Llama quantized in `fmt` (one of FORMATS) to `directory`; modules whose
    name contains one of `skip` stay 16-bit (and the config says so). Returns the float32
    state dict with the quantized weights dequantized."""
    write_tiny_llama(directory, seed=seed, tie_word_embeddings=tie_word_embeddings)
    path = directory / "model.safetensors"
    from safetensors.torch import load_file

    dense = load_file(path)
    if tie_word_embeddings:
        dense.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    perms: dict[tuple[str, int], torch.Tensor] = {}  # (layer prefix, K) -> act-order
    for name, tensor in dense.items():
        module = name.removesuffix(".weight")
        if not _is_linear(name) or any(s in module for s in skip):
            out[name] = tensor.half() if tensor.dim() == 2 else tensor
            reference[name] = out[name].float()
            continue
        k = tensor.shape[1]
        shared = (module.rsplit(".", 2)[0] + ("o" if "o_proj" in module else ""), k)
        if shared not in perms:
            perms[shared] = torch.randperm(k) if fmt.endswith("act-order") else torch.arange(k)
        tensors, deq = _module_tensors(fmt, tensor.float(), group_size, perms[shared])
        out |= {f"{module}.{suffix}": t for suffix, t in tensors.items()}
        reference[name] = deq
    path.unlink()
    save_file(out, str(path))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = _config(fmt, group_size, skip)
    (directory / "config.json").write_text(json.dumps(config))
    return reference
