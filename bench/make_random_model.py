"""Write a Hugging Face model directory with random weights in a real model's shapes.

For benchmarks that need the whole daemon (`sitsd serve --model DIR`) on a machine with no
model files: config.json, bf16 safetensors shards (generated on the GPU when there is one),
and a byte-level tokenizer (one token per byte, plus ChatML specials) with a chat template.
The model's vocabulary is the real one; the tokenizer only ever produces its first ids, and
sampled ids past it decode to nothing. Never used by the tests.

    python3 bench/make_random_model.py OUT_DIR [--shape llama-3-8b|smollm2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SHAPES = {
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, max_position_embeddings=8192,
                       tie_word_embeddings=False),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}  # fmt: skip
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


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}  # fmt: skip
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def write(out: Path, shape: str, seed: int = 0, noise: float = 0.0, noise_seed: int = 1) -> None:
    """`noise` > 0: each random weight w becomes w * (1 + noise * N(0, 1)) (a second version
    of the same model, as a fine-tune would be)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
           "torch_dtype": "bfloat16", **SHAPES[shape]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    noise_gen = torch.Generator(device=device).manual_seed(noise_seed)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, 0
    for name, dims in tensor_shapes(cfg).items():
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
    byte_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0],
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }, indent=2))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    args = parser.parse_args()
    write(args.out, args.shape)
    print(f"wrote {args.shape} random weights to {args.out}")


if __name__ == "__main__":
    main()
