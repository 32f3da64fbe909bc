"""Write a loaded checkpoint as a weights version: a Hugging Face safetensors directory with a
`manifest.json`.

What hot-swap takes in (`sitsd.weights.swap`), from any checkpoint sitsd reads: a GGUF loaded
with `keep_quantized=False` (its tensors dequantized to float32) becomes a directory a daemon
can deploy or find in its watched directory. The benchmark and tests make versions this way;
operators can too (`sitsd quantize` writes quantized ones):

    ckpt = load_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf", keep_quantized=False)
    write_version(ckpt, "/models/watch/smollm2/v1")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from sitsd.weights.checkpoint import Checkpoint
from sitsd.weights.manifest import Manifest, write_manifest


def hf_config(ckpt: Checkpoint) -> dict[str, object]:
    """A `config.json` that `arch_from_hf_config` reads back as `ckpt.arch`."""
    arch = ckpt.arch
    tokenizer = ckpt.tokenizer
    config: dict[str, object] = {
        "architectures": [
            "MistralForCausalLM" if arch.architecture == "mistral" else "LlamaForCausalLM"
        ],
        "model_type": arch.architecture,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias,
        "sliding_window": arch.sliding_window,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": list(tokenizer.eos_token_ids),
        "torch_dtype": "float32",
    }
    return config


def write_version(
    ckpt: Checkpoint,
    directory: str | Path,
    tensors: Mapping[str, torch.Tensor] | None = None,
    *,
    model: str = "",
) -> Manifest:
    """Write `ckpt` (or other `tensors` for its architecture) as a version directory.

    Args:
        ckpt: the checkpoint: architecture, tokenizer, chat template, tensors.
        directory: where to write (created); the manifest is written last, so a watcher sees
            the version complete only once every file is.
        tensors: Hugging Face-named tensors to write instead of `ckpt.tensors`.
        model: the model name recorded in the manifest.

    Returns:
        The manifest written.

    Raises:
        ValueError: `ckpt` holds quantized tensors (`ckpt.quant`) and no `tensors` replace them:
            they would be written as plain tensors, without their format.
    """
    if tensors is None and ckpt.quant is not None and not ckpt.quant.is_empty:
        raise ValueError(
            f"{ckpt.path} was loaded with its quantized tensors kept; load it with "
            "keep_quantized=False to write a 16-bit version, or use `sitsd quantize`"
        )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    source = ckpt.tensors if tensors is None else tensors
    save_file({k: v.contiguous() for k, v in source.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config(ckpt), indent=2))
    tokenizer = ckpt.tokenizer
    tokenizer.backend.save(str(out / "tokenizer.json"))
    token = tokenizer.backend.id_to_token
    tok_config: dict[str, object] = {
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": tokenizer.add_eos_token,
        "eos_token": token(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None,
    }
    for key in ("bos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{key}_token_id")
        if token_id is not None:
            tok_config[f"{key}_token"] = token(token_id)
    if tokenizer.chat_template:
        tok_config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return write_manifest(out, model=model)


def perturbed(
    tensors: Mapping[str, torch.Tensor], scale: float, seed: int
) -> dict[str, torch.Tensor]:
    """A copy of `tensors` with relative Gaussian noise: w * (1 + scale * N(0, 1)).

    A stand-in for a fine-tuned version: the same model, slightly different outputs.
    """
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (t.float() * (1 + scale * torch.randn(t.shape, generator=gen))).to(t.dtype)
        for name, t in tensors.items()
    }
