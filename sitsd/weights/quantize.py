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
               sum_k E[x_k^2] (w_k - q_k)^2 over a grid (`none`: the full range; `kl`: one
               clipping per layer, `sitsd.weights.kl_search`)
    gptq       (`--method gptq`, instead of the RTN step) each module in the order the layer
               runs them, on the inputs the modules quantized before it give (q/k/v, then o,
               then gate/up, then down): the Hessian of its output error from those inputs, and
               GPTQ's column-by-column rounding with error feedback (`sitsd.weights.gptq`),
               each group's grid from the `mse` or `none` search; act-order optional (with
               `g_idx` in the gptq format; static groups in compressed-tensors, whose current
               library has no `g_idx`)
    write      a Hugging Face directory in the format asked for (`sitsd.quant.export`: AutoAWQ's
               GEMM layout, GPTQ's, or compressed-tensors' pack-quantized): config.json with
               its quantization_config (modules the map keeps 16-bit named in it), the
               tokenizer, model.safetensors, manifest.json

The result is what `sitsctl deploy` and the watched directory take, and other engines read.
A progress callback hears of each layer (the command draws a bar).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from sitsd.quant.errors import QuantFormatError
from sitsd.quant.export import FORMATS, export_modules
from sitsd.quant.precision import PrecisionMap
from sitsd.quant.rtn import Int4Codes, quantize_int4
from sitsd.weights.awq_scales import fold_layer_scales
from sitsd.weights.checkpoint import Checkpoint
from sitsd.weights.export import write_version
from sitsd.weights.gptq import gptq_quantize, hessian
from sitsd.weights.kl_search import choose_clip, reference_logprobs
from sitsd.weights.manifest import Manifest, write_manifest
from sitsd.weights.reference_llama import LayerInputs, Linear, ReferenceLlama

METHODS = ("rtn", "awq", "gptq")
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
    format: str = "awq"  # the directory's layout, one of `sitsd.quant.export.FORMATS`
    act_order: bool = False  # gptq: columns by decreasing input energy (gptq: with g_idx)
    gptq_damp: float = 0.01  # gptq: the Hessian's damping, a fraction of its mean diagonal


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
        raise QuantFormatError(f"{name}: sitsd quantize writes int4 and 16-bit weights, not "
                               f"{chosen}")  # fmt: skip
    if chosen.symmetric:
        raise QuantFormatError(f"{name}: sitsd quantize writes int4 with zero points, not "
                               f"{chosen} (symmetric INT4 is `sitsd serve --quantize`'s, "
                               "RTN at load)")  # fmt: skip
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
        elif group != config.group_size:  # a format's config holds one group size
            raise QuantFormatError(f"{module}: the map asks for groups of {group}, "
                                   f"--group-size is {config.group_size}")  # fmt: skip
        else:
            plan.append(module)
    return plan


def _check_config(config: QuantizeConfig, calibrated: bool) -> None:
    """Raise `QuantFormatError` naming the flag when `config` asks for what cannot be done."""
    if config.method not in METHODS:
        raise QuantFormatError(f"method {config.method!r}: sitsd quantize runs {METHODS}")
    if config.bits != 4:
        raise QuantFormatError(f"bits {config.bits}: only 4-bit weights are written")
    if config.format not in FORMATS:
        raise QuantFormatError(f"format {config.format!r}: sitsd quantize writes {FORMATS}")
    if not calibrated and config.method in ("awq", "gptq"):
        raise QuantFormatError(f"method {config.method} needs calibration text (--calibration)")
    if not calibrated and config.scale_search == "kl":
        raise QuantFormatError("scale search kl needs calibration text (--calibration)")
    if config.method == "gptq" and config.scale_search == "kl":
        raise QuantFormatError("scale search kl is per layer: method gptq searches each "
                               "group's grid by mse or none")  # fmt: skip
    if config.act_order and config.method != "gptq":
        raise QuantFormatError("--act-order is GPTQ's column order: it needs --method gptq")
    if config.act_order and config.format == "awq":
        raise QuantFormatError("--act-order needs a layout that records it: --format gptq "
                               "(g_idx) or compressed-tensors (actorder: weight)")  # fmt: skip
    if config.method == "gptq" and not 0 < config.gptq_damp <= 1:
        raise QuantFormatError(f"--gptq-damp {config.gptq_damp}: a fraction in (0, 1]")


def check_request(ckpt: Checkpoint, config: QuantizeConfig, calibrated: bool) -> None:
    """Raise `QuantFormatError` for what `quantize_checkpoint` would refuse, before any work:
    the flags, the precision map, a group size that does not divide a module's inputs."""
    _check_config(config, calibrated)
    arch = ckpt.arch
    inputs = {"self_attn.o_proj": arch.num_heads * arch.head_dim,
              "mlp.down_proj": arch.intermediate_size}  # fmt: skip
    for module in _layer_plan(config, 0, []):
        k = inputs.get(module.split(".", 3)[3], arch.hidden_size)
        if k % config.group_size:
            raise QuantFormatError(f"{module}: K = {k} is not a multiple of the group size "
                                   f"{config.group_size}")  # fmt: skip


def _with_weights(model: ReferenceLlama, weights: Mapping[str, torch.Tensor]) -> Linear:
    """The linear modules of `model`, those in `weights` (module -> W) computed with those."""

    def linear(module: str, x: torch.Tensor) -> torch.Tensor:
        w = weights.get(module)
        if w is None:
            return model.dense(module, x)
        bias = model.tensors.get(f"{module}.bias")
        return x @ w.T if bias is None else x @ w.T + bias.float()

    return linear


def _rtn_layer(
    model: ReferenceLlama,
    tensors: dict[str, torch.Tensor],
    n: int,
    h: torch.Tensor | None,  # [B, T, hidden]: layer n's input, the layers before it quantized
    plan: list[str],
    config: QuantizeConfig,
    reference: torch.Tensor | None,  # the 16-bit model's log-probabilities (the KL search)
) -> tuple[dict[str, Int4Codes], torch.Tensor | None]:
    """Layer `n`'s RTN codes (AWQ's scales folded into `tensors` first), and its output."""
    inputs = LayerInputs(keep=_AWQ_SAMPLES if config.method == "awq" else 0)
    if h is not None:  # the inputs the quantized layers before this one give
        model.layer(n, h, on_input=inputs)
    if config.method == "awq":
        assert h is not None  # awq needs calibration windows (checked)
        fold_layer_scales(tensors, model.arch, n, inputs.samples, config.group_size, set(plan))
        inputs = LayerInputs()
        model.layer(n, h, on_input=inputs)  # the scaled inputs' energy

    def quantize_at(clip: float | None) -> dict[str, Int4Codes]:
        return {m: quantize_module(model.weight(f"{m}.weight"), config.group_size,
                                   inputs.mean_square.get(m), config.scale_search, m,
                                   clip=clip) for m in plan}  # fmt: skip

    def dequantized_at(clip: float) -> dict[str, torch.Tensor]:
        return {m: q.dequantize() for m, q in quantize_at(clip).items()}

    clip = None
    if reference is not None and h is not None:
        clip = choose_clip(model, n, h[:1], reference, dequantized_at)
    codes = quantize_at(clip)
    if h is not None:
        dense = {m: q.dequantize() for m, q in codes.items()}
        h = model.layer(n, h, linear=_with_weights(model, dense))
    return codes, h


def _gptq_layer(
    model: ReferenceLlama,
    n: int,
    h: torch.Tensor,  # [B, T, hidden]: layer n's input, the layers before it quantized
    plan: list[str],
    config: QuantizeConfig,
) -> tuple[dict[str, Int4Codes], torch.Tensor]:
    """Layer `n` run once, each planned module GPTQ-quantized on the inputs it is given (the
    outputs of the modules quantized before it) before it computes; its codes and output."""
    codes: dict[str, Int4Codes] = {}
    dense: dict[str, torch.Tensor] = {}
    apply = _with_weights(model, dense)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, its Hessian): q/k/v share one

    def linear(module: str, x: torch.Tensor) -> torch.Tensor:
        if module in plan and module not in codes:
            if not seen or seen[-1][0] is not x:
                seen[:] = [(x, hessian(x))]

            def grid(w: torch.Tensor, energy: torch.Tensor) -> Int4Codes:
                return quantize_module(w, config.group_size, energy, config.scale_search, module)

            codes[module] = gptq_quantize(
                model.weight(f"{module}.weight"), seen[-1][1], config.group_size, grid,
                damp=config.gptq_damp, act_order=config.act_order,
                static_groups=config.format == "compressed-tensors", name=module,
            )  # fmt: skip
            dense[module] = codes[module].dequantize()
        return apply(module, x)

    return codes, model.layer(n, h, linear=linear)


def quantize_checkpoint(
    ckpt: Checkpoint,
    config: QuantizeConfig,
    calibration_text: str,
    out: Path,
    on_layer: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Quantize `ckpt` (dense tensors) as `config` says and write the version to `out`.

    Raises:
        QuantFormatError: a method, bit width, format or group size not supported, a flag the
            method does not take, missing calibration text, or a map that does not fit.
    """
    windows = calibration_windows(ckpt, calibration_text, config) if calibration_text else None
    check_request(ckpt, config, windows is not None)
    arch = ckpt.arch
    tensors = dict(ckpt.tensors)  # AWQ folds its scales into some of them
    model = ReferenceLlama(arch, tensors, config.window if windows is None
                           else windows.shape[1])  # fmt: skip
    quantized: dict[str, Int4Codes] = {}
    kept: list[str] = []
    with torch.inference_mode():
        reference = None
        if config.scale_search == "kl" and windows is not None:
            reference = reference_logprobs(model, windows[:1])
        h = None if windows is None else model.embed(windows)
        for n in range(arch.num_layers):
            plan = _layer_plan(config, n, kept)
            if config.method == "gptq":
                assert h is not None  # gptq needs calibration windows (checked)
                codes, h = _gptq_layer(model, n, h, plan, config)
            else:
                codes, h = _rtn_layer(model, tensors, n, h, plan, config, reference)
            quantized |= codes
            if on_layer is not None:
                on_layer(n + 1, arch.num_layers)
    calibration_tokens = 0 if windows is None else int(windows.numel())
    return _write(ckpt, config, tensors, quantized, sorted(kept), out, calibration_tokens)


def _write(
    ckpt: Checkpoint,
    config: QuantizeConfig,
    tensors: Mapping[str, torch.Tensor],
    quantized: Mapping[str, Int4Codes],
    kept: list[str],
    out: Path,
    calibration_tokens: int,
) -> Manifest:
    """The version directory: the quantized modules in `config.format`, every other tensor
    16-bit, config.json's quantization_config, quantize.json (how), manifest.json last."""
    written, quantization_config = export_modules(
        config.format, quantized, kept, act_order=config.act_order, damp=config.gptq_damp
    )
    for name, tensor in tensors.items():
        if name.rsplit(".", 1)[0] not in quantized:
            written[name] = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
    write_version(ckpt, out, written)
    config_path = out / "config.json"
    hf = json.loads(config_path.read_text())
    hf["torch_dtype"] = "float16"
    hf["quantization_config"] = quantization_config
    config_path.write_text(json.dumps(hf, indent=2))
    how: dict[str, object] = {
        "method": config.method, "bits": config.bits, "group_size": config.group_size,
        "format": config.format, "scale_search": config.scale_search,
        "precision_map": config.precision.source if config.precision else "",
        "calibration_tokens": calibration_tokens,
    }  # fmt: skip
    if config.method == "gptq":
        how |= {"act_order": config.act_order, "gptq_damp": config.gptq_damp}
    (out / "quantize.json").write_text(json.dumps(how, indent=2))
    return write_manifest(out)
