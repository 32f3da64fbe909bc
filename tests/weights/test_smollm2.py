"""The embedded SmolLM2-135M-Instruct GGUF: architecture, tokenizer and chat template agree with
transformers' reading of the same file, and so do the dequantized, un-permuted tensors."""

from __future__ import annotations

import random
import re

import pytest
import torch

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "   leading spaces, double  spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "\u4f60\u597d\uff0c\u4e16\u754c \U0001f600\U0001f680 caf\u00e9 na\u00efve \u00bd",
    "def f(x):\n    return {'a': [1, 2, 3]}[x] // 2  # comment",
    "digits 0123456789 3.14159 2024-11-29 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]
ASCII_TEXTS = [t for t in ROUND_TRIP_TEXTS if t.isascii()] + [
    "The capital of France is Paris.",
    "SELECT * FROM users WHERE id = 42;",
    "I'm sure it's you'll've they'd",
]


def random_ascii(rng: random.Random) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 \n\t.,;:!?'\"()[]{}<>-_=+*/#@$%&"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 120)))


def test_arch_is_smollm2_135m(smollm2):
    arch = smollm2.arch

    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert (arch.hidden_size, arch.intermediate_size, arch.vocab_size) == (576, 1536, 49152)
    assert arch.tie_word_embeddings
    assert arch.rope_theta == 100000.0
    assert arch.max_position_embeddings == 8192
    assert (smollm2.format, smollm2.name) == ("gguf", "SmolLM2-135M-Instruct.Q4_1")


def test_every_tensor_is_float32_with_its_hf_shape(smollm2):
    from sitsd.model.llama import expected_shapes

    shapes = expected_shapes(smollm2.arch)

    assert set(smollm2.tensors) == set(shapes)
    for name, tensor in smollm2.tensors.items():
        assert tensor.dtype == torch.float32, name
        assert tuple(tensor.shape) == shapes[name], name


def test_tokenizer_round_trips_text(smollm2, seed):
    tok = smollm2.tokenizer
    rng = random.Random(seed)

    for text in ROUND_TRIP_TEXTS + [random_ascii(rng) for _ in range(20)]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_eos(smollm2):
    tok = smollm2.tokenizer

    assert tok.bos_token_id == 1
    assert 2 in tok.eos_token_ids  # <|im_end|>
    assert tok.eos_token_ids[0] == 2
    assert not tok.add_bos_token
    assert tok.special_token_ids >= set(range(17))
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]


@pytest.mark.slow  # transformers' GGUF conversion
def test_token_ids_equal_transformers_gguf_tokenizer(smollm2, smollm2_hf_tokenizer, seed):
    rng = random.Random(seed)
    # transformers' GGUF conversion has no digit split for SmolLM2: it differs from the model's
    # own tokenizer (and llama.cpp) where whitespace runs into a digit, so keep those apart.
    texts = [re.sub(r"(\s)(?=\d)", r"\1x", random_ascii(rng)) for _ in range(30)]
    for text in ASCII_TEXTS + texts:
        assert smollm2.tokenizer.encode(text) == smollm2_hf_tokenizer.encode(text), text


def test_digits_split_from_whitespace_as_the_models_own_tokenizer_does(smollm2):
    tok = smollm2.tokenizer
    # SmolLM2's tokenizer.json isolates digits before the byte-level regex: "\n\n" stays one
    # token in front of "9" (plain GPT-2 pre-tokenization would give "\n" + "\n9"-style pieces).
    ids = tok.encode("a\n\n9", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["a", "\n\n", "9"]


@pytest.mark.slow  # transformers' GGUF conversion
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
    ],
    ids=["one-user-turn", "system-multi-turn"],
)
def test_chat_template_renders_like_transformers(smollm2, smollm2_hf_tokenizer, messages):
    ours = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    theirs = smollm2_hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    want_ids = smollm2_hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )

    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    assert smollm2.tokenizer.encode(ours, add_special_tokens=False) == list(want_ids)


@pytest.mark.slow  # transformers' GGUF conversion
def test_dequantized_tensors_equal_transformers_gguf_load(smollm2, smollm2_hf_model):
    """The Q/K un-permutation check: transformers reverses llama.cpp's permutation too."""
    want = smollm2_hf_model.state_dict()

    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{layer}.{part}.weight"
        for layer in (0, 13, 29)
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ]
    for name in names:
        assert (smollm2.tensors[name] - want[name]).abs().max().item() == 0.0, name


def test_writing_a_version_from_kept_quantized_tensors_is_refused(smollm2_quantized, tmp_path):
    """Raw GGUF bytes written as plain tensors would be a version that loads as garbage."""
    from sitsd.weights.export import write_version

    with pytest.raises(ValueError, match="keep_quantized=False"):
        write_version(smollm2_quantized, tmp_path / "v")
    assert not (tmp_path / "v").exists()


def test_a_version_written_from_the_dequantized_model_loads_back_equal(smollm2, tmp_path):
    from sitsd.weights import load_checkpoint
    from sitsd.weights.export import write_version

    write_version(smollm2, tmp_path / "v")
    back = load_checkpoint(tmp_path / "v")
    assert back.arch == smollm2.arch
    assert back.tensors.keys() == smollm2.tensors.keys()
    name = random.choice(sorted(smollm2.tensors))
    assert torch.equal(back.tensors[name], smollm2.tensors[name]), name


def test_dense_tensors_of_the_kept_q4_1_equal_the_loaders_dequantization(
    smollm2, smollm2_quantized
):
    from sitsd.weights.reference_llama import dense_tensors

    q = smollm2_quantized
    dense = dense_tensors(q.arch, q.tensors, q.quant)
    assert dense.keys() == smollm2.tensors.keys()
    for name, tensor in dense.items():
        assert torch.equal(tensor, smollm2.tensors[name]), name
