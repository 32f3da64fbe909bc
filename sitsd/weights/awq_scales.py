"""AWQ's activation-aware scales: per input channel, found on calibration inputs, folded into
the operation before the quantized modules (Lin et al., "AWQ", 2023; AutoAWQ's `auto_scale`).

For modules sharing an input x `[T, K]` (q/k/v after the input norm; gate/up after the
post-attention norm; down after SwiGLU, whose `up_proj` rows take its scales; o_proj after
attention when there is one value head per query head, `v_proj` rows taking them), each input
channel k gets a scale `s_k = mean|x_k|^alpha` (normalised), the weights' columns are
multiplied by it and the operation before divides its output by it: the 16-bit model computes
the same, but the channels that carry the most activation lose less to rounding. `alpha` in
0, 0.05, ..., 0.95 minimises `|x W^T - x Q(W diag s)^T diag(1/s)|^2` over the samples; alpha 0
is plain RTN, so the search never does worse on them. The folded weights are ordinary dense
tensors: the AWQ checkpoint format is unchanged.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from sitsd.model.arch import LlamaArch
from sitsd.quant.rtn import quantize_int4

_ALPHAS = tuple(i / 20 for i in range(20))


def _scaled_error(x: torch.Tensor, ws: list[torch.Tensor], s: torch.Tensor, group: int) -> float:
    err = 0.0
    for w in ws:
        w_hat = quantize_int4(w * s, group).dequantize() / s  # [N, K]
        err += float(((x @ (w - w_hat).T) ** 2).sum())
    return err


def search_scales(x: torch.Tensor, ws: list[torch.Tensor], group: int) -> torch.Tensor:  # [K]
    """The scales (alpha on the grid) that minimise the modules' output error on `x`."""
    x = x.float().reshape(-1, x.shape[-1])
    mean_abs = x.abs().mean(dim=0).clamp_min(1e-5)
    best, best_s = None, torch.ones_like(mean_abs)
    for alpha in _ALPHAS:
        s = mean_abs**alpha
        s = s / (s.max() * s.min()).sqrt()
        err = _scaled_error(x, ws, s, group)
        if best is None or err < best:
            best, best_s = err, s
    return best_s


def fold_layer_scales(
    tensors: MutableMapping[str, torch.Tensor],
    arch: LlamaArch,
    n: int,
    samples: dict[str, torch.Tensor],
    group: int,
    quantized: set[str],
) -> None:
    """Search and fold the scales of layer `n`'s quantized modules into `tensors` (float32).

    Args:
        samples: each module's calibration input `[T, K]`.
        quantized: the modules that are quantized (the others keep their weights).
    """
    p = f"model.layers.{n}."
    groups = [
        (p + "input_layernorm.weight", ("self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj")),
        (p + "post_attention_layernorm.weight", ("mlp.gate_proj", "mlp.up_proj")),
        (p + "mlp.up_proj.weight", ("mlp.down_proj",)),
    ]  # fmt: skip
    if arch.num_heads == arch.num_kv_heads:
        groups.append((p + "self_attn.v_proj.weight", ("self_attn.o_proj",)))
    for before, names in groups:
        modules = [p + name for name in names]
        if not all(m in quantized for m in modules) or modules[0] not in samples:
            continue
        ws = [tensors[f"{m}.weight"].float() for m in modules]
        s = search_scales(samples[modules[0]], ws, group)
        for m, w in zip(modules, ws, strict=True):
            tensors[f"{m}.weight"] = w * s  # columns
        prev = tensors[before].float()
        tensors[before] = prev / s if prev.dim() == 1 else prev / s[:, None]  # rows
