"""Rotary-embedding scaling of a GGUF file, back in Hugging Face's `rope_scaling` form.

llama.cpp writes linear and YaRN scaling as `llama.rope.scaling.*` metadata, and Llama-3's
frequency scaling as a `rope_freqs` tensor of per-frequency divisors; `rope_scaling` recovers
the dict `transformers` would read from `config.json`. Reading the file is `gguf_file`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from sitsd.weights.checkpoint import CheckpointError

__all__ = ["RopeScaling", "llama3_freq_factors", "llama3_scaling_from_freq_factors", "rope_scaling"]

# Hugging Face's `rope_scaling` dict: "rope_type" a string, every other entry a number.
RopeScaling = dict[str, str | float | int]


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _f32(value: float) -> float:
    """The shortest decimal of a float32 metadata value (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def rope_scaling(
    meta: Mapping[str, object],
    rope_freqs: np.ndarray | None,
    theta: float,
    head_dim: int,
    path: Path,
) -> RopeScaling | None:
    """HF-style `rope_scaling` from `llama.rope.scaling.*`, or from a Llama-3 `rope_freqs`."""
    kind = str(meta.get("llama.rope.scaling.type", "none"))
    factor = _float_or_none(
        meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear"))
    )
    if kind == "none" and factor is not None and factor != 1.0:
        kind = "linear"  # older files: only rope.scale_linear
    if kind in ("linear", "yarn"):
        if factor is None:
            raise CheckpointError(f"{path}: {kind} rope scaling without a factor")
        scaling: RopeScaling = {"rope_type": kind, "factor": _f32(factor)}
        if kind == "yarn":
            context = meta["llama.rope.scaling.original_context_length"]
            if not isinstance(context, (int, float)):
                raise CheckpointError(f"{path}: yarn rope scaling without an original context")
            scaling["original_max_position_embeddings"] = int(context)
        return scaling
    if kind != "none":
        raise CheckpointError(f"{path}: rope scaling {kind!r} is not supported")
    if rope_freqs is None:
        return None
    return llama3_scaling_from_freq_factors(rope_freqs, theta, head_dim, path)


def llama3_scaling_from_freq_factors(
    factors: np.ndarray, theta: float, head_dim: int, path: Path
) -> RopeScaling:
    """Recover Llama-3 `rope_scaling` from llama.cpp's per-frequency divisors (`rope_freqs`).

    The divisors depend on (original context, low/high freq factor) only through their ratios,
    so the common Llama-3.1 values (8192, 1, 4) are tried first, then fitted.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    factor = float(factors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)  # [head_dim // 2]
    candidates = [(8192, 1.0, 4.0)]
    medium = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    if medium.sum() >= 2:
        # In the medium band 1/f = 1/F + s(1 - 1/F), s = (ctx / wavelen - low) / (high - low).
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[medium], smooth, 1)
        if intercept < 0:
            candidates.append((round(-slope / intercept), 1.0, 1.0 - 1.0 / intercept))
    for ctx, low, high in candidates:
        scaling: RopeScaling = {
            "rope_type": "llama3",
            "factor": _f32(factor),
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": int(ctx),
        }
        if np.allclose(llama3_freq_factors(scaling, theta, head_dim), factors, rtol=1e-3):
            return scaling
    raise CheckpointError(f"{path}: rope_freqs.weight does not match Llama-3 rope scaling")


def llama3_freq_factors(scaling: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for HF Llama-3 `rope_scaling`: the divisor of each frequency."""
    factor = float(scaling["factor"])
    ctx = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)  # [head_dim // 2]
    smooth = (ctx / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < ctx / high, 1.0, np.where(wavelen > ctx / low, factor, medium))
