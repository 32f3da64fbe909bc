"""`sitsd quantize`: a 16-bit checkpoint -> a deployable 4-bit version directory.

    load       the source (any checkpoint sitsd reads; quantized tensors dequantized)
    calibrate  token windows of the calibration text (if any) through the model, layer by layer
               (`sitsd.weights.reference_llama`): each layer's linear modules see the inputs
               the already quantized layers before it produce
    awq        (`--method awq`) activation-aware scales per input channel, searched on the
               calibration inputs and folded into the norms and modules before
               (`sitsd.weights.awq_scales`)
    quantize   every linear module the precision map sends to int4 (all of them, by default),
               RTN per group of `group_size` inputs; the scale search (`mse`) picks, per row
               and group, the clipping of the range that minimises the output error
               sum_k E[x_k^2] (w_k - q_k)^2 over a grid (`none`: the full range)
    write      a Hugging Face directory in AutoAWQ's GEMM layout (`sitsd.quant.export`):
               config.json with its quantization_config (modules the map keeps 16-bit under
               modules_to_not_convert), the tokenizer, model.safetensors, manifest.json

The result is what `sitsctl deploy` and the watched directory take, and other engines read.
A progress callback hears of each layer (the command draws a bar).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sitsd.quant.errors import QuantFormatError
from sitsd.quant.export import awq_config, awq_module
from sitsd.quant.precision import PrecisionMap
from sitsd.quant.rtn import Int4Codes, quantize_int4
from sitsd.weights.awq_scales import fold_layer_scales
from sitsd.weights.checkpoint import Checkpoint
from sitsd.weights.export import write_version
from sitsd.weights.kl_search import choose_clip, reference_logprobs
from sitsd.weights.manifest import Manifest, write_manifest
from sitsd.weights.reference_llama import LayerInputs, ReferenceLlama

METHODS = ("rtn", "awq")
SCALE_SEARCHES = ("mse", "kl", "none")
_AWQ_SAMPLES = 512  # calibration tokens AWQ's scale search fits on
_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # fractions of each group's range tried
LINEAR_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


@dataclass(frozen=True)
class QuantizeConfig:
    """What `sitsd quantize` was asked for."""

    method: str = "rtn"  # one of METHODS
    bits: int = 4  # only 4
    group_size: int = 128  # inputs per scale: 32, 64 or 128
    scale_search: str = "mse"  # one of SCALE_SEARCHES
    precision: PrecisionMap | None = None  # None: every linear module but the lm_head in int4
    calibration_tokens: int = 4096  # of the calibration text, at most
    window: int = 512  # tokens per calibration window


def calibration_windows(ckpt: Checkpoint, text: str, config: QuantizeConfig) -> torch.Tensor:
    """`[B, window]` token ids of `text` (the last partial window dropped; at least one)."""
    ids = ckpt.tokenizer.encode(text, add_special_tokens=False)[: config.calibration_tokens]
    window = min(config.window, len(ids))
    if window < 2:
        raise QuantFormatError("the calibration text holds fewer than 2 tokens")
    rows = len(ids) // window
    return torch.tensor(ids[: rows * window]).reshape(rows, window)


def quantize_module(
    w: torch.Tensor,
    group_size: int,
    mean_square: torch.Tensor | None,
    search: str,
    name: str,
    *,
    clip: float | None = None,
) -> Int4Codes:
    """RTN codes of `w` `[N, K]`: with `clip` (the KL search's), every group's range clipped
    by it; else (`mse`) the clipping per row and group that minimises the output error
    weighted by the inputs' `mean_square` `[K]` (uniform when None); `none`: the full range."""
    n, k = w.shape
    if clip is not None:
        return quantize_int4(w, group_size, clip=torch.tensor(clip), name=name)
    if search != "mse" or k % group_size:  # quantize_int4 names what does not fit
        return quantize_int4(w, group_size, name=name)
    weight = torch.ones(k) if mean_square is None else mean_square.float()
    weight = weight.reshape(1, k // group_size, group_size)
    wf = w.float()
    best_err, best_clip = None, torch.ones(n, k // group_size)
    for clip in _CLIPS:
        codes = quantize_int4(wf, group_size, clip=torch.tensor(clip), name=name)
        err = (codes.dequantize() - wf).reshape(n, k // group_size, group_size) ** 2 * weight
        err = err.sum(-1)  # [N, G]
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_clip = torch.where(better, torch.tensor(clip), best_clip)
    return quantize_int4(wf, group_size, clip=best_clip, name=name)


def _int4_group(precision: PrecisionMap | None, name: str, default: int) -> int | None:
    """The group size the map gives `name`'s weight, None to keep it 16-bit."""
    if precision is None:
        return default
    chosen = precision.precision_for(name)
    if chosen is None or not chosen.quantized:
        return None
    if chosen.kind != "int4":
        raise QuantFormatError(f"{name}: the AWQ layout holds int4 and 16-bit weights, not "
                               f"{chosen}")  # fmt: skip
    return chosen.group_size


def _layer_plan(config: QuantizeConfig, n: int, kept: list[str]) -> list[str]:
    """Layer `n`'s modules that become int4; the others are appended to `kept`.

    Raises:
        QuantFormatError: the map asks for another group size than `config.group_size`.
    """
    plan = []
    for suffix in LINEAR_MODULES:
        module = f"model.layers.{n}.{suffix}"
        group = _int4_group(config.precision, f"{module}.weight", config.group_size)
        if group is None:
            kept.append(module)
        elif group != config.group_size:  # AWQ's config holds one group size
            raise QuantFormatError(f"{module}: the map asks for groups of {group}, "
                                   f"--group-size is {config.group_size}")  # fmt: skip
        else:
            plan.append(module)
    return plan


def quantize_checkpoint(
    ckpt: Checkpoint,
    config: QuantizeConfig,
    calibration_text: str,
    out: Path,
    on_layer: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Quantize `ckpt` (dense tensors) as `config` says and write the version to `out`.

    Raises:
        QuantFormatError: a method, bit width or group size not supported, or a map that does
            not fit the layout.
    """
    if config.method not in METHODS:
        raise QuantFormatError(f"method {config.method!r}: sitsd quantize runs {METHODS}")
    if config.bits != 4:
        raise QuantFormatError(f"bits {config.bits}: only 4-bit weights are written")
    arch = ckpt.arch
    calibrated = bool(calibration_text)
    windows = calibration_windows(ckpt, calibration_text, config) if calibrated else None
    if windows is None and (config.method == "awq" or config.scale_search == "kl"):
        raise QuantFormatError(f"{'method awq' if config.method == 'awq' else 'scale search kl'}"
                               " needs calibration text (--calibration)")  # fmt: skip
    tensors = dict(ckpt.tensors)  # AWQ folds its scales into some of them
    model = ReferenceLlama(arch, tensors, config.window if windows is None
                           else windows.shape[1])  # fmt: skip
    written: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    dequantized: dict[str, torch.Tensor] = {}  # what the later layers compute with

    def linear(module: str, x: torch.Tensor) -> torch.Tensor:
        w = dequantized.get(module)
        return model.dense(module, x) if w is None else x @ w.T

    reference = None  # the 16-bit model's log-probabilities (the KL search)
    with torch.inference_mode():
        h = None if windows is None else model.embed(windows)
        for n in range(arch.num_layers):
            inputs = LayerInputs(keep=_AWQ_SAMPLES if config.method == "awq" else 0)
            if h is not None:  # the inputs the quantized layers before this one give
                model.layer(n, h, on_input=inputs)
            if config.method == "awq":
                assert h is not None  # awq needs calibration windows (checked above)
                mine = {f"model.layers.{n}.{x}" for x in LINEAR_MODULES}
                quantized = {m for m in mine if _int4_group(config.precision, f"{m}.weight",
                                                            config.group_size)}  # fmt: skip
                fold_layer_scales(tensors, arch, n, inputs.samples, config.group_size, quantized)
                inputs = LayerInputs()
                model.layer(n, h, on_input=inputs)  # the scaled inputs' energy
            plan = _layer_plan(config, n, kept)

            def quantize_at(
                clip: float | None, plan: list[str] = plan, inputs: LayerInputs = inputs
            ) -> dict[str, Int4Codes]:
                return {m: quantize_module(model.weight(f"{m}.weight"), config.group_size,
                                           inputs.mean_square.get(m), config.scale_search, m,
                                           clip=clip) for m in plan}  # fmt: skip

            clip = None
            if config.scale_search == "kl" and h is not None and windows is not None:
                if reference is None:
                    reference = reference_logprobs(model, windows[:1])
                clip = choose_clip(model, n, h[:1], reference, lambda c: {
                    m: q.dequantize() for m, q in quantize_at(c).items()})  # fmt: skip
            for module, codes in quantize_at(clip).items():
                written |= {f"{module}.{s}": t for s, t in awq_module(codes).items()}
                dequantized[module] = codes.dequantize()
            if h is not None:
                h = model.layer(n, h, linear=linear)
            if on_layer is not None:
                on_layer(n + 1, arch.num_layers)
    for name, tensor in tensors.items():
        module = name.rsplit(".", 1)[0]
        if module not in dequantized:
            written[name] = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
    write_version(ckpt, out, written)
    config_path = out / "config.json"
    hf = json.loads(config_path.read_text())
    hf["torch_dtype"] = "float16"
    hf["quantization_config"] = awq_config(config.group_size, sorted(kept))
    config_path.write_text(json.dumps(hf, indent=2))
    (out / "quantize.json").write_text(json.dumps({
        "method": config.method, "bits": config.bits, "group_size": config.group_size,
        "scale_search": config.scale_search,
        "precision_map": config.precision.source if config.precision else "",
        "calibration_tokens": 0 if windows is None else int(windows.numel()),
    }, indent=2))  # fmt: skip
    return write_manifest(out)
