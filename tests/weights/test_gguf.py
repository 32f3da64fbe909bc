"""Loading GGUF files: metadata -> arch, dequantized tensors under HF names, Q/K un-permutation."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sitsd.weights import CheckpointError, load_checkpoint
from sitsd.weights.gguf_file import (
    llama3_freq_factors,
    llama3_scaling_from_freq_factors,
    read_gguf_header,
    unpermute_qk,
)
from tests.weights.tiny_models import (
    NUM_HEADS,
    encode_gguf_tensor,
    permute_qk,
    tiny_tokenizer,
    write_tiny_gguf,
)

# Worst-case error of each type, as a fraction of the tensor's largest magnitude.
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 5e-3, "Q4_0": 0.13, "Q4_1": 0.07}


@pytest.mark.parametrize("tensor_type", list(TOLERANCE))
def test_dequantized_tensors_match_the_source_within_the_type_tolerance(
    tmp_path, seed, tensor_type
):
    path, source = write_tiny_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, seed=seed)

    ckpt = load_checkpoint(path, keep_quantized=False)

    assert set(ckpt.tensors) == set(source)
    for name, want in source.items():
        got = ckpt.tensors[name]
        assert got.dtype == torch.float32, name
        assert got.shape == want.shape, name
        bound = TOLERANCE[tensor_type if want.ndim == 2 else "F32"] * want.abs().max().item()
        assert (got - want).abs().max().item() <= bound, name


@pytest.mark.parametrize("tensor_type", ["BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantization_is_exactly_ggufs_round_trip(tmp_path, seed, tensor_type):
    path, source = write_tiny_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, seed=seed)

    ckpt = load_checkpoint(path, keep_quantized=False)

    for name in (
        "model.embed_tokens.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ):
        data, qtype = encode_gguf_tensor(source[name].numpy(), tensor_type)
        want = torch.from_numpy(gguf.quants.dequantize(data, qtype))
        assert torch.equal(ckpt.tensors[name], want), name


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_q_and_k_rows_come_back_in_hf_order(tmp_path, seed, num_kv_heads):
    path, source = write_tiny_gguf(tmp_path / "m.gguf", num_kv_heads=num_kv_heads, seed=seed)

    ckpt = load_checkpoint(path)

    for layer in range(2):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(ckpt.tensors[name], source[name]), name


def test_unpermute_inverts_llama_cpp_permutation_for_any_head_count():
    rng = np.random.default_rng()
    num_heads = int(rng.integers(1, 9))
    head_dim = 2 * int(rng.integers(1, 9))
    weight = rng.standard_normal((num_heads * head_dim, int(rng.integers(1, 40))))

    permuted = permute_qk(weight, num_heads)

    assert not np.array_equal(permuted, weight) or head_dim == 2
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), weight)


def test_tensors_equal_what_transformers_loads_from_the_same_gguf(tmp_path, seed):
    from transformers import AutoModelForCausalLM

    path, _ = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="Q4_1", seed=seed)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    want = hf.state_dict()

    ckpt = load_checkpoint(path, keep_quantized=False)

    for name, tensor in ckpt.tensors.items():
        assert torch.equal(tensor, want[name]), name


def test_missing_output_tensor_means_tied_embeddings(tmp_path, seed):
    path, source = write_tiny_gguf(tmp_path / "m.gguf", tie_word_embeddings=True, seed=seed)

    ckpt = load_checkpoint(path)

    assert ckpt.arch.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.tensors
    assert torch.equal(
        ckpt.tensors["model.embed_tokens.weight"], source["model.embed_tokens.weight"]
    )


def test_untied_output_tensor_becomes_lm_head(tmp_path, seed):
    path, source = write_tiny_gguf(tmp_path / "m.gguf", seed=seed)

    ckpt = load_checkpoint(path)

    assert not ckpt.arch.tie_word_embeddings
    assert torch.equal(ckpt.tensors["lm_head.weight"], source["lm_head.weight"])


def test_arch_comes_from_gguf_metadata(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", num_kv_heads=1, seed=seed)

    arch = load_checkpoint(path, load_tensors=False).arch

    assert (arch.hidden_size, arch.intermediate_size, arch.num_layers) == (64, 128, 2)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (NUM_HEADS, 1, 16)
    assert arch.vocab_size == tiny_tokenizer().get_vocab_size()
    assert arch.rope_theta == 10000.0
    assert arch.rms_norm_eps == 1e-6
    assert arch.max_position_embeddings == 256
    assert arch.rope_scaling is None


def test_load_tensors_false_reads_no_tensor_data(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", seed=seed)

    ckpt = load_checkpoint(path, load_tensors=False)

    assert ckpt.tensors == {}
    assert ckpt.tokenizer.encode("hello")


@pytest.mark.parametrize(
    ("metadata", "want"),
    [
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
            {"rope_type": "linear", "factor": 4.0},
        ),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 2.0,
                "llama.rope.scaling.original_context_length": 128,
            },
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
        ),
    ],
)
def test_rope_scaling_metadata_becomes_hf_rope_scaling(tmp_path, seed, metadata, want):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", seed=seed, metadata=metadata)

    assert load_checkpoint(path, load_tensors=False).arch.rope_scaling == want


@pytest.mark.parametrize(
    "params", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (4.0, 1.0, 2.0, 1024)]
)
def test_llama3_rope_freqs_are_recovered_as_rope_scaling(tmp_path, params):
    factor, low, high, ctx = params
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": ctx,
    }
    theta, head_dim = 500000.0, 128
    freqs = llama3_freq_factors(scaling, theta, head_dim).astype(np.float32)

    got = llama3_scaling_from_freq_factors(freqs, theta, head_dim, tmp_path)

    # (ctx, low, high) and (2 ctx, 2 low, 2 high) give the same frequencies: compare those.
    assert got["factor"] == factor
    np.testing.assert_allclose(llama3_freq_factors(got, theta, head_dim), freqs, rtol=1e-5)


def test_rope_freqs_tensor_is_folded_into_the_arch(tmp_path, seed):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    freqs = llama3_freq_factors(scaling, 10000.0, 16)  # [head_dim // 2]
    path, _ = write_tiny_gguf(
        tmp_path / "m.gguf", seed=seed, extra_tensors={"rope_freqs.weight": freqs}
    )

    ckpt = load_checkpoint(path)

    assert ckpt.arch.rope_scaling == scaling
    assert not any("rope" in name for name in ckpt.tensors)


def test_header_parser_agrees_with_gguf_reader(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="Q8_0", seed=seed)
    reader = gguf.GGUFReader(path)

    header = read_gguf_header(path)

    for field in reader.fields.values():
        if not field.name.startswith("GGUF."):
            want = field.contents()
            got = header.metadata[field.name]
            assert got == pytest.approx(want) if isinstance(want, float) else got == want
    assert set(header.tensors) == {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        info = header.tensors[tensor.name]
        assert info.shape == tuple(reversed(tensor.shape.tolist()))
        assert info.ggml_type == tensor.tensor_type
        assert (info.offset, info.num_bytes) == (tensor.data_offset, tensor.n_bytes)


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_linear_weights_of_served_types_stay_raw_bytes_and_the_embedding_is_dequantized(
    tmp_path, seed, tensor_type
):
    path, source = write_tiny_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, seed=seed)

    ckpt = load_checkpoint(path)

    assert ckpt.quant is not None
    linear = {n for n, t in source.items() if t.ndim == 2 and "embed_tokens" not in n}
    assert set(ckpt.quant.gguf_types) == linear
    assert set(ckpt.quant.gguf_qk_heads) == {n for n in linear if "q_proj" in n or "k_proj" in n}
    for name in linear:
        raw = ckpt.tensors[name]
        data, _ = encode_gguf_tensor(source[name].numpy(), tensor_type)
        assert raw.dtype == torch.uint8
        assert raw.shape[0] == source[name].shape[0], name
        if "q_proj" not in name and "k_proj" not in name:
            assert np.array_equal(raw.numpy(), data.reshape(raw.shape)), name
    assert ckpt.tensors["model.embed_tokens.weight"].dtype == torch.float32


def test_other_quantized_types_are_dequantized_with_a_log_line(tmp_path, seed, caplog):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="Q5_1", seed=seed)

    with caplog.at_level("INFO", logger="sitsd.weights.gguf_file"):
        ckpt = load_checkpoint(path)

    assert ckpt.quant is not None
    assert not ckpt.quant.gguf_types
    assert ckpt.tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    assert "tensors of type Q5_1 dequantized to float32" in caplog.text


def test_unsupported_tensor_type_is_named(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="Q4_0", seed=seed)
    # IQ4_NL has Q4_0's block size (32 weights, 18 bytes), so only the type id changes.
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # after the name, n_dims, two dims
    assert int.from_bytes(data[at : at + 4], "little") == gguf.GGMLQuantizationType.Q4_0
    data[at : at + 4] = int(gguf.GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")
    path.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=r"blk.0.ffn_up.weight is stored as IQ4_NL.*Q4_K"):
        load_checkpoint(path)


def test_truncated_gguf_is_a_checkpoint_error(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", seed=seed)
    data = path.read_bytes()

    for size in (10, len(data) // 50, len(data) - 100):
        path.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=r"truncated|corrupt"):
            load_checkpoint(path)


def test_file_with_gguf_suffix_but_other_content_is_refused(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))

    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_checkpoint(path)


def test_non_llama_architecture_is_refused(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", seed=seed)
    data = bytearray(path.read_bytes())
    # Same length, so every offset in the file stays valid.
    start = data.index(b"general.architecture") + len("general.architecture") + 4 + 8
    data[start : start + 5] = b"bloom"
    path.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match="'bloom' is not supported"):
        load_checkpoint(path)
