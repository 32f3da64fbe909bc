"""The model's weights as data: which tensors a Llama holds, and how a checkpoint becomes them.

`LlamaWeights` (one weight slot) holds the embedding, the norms and, per layer, four linear
weights (q/k/v fused, o, gate/up fused, down) plus the lm_head; a linear weight is a dense tensor
or a quantized layout (`sitsd.quant.linear.LinearWeight`). `_layer_tensors` spells the Hugging
Face names once. From a checkpoint's tensors (and its `QuantSource`: what it stores quantized)
and a `ServingFormat` (device, dtype, precision map), `build_weights` makes a slot and
`build_field` one field of it, the same way, so staging builds exactly what start-up built:

    a quantized module          converted on the device (`QuantSource.convert`), or
                                dequantized to the serving dtype with `dequantize`
    a dense module the map      RTN-quantized on the device (`sitsd.quant.rtn`), or cast to
    names                       the 16-bit dtype it names
    any other dense tensor      cast to the serving dtype; on a CPU serving quantized layers,
                                the embedding and the lm_head in bfloat16 (the float32 lm_head
                                is most of a CPU decode step there)

then q/k/v and gate/up fused and each quantized layout put in its device's form
(`to_serving_layout`). Dense values must be finite in their dtype; quantized ones are checked
by their format's converter. `weight_copy_plan` says where each checkpoint tensor goes in a
slot whose fields are dense (copied in place, chunk by chunk); `slot_fields` lists every field
for the copies that rebuild one.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from sitsd.model.arch import LlamaArch
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import QuantizedWeight, concat_rows
from sitsd.quant.linear import (
    LinearWeight,
    empty_weight_like,
    precision_of,
    to_serving_layout,
    weight_nbytes,
    weight_tensors,
)
from sitsd.quant.precision import PrecisionMap
from sitsd.quant.rtn import quantize_fp8, quantize_int4_as, quantize_int8
from sitsd.quant.source import QuantSource


class WeightsError(ValueError):
    """Checkpoint tensors that do not fit the architecture (names, shapes, values)."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: LinearWeight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o_proj: LinearWeight  # [hidden, q_size]
    post_attn_norm: torch.Tensor  # [hidden]
    gate_up_proj: LinearWeight  # [2 * intermediate, hidden]
    down_proj: LinearWeight  # [hidden, intermediate]


@dataclass
class LlamaWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: LinearWeight  # [vocab, hidden]; the embedding tensor itself when tied

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "embed_tokens", self.embed_tokens
        for i, layer in enumerate(self.layers):
            for name, value in vars(layer).items():
                if value is not None:
                    for suffix, t in weight_tensors(value):
                        yield f"layers.{i}.{name}" + (f".{suffix}" if suffix else ""), t
        yield "norm", self.norm
        if self.lm_head is not self.embed_tokens:
            for suffix, t in weight_tensors(self.lm_head):
                yield "lm_head" + (f".{suffix}" if suffix else ""), t

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())

    def linears(self) -> Iterator[LinearWeight]:
        """Every linear weight, layer by layer, then the lm_head."""
        for layer in self.layers:
            yield from (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        yield self.lm_head

    @property
    def precision(self) -> str:
        """What runs in which bits, for operators: `int4-g32` when every linear but the lm_head
        shares one precision, else the count of each (`int4-g128 x96, bf16 x24`); then the
        lm_head's and the embedding's (`lm_head bf16, embedding bf16`)."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                counts[precision_of(w)] = counts.get(precision_of(w), 0) + 1
        ordered = sorted(counts.items(), key=lambda kv: -kv[1])
        body = ordered[0][0] if len(ordered) == 1 else ", ".join(f"{p} x{n}" for p, n in ordered)
        return f"{body}; lm_head {precision_of(self.lm_head)}, embedding " + precision_of(
            self.embed_tokens
        )


@dataclass(frozen=True)
class ServingFormat:
    """How the serving daemon holds weights, whatever the checkpoint: the same for every
    version it loads."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32  # activations, norms, dense weights by default
    precision: PrecisionMap | None = None  # `--quantize`: RTN-quantize 16-bit modules at load
    dequantize: bool = False  # serve quantized checkpoints dequantized to `dtype`


# The Hugging Face names of the model's own tensors, and of a layer's (`_layer_tensors`)
_EMBED = "model.embed_tokens.weight"
_FINAL_NORM = "model.norm.weight"
_LM_HEAD = "lm_head"  # a linear module: its dense weight is "lm_head.weight"
_LAYER = "model.layers.{}."


@dataclass(frozen=True)
class _LayerTensor:
    """One `LayerWeights` field and what fills it: linear modules (their weights' rows
    concatenated) or plain tensors."""

    field: str  # the `LayerWeights` attribute
    # (Hugging Face name under `model.layers.{n}.`, shape), in row order: a module name
    # ("self_attn.q_proj") for linear fields, a tensor name for the others
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    linear: bool = False


def _layer_tensors(arch: LlamaArch) -> tuple[_LayerTensor, ...]:
    """A layer's tensors: the one place their Hugging Face names and shapes are spelled
    (`expected_shapes`, `build_weights` and `weight_copy_plan` read it, in this order). q/k/v
    and gate/up are fused; the q/k/v biases exist only with `arch.attention_bias`."""
    h, q, kv, i = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    attn, mlp = "self_attn.", "mlp."
    table = [
        _LayerTensor("input_norm", (("input_layernorm.weight", (h,)),)),
        _LayerTensor("qkv_proj", ((attn + "q_proj", (q, h)), (attn + "k_proj", (kv, h)),
                                  (attn + "v_proj", (kv, h))), linear=True),
        _LayerTensor("o_proj", ((attn + "o_proj", (h, q)),), linear=True),
        _LayerTensor("post_attn_norm", (("post_attention_layernorm.weight", (h,)),)),
        _LayerTensor("gate_up_proj", ((mlp + "gate_proj", (i, h)), (mlp + "up_proj", (i, h))),
                     linear=True),
        _LayerTensor("down_proj", ((mlp + "down_proj", (h, i)),), linear=True),
    ]  # fmt: skip
    if arch.attention_bias:
        table.append(_LayerTensor("qkv_bias", ((attn + "q_proj.bias", (q,)),
                                               (attn + "k_proj.bias", (kv,)),
                                               (attn + "v_proj.bias", (kv,)))))  # fmt: skip
    return tuple(table)


@dataclass(frozen=True)
class SlotField:
    """One field of `LlamaWeights` (or of a layer's) and the checkpoint names that fill it."""

    layer: int | None  # the layer index; None for the model's own fields
    field: str  # the attribute
    parts: tuple[tuple[str, tuple[int, ...]], ...]  # full Hugging Face names (modules for
    # linear fields, tensors otherwise) and shapes, in row order
    linear: bool

    def owner(self, weights: LlamaWeights) -> LlamaWeights | LayerWeights:
        return weights if self.layer is None else weights.layers[self.layer]


def slot_fields(arch: LlamaArch) -> list[SlotField]:
    """Every field a slot holds, in `expected_shapes` order; the lm_head only when untied."""
    h = arch.hidden_size
    fields = [SlotField(None, "embed_tokens", ((_EMBED, (arch.vocab_size, h)),), False)]
    for n in range(arch.num_layers):
        prefix = _LAYER.format(n)
        for t in _layer_tensors(arch):
            parts = tuple((prefix + name, shape) for name, shape in t.parts)
            fields.append(SlotField(n, t.field, parts, t.linear))
    fields.append(SlotField(None, "norm", ((_FINAL_NORM, (h,)),), False))
    if not arch.tie_word_embeddings:
        fields.append(SlotField(None, "lm_head", ((_LM_HEAD, (arch.vocab_size, h)),), True))
    return fields


def _tensor_name(f: SlotField, name: str) -> str:
    return f"{name}.weight" if f.linear else name


def expected_shapes(arch: LlamaArch) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names of the architecture and their shapes (16-bit checkpoint)."""
    return {_tensor_name(f, n): s for f in slot_fields(arch) for n, s in f.parts}


def expected_tensors(
    arch: LlamaArch, tensors: Container[str], source: QuantSource | None
) -> dict[str, tuple[int, ...] | None]:
    """The tensors a checkpoint may hold: dense ones with their shape, the tensors of each
    module it stores quantized with None (optional here; their format's converter checks
    them)."""
    out: dict[str, tuple[int, ...] | None] = {}
    for f in slot_fields(arch):
        for name, shape in f.parts:
            if f.linear and source is not None and source.is_quantized(tensors, name):
                out |= dict.fromkeys(source.tensor_names(name))
            else:
                out[_tensor_name(f, name)] = shape
    return out


def check_tensors(
    arch: LlamaArch, tensors: Mapping[str, torch.Tensor], source: QuantSource | None = None
) -> None:
    """Raise `WeightsError` unless every expected dense tensor is present with its shape and a
    floating dtype (quantized modules are checked when converted)."""
    expected = expected_tensors(arch, tensors, source)
    missing = sorted(n for n, shape in expected.items() if shape is not None and n not in tensors)
    if missing:
        raise WeightsError(f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    for name, shape in expected.items():
        if shape is None:
            continue
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise WeightsError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if not t.dtype.is_floating_point:
            raise WeightsError(f"{name} has dtype {t.dtype}, expected a floating-point type")


def has_quantized_linears(
    arch: LlamaArch,
    tensors: Mapping[str, torch.Tensor],
    source: QuantSource | None,
    fmt: ServingFormat,
) -> bool:
    """Whether a slot built from the checkpoint holds any quantized linear weight."""
    for f in slot_fields(arch):
        for name, _ in f.parts if f.linear else ():
            if source is not None and not fmt.dequantize and source.is_quantized(tensors, name):
                return True
            precision = fmt.precision.precision_for(f"{name}.weight") if fmt.precision else None
            if precision is not None and precision.quantized:
                return True
    return False


def _dense(tensors: Mapping[str, torch.Tensor], name: str, fmt: ServingFormat,
           dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    t = tensors[name].to(device=fmt.device, dtype=dtype)
    if not torch.isfinite(t).all():
        raise WeightsError(f"{name} holds NaN or Inf values (in {dtype})")
    return t


def _module(
    tensors: Mapping[str, torch.Tensor],
    module: str,
    shape: tuple[int, int],
    source: QuantSource | None,
    fmt: ServingFormat,
    dense16: torch.dtype,
) -> torch.Tensor | QuantizedWeight:
    """One linear module's weight on the device, before fusing (see the module docstring)."""
    name = f"{module}.weight"
    if source is not None and source.is_quantized(tensors, module):
        weight = source.convert(tensors, module, shape, fmt.device)
        return weight.dequantize(fmt.dtype) if fmt.dequantize else weight
    precision = fmt.precision.precision_for(name) if fmt.precision is not None else None
    if precision is None:
        return _dense(tensors, name, fmt, dense16 if module == _LM_HEAD else fmt.dtype)
    if precision.kind in ("bf16", "fp16"):
        return _dense(tensors, name, fmt, torch.bfloat16 if precision.kind == "bf16"
                      else torch.float16)  # fmt: skip
    dense = _dense(tensors, name, fmt, torch.float32)
    if precision.kind == "int4":
        return quantize_int4_as(dense, precision, name).to_layout()
    return quantize_int8(dense) if precision.kind == "int8" else quantize_fp8(dense)


def build_field(
    f: SlotField,
    tensors: Mapping[str, torch.Tensor],
    source: QuantSource | None,
    fmt: ServingFormat,
    dense16: torch.dtype,
) -> LinearWeight:
    """The value of slot field `f` built from a checkpoint (see the module docstring)."""
    if not f.linear:
        precision = fmt.precision.precision_for(f.parts[0][0]) if fmt.precision else None
        if precision is not None and precision.quantized:
            raise QuantFormatError(
                f"precision map {fmt.precision.source if fmt.precision else ''}: "
                f"{f.parts[0][0]} is not a linear weight; it can only be bf16 or fp16"
            )
        dtype = fmt.dtype if f.field != "embed_tokens" else dense16
        if precision is not None:
            dtype = torch.bfloat16 if precision.kind == "bf16" else torch.float16
        parts = [_dense(tensors, name, fmt, dtype) for name, _ in f.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts).contiguous()
    weights = [_module(tensors, m, (s[0], s[1]), source, fmt, dense16) for m, s in f.parts]
    dense = [w for w in weights if isinstance(w, torch.Tensor)]
    if len(dense) == len(weights):
        if len({w.dtype for w in dense}) > 1:
            raise QuantFormatError(f"{_names(f)} are fused and must share one dtype")
        return dense[0] if len(dense) == 1 else torch.cat(dense).contiguous()
    if dense:
        raise QuantFormatError(
            f"{_names(f)} are fused into one weight and must share one precision: got "
            + ", ".join(precision_of(w) for w in weights)
        )
    quantized = [w for w in weights if not isinstance(w, torch.Tensor)]
    try:
        fused = quantized[0] if len(quantized) == 1 else concat_rows(quantized)
    except QuantFormatError as exc:
        raise QuantFormatError(f"{_names(f)} are fused into one weight: {exc}") from None
    return to_serving_layout(fused, fmt.device)


def dense_copy_dtype(
    f: SlotField,
    tensors: Mapping[str, torch.Tensor],
    source: QuantSource | None,
    fmt: ServingFormat,
    dense16: torch.dtype,
) -> torch.dtype | None:
    """The dtype `build_field` gives `f` when it builds it by casting dense checkpoint tensors
    (what a slot can take chunk by chunk, in place); None when it converts or quantizes."""
    names = [f.parts[0][0]] if not f.linear else [f"{m}.weight" for m, _ in f.parts]
    if f.linear and source is not None and any(source.is_quantized(tensors, m)
                                               for m, _ in f.parts):  # fmt: skip
        return None
    precisions = {fmt.precision.precision_for(n) if fmt.precision else None for n in names}
    if len(precisions) != 1:
        return None
    (precision,) = precisions
    if precision is not None:
        if precision.quantized:
            return None
        return torch.bfloat16 if precision.kind == "bf16" else torch.float16
    if f.field in ("embed_tokens", "lm_head"):
        return dense16
    return fmt.dtype


def field_tensor_names(
    f: SlotField, tensors: Mapping[str, torch.Tensor], source: QuantSource | None
) -> list[str]:
    """The checkpoint tensors `build_field` reads for `f` (those present)."""
    if not f.linear:
        return [name for name, _ in f.parts]
    out: list[str] = []
    for module, _ in f.parts:
        if source is not None and source.is_quantized(tensors, module):
            out += [n for n in source.tensor_names(module) if n in tensors]
        else:
            out.append(f"{module}.weight")
    return out


def _names(f: SlotField) -> str:
    return ", ".join(name for name, _ in f.parts)


def build_weights(
    arch: LlamaArch,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    source: QuantSource | None = None,
    fmt: ServingFormat | None = None,
) -> LlamaWeights:
    """Convert Hugging Face-named checkpoint tensors to `LlamaWeights` on `device` in `dtype`
    (activations and dense weights), quantized modules converted (see the module docstring).

    Raises:
        WeightsError: a dense tensor is missing, misshapen, or holds NaN/Inf after the cast.
        QuantFormatError: a quantized module does not fit its format (named), or the precision
            map asks for what cannot be.
    """
    check_tensors(arch, tensors, source)
    fmt = replace(fmt or ServingFormat(), device=torch.device(device), dtype=dtype)
    dense16 = dense16_dtype(arch, tensors, source, fmt)
    values: dict[tuple[int | None, str], LinearWeight] = {}
    for f in slot_fields(arch):
        values[(f.layer, f.field)] = build_field(f, tensors, source, fmt, dense16)
    layers = []
    for n in range(arch.num_layers):
        own = {name: value for (layer, name), value in values.items() if layer == n}
        layers.append(LayerWeights(**{"qkv_bias": None, **own}))  # type: ignore[arg-type]
    embed = values[(None, "embed_tokens")]
    assert isinstance(embed, torch.Tensor)
    norm = values[(None, "norm")]
    assert isinstance(norm, torch.Tensor)
    lm_head = values.get((None, "lm_head"), embed)
    return LlamaWeights(embed, layers, norm, lm_head)


def dense16_dtype(
    arch: LlamaArch,
    tensors: Mapping[str, torch.Tensor],
    source: QuantSource | None,
    fmt: ServingFormat,
) -> torch.dtype:
    """The dtype of the embedding and a dense lm_head: bfloat16 on a CPU serving quantized
    layers, else the serving dtype."""
    if fmt.device.type == "cpu" and has_quantized_linears(arch, tensors, source, fmt):
        return torch.bfloat16
    return fmt.dtype


def weight_copy_plan(arch: LlamaArch, weights: LlamaWeights) -> list[tuple[torch.Tensor, str]]:
    """(destination, Hugging Face name) pairs that fill `weights`' dense fields from a 16-bit
    checkpoint, in place.

    The destinations are views into `weights`' tensors: the q/k/v rows of `qkv_proj`, the
    gate/up rows of `gate_up_proj`, whole tensors elsewhere; copying each checkpoint tensor into
    its view gives what `build_weights` builds, without a new allocation (a weight slot's
    addresses never change, so CUDA graphs captured on it stay valid). Quantized fields are not
    in the plan (`slot_fields` lists them; staging rebuilds them).
    """
    plan = []
    for f in slot_fields(arch):
        dst = getattr(f.owner(weights), f.field)
        if not isinstance(dst, torch.Tensor):
            continue
        start = 0
        for name, shape in f.parts:
            plan.append((dst[start : start + shape[0]] if len(f.parts) > 1 else dst,
                         _tensor_name(f, name)))  # fmt: skip
            start += shape[0]
    return plan


def empty_weights_like(weights: LlamaWeights, *, zero: bool = False) -> LlamaWeights:
    """A second set of tensors shaped like `weights` (tied embeddings stay tied)."""
    make = torch.zeros_like if zero else torch.empty_like
    layers = [
        LayerWeights(**{name: None if value is None else empty_weight_like(value, zero=zero)
                        for name, value in vars(layer).items()})  # type: ignore[arg-type]
        for layer in weights.layers
    ]  # fmt: skip
    embed = make(weights.embed_tokens)
    lm_head = (
        embed
        if weights.lm_head is weights.embed_tokens
        else empty_weight_like(weights.lm_head, zero=zero)
    )
    return LlamaWeights(embed, layers, make(weights.norm), lm_head)


def linear_nbytes(weights: LlamaWeights) -> int:
    """Bytes of the linear weights alone (the lm_head once, even when tied)."""
    return sum(weight_nbytes(w) for w in weights.linears())
