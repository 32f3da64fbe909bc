"""Loading Hugging Face model directories: tensors, architecture, tokenizer files, templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sitsd.model.llama import expected_shapes
from sitsd.weights import CheckpointError, load_checkpoint
from tests.weights.tiny_models import (
    CHAT_TEMPLATE,
    IM_END_ID,
    tiny_llama_model,
    tiny_tokenizer,
    write_tiny_llama,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_every_tensor_loads_under_its_hf_name_with_its_values(tiny_llama_dir, seed):
    ckpt = load_checkpoint(tiny_llama_dir)
    want = tiny_llama_model(seed=seed).state_dict()

    assert set(ckpt.tensors) == set(want)
    for name, tensor in ckpt.tensors.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, want[name]), name


def test_arch_fields_come_from_config_json(tiny_llama_dir):
    arch = load_checkpoint(tiny_llama_dir).arch

    assert (arch.hidden_size, arch.intermediate_size, arch.num_layers) == (64, 128, 2)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.vocab_size == tiny_tokenizer().get_vocab_size()
    assert arch.rms_norm_eps == pytest.approx(1e-6)
    assert arch.max_position_embeddings == 256
    assert not arch.tie_word_embeddings
    assert arch.rope_scaling is None


def test_checkpoint_records_format_name_and_files(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir)

    assert (ckpt.format, ckpt.name, ckpt.path) == ("hf", "tiny-llama", tiny_llama_dir)
    names = {f.name for f in ckpt.files}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    assert all(f.is_file() for f in ckpt.files)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_k_and_v_projections_have_num_kv_heads_rows(tmp_path, seed, num_kv_heads):
    ckpt = load_checkpoint(write_tiny_llama(tmp_path / "m", num_kv_heads=num_kv_heads, seed=seed))

    assert ckpt.arch.num_kv_heads == num_kv_heads
    for proj in ("k_proj", "v_proj"):
        shape = ckpt.tensors[f"model.layers.1.self_attn.{proj}.weight"].shape
        assert tuple(shape) == (num_kv_heads * 16, 64)
    assert tuple(ckpt.tensors["model.layers.1.self_attn.q_proj.weight"].shape) == (64, 64)


def test_tied_embeddings_have_no_lm_head(tmp_path, seed):
    ckpt = load_checkpoint(write_tiny_llama(tmp_path / "m", tie_word_embeddings=True, seed=seed))

    assert ckpt.arch.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.tensors
    assert set(ckpt.tensors) == set(expected_shapes(ckpt.arch))


def test_untied_lm_head_is_its_own_tensor(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir)

    embed = ckpt.tensors["model.embed_tokens.weight"]
    assert not torch.equal(ckpt.tensors["lm_head.weight"], embed)


def test_llama3_rope_scaling_reaches_the_arch(tmp_path, seed):
    ckpt = load_checkpoint(write_tiny_llama(tmp_path / "m", rope_scaling=LLAMA3_SCALING, seed=seed))

    scaling = ckpt.arch.rope_scaling
    assert scaling is not None
    assert {k: scaling[k] for k in LLAMA3_SCALING} == LLAMA3_SCALING


def test_safetensors_are_memory_mapped_in_their_saved_dtype(tmp_path, seed):
    model_dir = write_tiny_llama(tmp_path / "m", seed=seed)
    weights = model_dir / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)

    ckpt = load_checkpoint(model_dir)

    embed = ckpt.tensors["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16
    assert not embed.untyped_storage().resizable()  # a file mapping, not a heap copy


def test_sharded_checkpoint_loads_through_its_index(tmp_path, seed):
    model_dir = write_tiny_llama(tmp_path / "m", seed=seed)
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, model_dir / file)
    weight_map = {n: f for f, part in shards.items() for n in part}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    ckpt = load_checkpoint(model_dir)

    assert set(ckpt.tensors) == set(tensors)
    assert all(torch.equal(ckpt.tensors[n], tensors[n]) for n in names)
    assert {f.name for f in ckpt.files} >= {*shards, "model.safetensors.index.json"}


def test_missing_shard_named_by_the_index_is_an_error(tmp_path, seed):
    model_dir = write_tiny_llama(tmp_path / "m", seed=seed)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        load_checkpoint(model_dir)


def test_tensor_missing_from_the_weights_is_named(tmp_path, seed):
    model_dir = write_tiny_llama(tmp_path / "m", seed=seed)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")

    with pytest.raises(CheckpointError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(model_dir)


def test_tensor_with_wrong_shape_is_named(tmp_path, seed):
    model_dir = write_tiny_llama(tmp_path / "m", seed=seed)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, model_dir / "model.safetensors")

    with pytest.raises(CheckpointError, match=r"wrong shape model\.layers\.0\.self_attn\.k_proj"):
        load_checkpoint(model_dir)


def test_load_tensors_false_reads_arch_and_tokenizer_only(tiny_llama_dir):
    (tiny_llama_dir / "model.safetensors").write_bytes(b"not read")

    ckpt = load_checkpoint(tiny_llama_dir, load_tensors=False)

    assert ckpt.tensors == {}
    assert ckpt.arch.num_layers == 2
    assert ckpt.tokenizer.encode("hello", add_special_tokens=False)
    assert tiny_llama_dir / "model.safetensors" in ckpt.files


def test_chat_template_comes_from_tokenizer_config(tiny_llama_dir):
    tok = load_checkpoint(tiny_llama_dir, load_tensors=False).tokenizer

    assert tok.has_chat_template
    assert tok.chat_template == CHAT_TEMPLATE


def test_chat_template_jinja_file_is_read(tmp_path, seed):
    model_dir = write_tiny_llama(tmp_path / "m", chat_template_jinja=True, seed=seed)
    assert "chat_template" not in json.loads((model_dir / "tokenizer_config.json").read_text())

    ckpt = load_checkpoint(model_dir, load_tensors=False)

    assert ckpt.tokenizer.chat_template == CHAT_TEMPLATE
    assert model_dir / "chat_template.jinja" in ckpt.files


def test_default_template_is_picked_from_a_list_of_named_templates(tiny_llama_dir):
    config_file = tiny_llama_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT"},
    ]
    config_file.write_text(json.dumps(config))

    tok = load_checkpoint(tiny_llama_dir, load_tensors=False).tokenizer

    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "DEFAULT"


def test_generation_config_eos_list_joins_the_eos_ids(tiny_llama_dir):
    (tiny_llama_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))

    tok = load_checkpoint(tiny_llama_dir, load_tensors=False).tokenizer

    assert tok.eos_token_ids[0] == IM_END_ID
    assert set(tok.eos_token_ids) >= {IM_END_ID, 7}


def test_config_without_a_supported_model_type_is_refused(tiny_llama_dir):
    config_file = tiny_llama_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["model_type"] = "gpt_neox"
    config_file.write_text(json.dumps(config))

    with pytest.raises(CheckpointError, match="gpt_neox"):
        load_checkpoint(tiny_llama_dir)


def test_tokenizer_larger_than_the_embedding_is_refused(tiny_llama_dir: Path):
    config_file = tiny_llama_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["vocab_size"] = 100
    config_file.write_text(json.dumps(config))

    with pytest.raises(CheckpointError, match="100 rows"):
        load_checkpoint(tiny_llama_dir, load_tensors=False)
