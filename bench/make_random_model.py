"""Write a Hugging Face model directory with random weights in a real model's shapes.

For benchmarks that need the whole daemon (`sitsd serve --model DIR`) on a machine with no
model files: config.json, bf16 safetensors shards (generated on the GPU when there is one),
and a byte-level tokenizer (one token per byte, plus ChatML specials) with a chat template.
The model's vocabulary is the real one; the tokenizer only ever produces its first ids, and
sampled ids past it decode to nothing. Never used by the tests.

    python3 -m bench.make_random_model OUT_DIR [--shape llama-3-8b|smollm2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from bench.shapes import MODELS
from sitsd.model.arch import LlamaArch
from sitsd.model.llama import expected_shapes

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHARD_BYTES = 4 * 2**30


def byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def hf_config(arch: LlamaArch) -> dict[str, object]:
    """The `config.json` of a bf16 Llama checkpoint of architecture `arch`."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "rms_norm_eps": arch.rms_norm_eps, "torch_dtype": "bfloat16",
            "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
            "rope_theta": arch.rope_theta, "max_position_embeddings": arch.max_position_embeddings,
            "tie_word_embeddings": arch.tie_word_embeddings}  # fmt: skip


def write(out: Path, shape: str, seed: int = 0, noise: float = 0.0, noise_seed: int = 1) -> None:
    """`noise` > 0: each random weight w becomes w * (1 + noise * N(0, 1)) (a second version
    of the same model, as a fine-tune would be)."""
    out.mkdir(parents=True, exist_ok=True)
    arch = MODELS[shape]
    (out / "config.json").write_text(json.dumps(hf_config(arch), indent=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    noise_gen = torch.Generator(device=device).manual_seed(noise_seed)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, 0
    for name, dims in expected_shapes(arch).items():
        if name.endswith("norm.weight"):
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = torch.empty(dims, dtype=torch.bfloat16, device=device)
            t = t.normal_(0.0, 0.02, generator=gen)
            if noise:
                jitter = torch.empty(dims, dtype=torch.float32, device=device)
                jitter.normal_(0.0, noise, generator=noise_gen)
                t = (t.float() * (1 + jitter)).to(torch.bfloat16)
            t = t.cpu()
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            save_file(shard, str(out / f"model-{index:05d}.safetensors"))
            shard, shard_bytes, index = {}, 0, index + 1
    if shard:
        save_file(shard, str(out / f"model-{index:05d}.safetensors"))
    if device == "cuda":
        # The caching allocator kept ~11 GiB of the generators' blocks, which a daemon started
        # next by the same benchmark does not see as taken (its 128-stream start ran out).
        torch.cuda.empty_cache()
    byte_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0],
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }, indent=2))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(MODELS), default="llama-3-8b")
    args = parser.parse_args()
    write(args.out, args.shape)
    print(f"wrote {args.shape} random weights to {args.out}")


if __name__ == "__main__":
    main()
