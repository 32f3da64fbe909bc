"""The model shapes the benchmarks measure, each defined once.

- `LLAMA3_8B`: Llama-3-8B, the GPU benchmarks' model (random bf16 weights in its shapes);
- `SMOLLM2`: SmolLM2-135M, the embedded model's shape (the CPU benchmarks load the real
  weights; a random checkpoint in its shape is for runs without them);
- `MODELS`: both by the name `make_random_model --shape` takes;
- `linear_shapes(arch)`: the [N, K] weight of each linear a decoder layer runs (q, k and v
  fused into one, gate and up into one, as the model fuses them) and of the lm_head.

Which tensors a checkpoint of an architecture holds is the model's business
(`sitsd.model.llama.expected_shapes`); the kernel shapes (heads, head size) are read off the
`LlamaArch` by each benchmark.
"""

from __future__ import annotations

from sitsd.model.arch import LlamaArch

LLAMA3_8B = LlamaArch(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=8192)  # fmt: skip
SMOLLM2 = LlamaArch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True)  # fmt: skip
MODELS = {"llama-3-8b": LLAMA3_8B, "smollm2": SMOLLM2}


def linear_shapes(arch: LlamaArch) -> dict[str, tuple[int, int]]:
    """Layer name -> (N, K) of its weight: qkv, o, gate_up, down (every decoder layer), lm_head."""
    h = arch.hidden_size
    return {
        "qkv": (arch.q_size + 2 * arch.kv_size, h),
        "o": (h, arch.q_size),
        "gate_up": (2 * arch.intermediate_size, h),
        "down": (h, arch.intermediate_size),
        "lm_head": (arch.vocab_size, h),
    }
