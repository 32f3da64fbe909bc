"""A plain full-sequence Llama forward over Hugging Face-named dense tensors, one layer at a time.

What `sitsd quantize` runs calibration text through, and the accuracy benchmark computes
perplexity with: no KV cache, no kernels of ours beyond the rotary tables, float32 throughout.
`LayerInputs` records the mean square of every input channel of each linear module as a layer
runs (the weights of the scale search: an input channel that carries more energy makes its
weights' error cost more), and a layer may run with weights other than the checkpoint's
(`linear`): quantizing layer by layer, each layer sees the inputs the quantized layers before it
produce. Serving never runs this; `sitsd.model` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from sitsd.kernels.reference import compute_cos_sin_cache
from sitsd.model.arch import LlamaArch
from sitsd.model.cpu_kernels import rotary_embedding
from sitsd.model.weights import expected_shapes
from sitsd.quant.source import QuantSource

# (module name, its input) -> its output; the checkpoint's dense weight by default
Linear = Callable[[str, torch.Tensor], torch.Tensor]
_ATTENTION = ("q_proj", "k_proj", "v_proj")
_MLP_IN = ("gate_proj", "up_proj")


def dense_tensors(
    arch: LlamaArch, tensors: Mapping[str, torch.Tensor], source: QuantSource | None
) -> dict[str, torch.Tensor]:
    """A checkpoint's Hugging Face-named tensors with every module it stores quantized (per
    `source`) dequantized to float32 as `<module>.weight`, exactly as its kernel's layout
    dequantizes it; the module's quantized tensors are left out, every other tensor kept."""
    if source is None or source.is_empty:
        return dict(tensors)
    out = dict(tensors)
    for name, shape in expected_shapes(arch).items():
        module = name.removesuffix(".weight")
        if len(shape) != 2 or not source.is_quantized(tensors, module):
            continue
        rows, cols = shape
        layout = source.convert(tensors, module, (rows, cols), torch.device("cpu"))
        for quantized in source.tensor_names(module):
            out.pop(quantized, None)
        out[name] = layout.dequantize().float()
    return out


class ReferenceLlama:
    """The forward of one checkpoint's architecture over its dense tensors (float32)."""

    def __init__(self, arch: LlamaArch, tensors: Mapping[str, torch.Tensor], max_len: int):
        self.arch = arch
        self.tensors = tensors
        device = tensors["model.embed_tokens.weight"].device  # every tensor's
        self.cos_sin = compute_cos_sin_cache(arch.head_dim, max_len, arch.rope_theta,
                                             arch.rope_scaling).to(device)  # fmt: skip

    def weight(self, name: str) -> torch.Tensor:
        return self.tensors[name].float()

    def dense(self, module: str, x: torch.Tensor) -> torch.Tensor:
        """The checkpoint's own linear module `module` applied to `x` `[..., K]`."""
        out = x @ self.weight(f"{module}.weight").T
        bias = self.tensors.get(f"{module}.bias")
        return out if bias is None else out + bias.float()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, hidden]
        return F.embedding(ids, self.weight("model.embed_tokens.weight"))

    def layer(
        self,
        n: int,
        h: torch.Tensor,  # [B, T, hidden]
        linear: Linear | None = None,
        on_input: Callable[[str, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:  # [B, T, hidden]
        """Layer `n`; `on_input(module, x)` sees each linear module's input before it runs
        (q/k/v and gate/up share theirs: called once per module, with the same tensor)."""
        arch, prefix = self.arch, f"model.layers.{n}."
        apply = linear or self.dense
        eps = arch.rms_norm_eps

        def run(names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
            modules = [prefix + name for name in names]
            for module in modules:
                if on_input is not None:
                    on_input(module, x)
            return [apply(module, x) for module in modules]

        x = F.rms_norm(h, (h.shape[-1],), self.weight(prefix + "input_layernorm.weight"), eps)
        q, k, v = run(tuple(f"self_attn.{p}" for p in _ATTENTION), x)
        b, t, _ = h.shape
        positions = torch.arange(t, device=h.device)
        heads = []
        for i in range(b):
            qi = q[i].reshape(t, arch.num_heads, arch.head_dim)
            ki = k[i].reshape(t, arch.num_kv_heads, arch.head_dim)
            qi, ki = rotary_embedding(positions, qi, ki, self.cos_sin)
            vi = v[i].reshape(t, arch.num_kv_heads, arch.head_dim)
            heads.append(F.scaled_dot_product_attention(
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1),
                is_causal=True, enable_gqa=True,
            ).transpose(0, 1).reshape(t, -1))  # fmt: skip
        (o,) = run(("self_attn.o_proj",), torch.stack(heads))
        h = h + o
        x = F.rms_norm(h, (h.shape[-1],), self.weight(prefix + "post_attention_layernorm.weight"),
                       eps)  # fmt: skip
        gate, up = run(tuple(f"mlp.{p}" for p in _MLP_IN), x)
        (down,) = run(("mlp.down_proj",), F.silu(gate) * up)
        return h + down

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, hidden] -> [B, T, vocab]
        h = F.rms_norm(h, (h.shape[-1],), self.weight("model.norm.weight"), self.arch.rms_norm_eps)
        head = "lm_head.weight" if "lm_head.weight" in self.tensors else "model.embed_tokens.weight"
        return h @ self.weight(head).T


class LayerInputs:
    """The mean square of each input channel of every linear module a layer ran (`[K]`), and
    the first `keep` tokens of each input (`[keep, K]`)."""

    def __init__(self, keep: int = 0) -> None:
        self.keep = keep
        self.mean_square: dict[str, torch.Tensor] = {}
        self.samples: dict[str, torch.Tensor] = {}

    def __call__(self, module: str, x: torch.Tensor) -> None:
        flat = x.float().reshape(-1, x.shape[-1])
        self.mean_square[module] = flat.pow(2).mean(dim=0)
        if self.keep:
            self.samples[module] = flat[: self.keep].clone()


def perplexity(model: ReferenceLlama, windows: torch.Tensor) -> tuple[float, int]:
    """exp(mean next-token NLL) over `windows` `[B, T]` of token ids; (perplexity, tokens)."""
    nll, count = 0.0, 0
    with torch.inference_mode():
        for row in windows:
            h = model.embed(row[None])
            for n in range(model.arch.num_layers):
                h = model.layer(n, h)
            logprobs = model.logits(h)[0, :-1].log_softmax(-1)
            nll -= float(logprobs.gather(1, row[1:, None]).sum())
            count += row.numel() - 1
    return float(torch.tensor(nll / count).exp()), count
