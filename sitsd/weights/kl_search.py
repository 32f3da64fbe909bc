"""The KL scale search of `sitsd quantize --scale-search kl`: per layer, the clipping of every
group's range (one fraction for the whole layer, from a grid) under which the model's next-token
distributions on a calibration window stay closest to the 16-bit model's.

Greedy, layer by layer: layer n is tried at each clipping with the layers before it as already
quantized and the layers after it in 16 bits, and the one with the smallest mean
KL(16-bit || trial) over the window's positions is kept. It costs a forward of the layers from
n on per clipping tried; `mse` (the default) costs none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from sitsd.weights.reference_llama import ReferenceLlama

CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8)


def reference_logprobs(model: ReferenceLlama, ids: torch.Tensor) -> torch.Tensor:
    """The 16-bit model's next-token log-probabilities of `ids` `[1, T]` (`[1, T, vocab]`)."""
    h = model.embed(ids)
    for n in range(model.arch.num_layers):
        h = model.layer(n, h)
    return model.logits(h).log_softmax(-1)


def choose_clip(
    model: ReferenceLlama,
    n: int,
    h: torch.Tensor,  # [1, T, hidden]: layer n's input, the layers before it quantized
    reference: torch.Tensor,  # [1, T, vocab] log-probabilities of the 16-bit model
    quantize_at: Callable[[float], Mapping[str, torch.Tensor]],  # clip -> module -> W
) -> float:
    """The clipping in `CLIPS` of layer `n` with the smallest mean KL to `reference`."""
    best, best_clip = float("inf"), CLIPS[0]
    for clip in CLIPS:
        trial = quantize_at(clip)

        def linear(
            module: str, x: torch.Tensor, trial: Mapping[str, torch.Tensor] = trial
        ) -> torch.Tensor:
            w = trial.get(module)
            return model.dense(module, x) if w is None else x @ w.T

        x = model.layer(n, h, linear=linear)
        for m in range(n + 1, model.arch.num_layers):
            x = model.layer(m, x)
        logprobs = model.logits(x).log_softmax(-1)
        kl = float((reference.exp() * (reference - logprobs)).sum(-1).mean())
        if kl < best:
            best, best_clip = kl, clip
    return best_clip
