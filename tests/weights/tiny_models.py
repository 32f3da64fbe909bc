"""Tiny checkpoints written on the fly: a random Llama as a Hugging Face directory or a GGUF file.

Reused by the model-parity and end-to-end tests (`from tests.weights.tiny_models import
write_tiny_llama`). Everything is derived from `seed`, so two calls with the same arguments write
the same weights. Nothing here imports sitsd: these files are what a user would hand the daemon.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
TOKENIZER_VOCAB_SIZE = 400
HIDDEN, INTERMEDIATE, NUM_LAYERS, NUM_HEADS = 64, 128, 2, 4

# ChatML, opening with bos_token (so the template's variables are exercised) and refusing unknown
# roles through raise_exception, like real templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "The model generates text one token at a time, reading the whole prompt first.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u4f60\u597d \u4e16\u754c \U0001f600 \U0001f680",
    "    indented\tand\ttabbed\n\nnew paragraphs   with   spaces",
]


@cache
def _tokenizer_json() -> str:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE trained on a small corpus; specials `SPECIAL_TOKENS` have ids 0, 1, 2."""
    return tokenizers.Tokenizer.from_str(_tokenizer_json())


def tiny_llama_model(
    *,
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    rope_scaling: dict | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> Any:
    """A random float32 `LlamaForCausalLM` (2 layers, hidden 64, 4 heads); norms are random
    too, so a swapped norm name shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size or tiny_tokenizer().get_vocab_size(),
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    with torch.random.fork_rng(), torch.no_grad():  # seeded, without moving the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model


def state_dict_of(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters under HF names, without `lm_head.weight` when it is tied."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_tiny_llama(
    dir: str | Path,
    *,
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    rope_scaling: dict | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    chat_template_jinja: bool = False,
    add_bos_token: bool = False,
) -> Path:
    """Write a tiny random Llama (2 layers, hidden 64, 4 heads) as a Hugging Face directory.

    Args:
        dir: Directory to write (created if needed).
        tie_word_embeddings: Share `lm_head` with the embedding.
        num_kv_heads: Key/value heads (4 = MHA, 2 or 1 = GQA).
        rope_scaling: HF `rope_scaling`, e.g. Llama-3's.
        seed: Weights seed.
        vocab_size: Embedding rows; default the tokenizer's size (larger pads the embedding).
        chat_template_jinja: Save the chat template as `chat_template.jinja` instead of in
            `tokenizer_config.json`.
        add_bos_token: Prompts start with BOS (`<|endoftext|>`): `tokenizer_config.json`'s
            `add_bos_token` and a `tokenizer.json` post-processor.

    Returns:
        The directory.
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_llama_model(
        tie_word_embeddings=tie_word_embeddings,
        num_kv_heads=num_kv_heads,
        rope_scaling=rope_scaling,
        seed=seed,
        vocab_size=vocab_size,
    )
    model.save_pretrained(out)
    tokenizer = tiny_tokenizer()
    if add_bos_token:
        # Real checkpoints say it twice: the flag, and a post-processor in tokenizer.json
        # (which is what transformers' generic tokenizer class follows).
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{SPECIAL_TOKENS[ENDOFTEXT_ID]} $A",
            special_tokens=[(SPECIAL_TOKENS[ENDOFTEXT_ID], ENDOFTEXT_ID)],
        )
    tokenizer.save(str(out / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "pad_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
        "unk_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "model_max_length": 256,
    }
    if chat_template_jinja:
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    else:
        tok_config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    return out


# --- GGUF -----------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a HF Llama parameter name."""
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `convert_hf_to_gguf.py` permutation of Q/K rows (rotate-half -> pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def encode_gguf_tensor(values: np.ndarray, tensor_type: str) -> tuple[np.ndarray, Any]:
    """(array to hand GGUFWriter.add_tensor, raw_dtype) for float32 `values` in `tensor_type`."""
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if tensor_type == "F32":
        return values.astype(np.float32), None
    if tensor_type == "F16":
        return values.astype(np.float16), None
    return gguf.quants.quantize(values.astype(np.float32), qtype), qtype


def write_tiny_gguf(
    path: str | Path,
    *,
    tensor_type: str = "F32",
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    seed: int = 0,
    pre: str = "smollm",
    metadata: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write a tiny random Llama as a GGUF file the way llama.cpp's converter does (Q/K rows
    permuted, norms in F32, 2-D weights in `tensor_type`), with the tiny byte-level tokenizer.

    Returns:
        The path and the float32 HF-named tensors the file was made from.
    """
    path = Path(path)
    model = tiny_llama_model(
        tie_word_embeddings=tie_word_embeddings, num_kv_heads=num_kv_heads, seed=seed
    )
    state = state_dict_of(model)
    writer = gguf.GGUFWriter(path, "llama")
    _add_llama_metadata(writer, model.config)
    _add_byte_level_vocab(writer, tiny_tokenizer(), pre)
    for key, value in (metadata or {}).items():
        _add_value(writer, key, value)
    for name, tensor in state.items():
        values = tensor.numpy()
        if name.endswith("q_proj.weight"):
            values = permute_qk(values, NUM_HEADS)
        elif name.endswith("k_proj.weight"):
            values = permute_qk(values, num_kv_heads)
        kind = tensor_type if values.ndim == 2 else "F32"
        data, raw_dtype = encode_gguf_tensor(values, kind)
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array.astype(np.float32))
    _finish(writer)
    return path, state


def _add_llama_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)


def _add_byte_level_vocab(writer: gguf.GGUFWriter, tok: tokenizers.Tokenizer, pre: str) -> None:
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(IM_START_ID)
    writer.add_eos_token_id(IM_END_ID)
    writer.add_unk_token_id(ENDOFTEXT_ID)
    writer.add_pad_token_id(IM_END_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_sentencepiece_gguf(
    path: str | Path,
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    *,
    add_bos_token: bool | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A one-layer Llama GGUF (hidden 32, zeros) whose tokenizer is a SentencePiece vocabulary
    (`tokenizer.ggml.model == "llama"`): unk 0, bos 1, eos 2."""
    path = Path(path)
    hidden, vocab_size = 32, len(tokens)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hidden)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos_token is not None:
        writer.add_add_bos_token(add_bos_token)
    shapes = {"token_embd.weight": (vocab_size, hidden), "output_norm.weight": (hidden,)}
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        shapes[f"blk.0.{part}.weight"] = (hidden, hidden)
    shapes |= {"blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,)}
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array.astype(np.float32))
    _finish(writer)
    return path
