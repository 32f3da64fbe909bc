"""A quantized model's logits equal the same model's with the dequantized weights in 16 bits,
within bfloat16 tolerance, for every checkpoint format: tiny random checkpoints written here
(AWQ, GPTQ, compressed-tensors, FP8; GGUF Q4_0, Q4_1, Q8_0 and Q4_K), and SmolLM2 from its
GGUF. Also: what each module becomes, modules left 16-bit, the precision map at load, and bad
input named."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sitsd.model.llama import LlamaModel, ServingFormat, build_weights
from sitsd.model.ops import cpu_kernels
from sitsd.quant.cpu import CpuInt4Weight
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Fp8Weight, Int8Weight
from sitsd.quant.precision import Precision, PrecisionMap, load_precision_map
from sitsd.quant.source import QuantSource
from sitsd.runtime.input_batch import CachedRequestState, build_step_inputs
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.types import SamplingParams
from sitsd.weights import load_checkpoint
from tests.kernels.helpers import assert_close
from tests.model.quant_checkpoints import FORMATS, write_quantized_llama
from tests.quant.test_from_gguf import random_blocks
from tests.weights.tiny_models import permute_qk, write_tiny_gguf

BLOCK = 16


@pytest.fixture
def seed(fresh_seed: int) -> int:
    """The test's seed (tests/conftest.py seeded torch and numpy with it), for the models the
    tests write."""
    return fresh_seed


# The dequantized model: every weight in bfloat16, float32 activations, as the CPU serves.
BF16 = PrecisionMap.from_mapping(
    {"*_proj.weight": "bf16", "lm_head.weight": "bf16", "model.embed_tokens.weight": "bf16"}
)


def prompt_logits(arch, weights, token_ids) -> torch.Tensor:  # [len, vocab]
    """Logits of every prompt position: a prefill in two chunks through the CPU kernels."""
    model = LlamaModel(arch, cpu_kernels(), 256, "cpu")
    kv = allocate_kv_caches(arch, 4, BLOCK, torch.float32, "cpu")
    state = CachedRequestState("a", list(token_ids), len(token_ids), SamplingParams(), 0,
                               [2, 0, 3, 1], 0)  # fmt: skip
    chunks = []
    with torch.inference_mode():
        for n in (len(token_ids) // 2, len(token_ids) - len(token_ids) // 2):
            inputs = build_step_inputs([state], {"a": n}, BLOCK, "cpu")
            hidden = model.forward(weights, inputs.input_ids, inputs.positions, inputs.meta, kv)
            chunks.append(model.compute_logits(weights, hidden))
            state.num_computed_tokens += n
    return torch.cat(chunks)


def dequantized_logits(arch, reference, token_ids) -> torch.Tensor:
    weights = build_weights(arch, reference, "cpu", torch.float32,
                            fmt=ServingFormat(precision=BF16))  # fmt: skip
    return prompt_logits(arch, weights, token_ids)


def random_prompt(vocab: int, n: int = 23) -> list[int]:
    return torch.randint(3, vocab, (n,)).tolist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_hf_quantized_checkpoint_logits_equal_the_dequantized_models(tmp_path, seed, fmt):
    reference = write_quantized_llama(tmp_path, fmt, seed=seed)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.quant is not None
    assert ckpt.quant.scheme is not None
    weights = build_weights(ckpt.arch, ckpt.tensors, "cpu", torch.float32, source=ckpt.quant)

    layout = Fp8Weight if fmt.startswith("fp8") else CpuInt4Weight
    assert all(isinstance(w, layout) for w in list(weights.linears())[:-1])
    assert isinstance(weights.lm_head, torch.Tensor)  # an unquantized lm_head stays 16-bit
    assert weights.lm_head.dtype == torch.bfloat16
    ids = random_prompt(ckpt.arch.vocab_size)
    got = prompt_logits(ckpt.arch, weights, ids)
    assert_close(got, dequantized_logits(ckpt.arch, reference, ids), torch.bfloat16)


def test_modules_to_not_convert_stay_16_bit(tmp_path, seed):
    reference = write_quantized_llama(tmp_path, "awq", seed=seed, skip=("down_proj",))
    ckpt = load_checkpoint(tmp_path)
    weights = build_weights(ckpt.arch, ckpt.tensors, "cpu", torch.float32, source=ckpt.quant)

    for layer in weights.layers:
        assert isinstance(layer.down_proj, torch.Tensor)
        assert isinstance(layer.gate_up_proj, CpuInt4Weight)
    ids = random_prompt(ckpt.arch.vocab_size)
    got = prompt_logits(ckpt.arch, weights, ids)
    assert_close(got, dequantized_logits(ckpt.arch, reference, ids), torch.bfloat16)


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_kept_quantized_logits_equal_the_dequantized_files(tmp_path, seed, tensor_type):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, seed=seed)
    ckpt = load_checkpoint(path)
    dense = load_checkpoint(path, keep_quantized=False)  # gguf.quants' own dequantization
    weights = build_weights(ckpt.arch, ckpt.tensors, "cpu", torch.float32, source=ckpt.quant)

    layout = Int8Weight if tensor_type == "Q8_0" else CpuInt4Weight
    assert all(isinstance(w, layout) for w in weights.linears())
    ids = random_prompt(ckpt.arch.vocab_size)
    got = prompt_logits(ckpt.arch, weights, ids)
    assert_close(got, dequantized_logits(ckpt.arch, dense.tensors, ids), torch.bfloat16)


def test_gguf_q4_k_modules_equal_ggufs_dequantization(seed):
    # Q4_K needs rows of 256: a model of its own shape, tensors as the GGUF loader gives them.
    from sitsd.model.arch import LlamaArch

    arch = LlamaArch(vocab_size=300, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64)  # fmt: skip
    raw, dense, types, heads = {}, {}, {}, {}
    for name, shape in build_shapes(arch).items():
        if len(shape) == 2 and "embed" not in name:
            blocks = random_blocks(gguf.GGMLQuantizationType.Q4_K, shape[0], shape[1])
            scales = blocks.reshape(shape[0], -1, 144)[..., 0:4].view(np.float16)  # d, dmin
            scales /= 128  # weights of order 0.05, as a trained model's (sub-scales reach 63)
            values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
            raw[name] = torch.from_numpy(blocks)
            types[name] = int(gguf.GGMLQuantizationType.Q4_K)
            n = arch.num_heads if "q_proj" in name else arch.num_kv_heads
            if "q_proj" in name or "k_proj" in name:
                heads[name] = n
                values = unpermute(values, n)
            dense[name] = torch.from_numpy(np.ascontiguousarray(values))
        else:
            dense[name] = raw[name] = 1.0 + 0.1 * torch.randn(shape)
    source = QuantSource(gguf_types=types, gguf_qk_heads=heads)
    weights = build_weights(arch, raw, "cpu", torch.float32, source=source)

    ids = random_prompt(arch.vocab_size)
    # 1.5x the 16-bit tolerances: the reference rounds each dequantized weight to bfloat16,
    # and through two layers 256 wide its error passed the element bound at a near-zero logit
    # for 1 seed in 40 (1.05x; the relative norm at half its bound).
    assert_close(prompt_logits(arch, weights, ids), dequantized_logits(arch, dense, ids),
                 torch.bfloat16, scale=1.5)  # fmt: skip


def build_shapes(arch):
    from sitsd.model.llama import expected_shapes

    return expected_shapes(arch)


def unpermute(values: np.ndarray, num_heads: int) -> np.ndarray:
    from sitsd.weights.gguf_file import unpermute_qk

    return unpermute_qk(values, num_heads)


@pytest.mark.slow
def test_smollm2_from_its_q4_1_gguf_matches_its_dequantized_weights(smollm2_quantized, smollm2):
    arch = smollm2.arch
    tok = smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(text, add_special_tokens=False)[:60]
    weights = build_weights(arch, smollm2_quantized.tensors, "cpu", torch.float32,
                            source=smollm2_quantized.quant)  # fmt: skip
    assert weights.precision == "int4-g32; lm_head bf16, embedding bf16"
    got = prompt_logits(arch, weights, ids)
    want = dequantized_logits(arch, smollm2.tensors, ids)
    # 30 layers of bfloat16 rounding (x in each int4 GEMM, the logits of both): the relative
    # error of one bfloat16 op (tests.kernels.helpers: 1.6e-2) per model, with room for depth.
    assert ((got - want).norm() / want.norm()).item() < 3e-2
    # The next tokens agree where the reference's top two are not a near-tie (35 of these 37
    # positions as measured; a wrong layout agrees on almost none).
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_precision_map_at_load_quantizes_16_bit_modules_by_glob(tmp_path, seed):
    from tests.weights.tiny_models import tiny_llama_model

    model = tiny_llama_model(seed=seed)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    arch_dir = tmp_path / "m"
    from tests.weights.tiny_models import write_tiny_llama

    write_tiny_llama(arch_dir, seed=seed)
    arch = load_checkpoint(arch_dir, load_tensors=False).arch
    (tmp_path / "map.yaml").write_text(
        '"*.mlp.*": int4-g32\n"*.o_proj.weight": bf16\n"*.self_attn.*": fp8\n'
    )
    fmt = ServingFormat(precision=load_precision_map(str(tmp_path / "map.yaml")))
    weights = build_weights(arch, state, "cpu", torch.float32, fmt=fmt)

    for layer in weights.layers:
        assert isinstance(layer.gate_up_proj, CpuInt4Weight)
        assert isinstance(layer.down_proj, CpuInt4Weight)
        assert isinstance(layer.qkv_proj, Fp8Weight)
        assert isinstance(layer.o_proj, torch.Tensor)
        assert layer.o_proj.dtype == torch.bfloat16
    assert weights.lm_head.dtype == torch.bfloat16  # a CPU serving quantized layers
    assert "int4-g32 x4, fp8 x2, bf16 x2" in weights.precision


def test_symmetric_int4_words_quantize_without_zero_points(tmp_path, seed):
    # `int4-sym` / `int4-g32-sym`: RTN with zero point 8 (GPTQ's sym format), not a zero point
    # per group; other kinds take no -sym, and the word keeps its spelling in messages.
    from sitsd.quant.cpu import int4_cpu_matmul
    from sitsd.quant.precision import parse_precision
    from sitsd.quant.rtn import quantize_int4
    from tests.weights.tiny_models import tiny_llama_model, write_tiny_llama

    assert parse_precision("int4-sym") == Precision("int4", 128, True)
    assert parse_precision("INT4-G64-SYM") == Precision("int4", 64, True)
    assert str(parse_precision("int4-g32-sym")) == "int4-g32-sym"
    assert str(parse_precision("int4-g32")) == "int4-g32"
    for bad in ("fp8-sym", "int8-sym", "int4-sym-g64", "int4-g48-sym"):
        with pytest.raises(QuantFormatError, match=repr(bad)):
            parse_precision(bad)
    assert load_precision_map("int4-g64-sym").precision_for("lm_head.weight") == Precision(
        "int4", 64, True
    )
    with pytest.raises(QuantFormatError, match=r"'fp8-sym' is neither a file nor a precision "
                       r"\(int4, int8, fp8, bf16, fp16; int4 may name its group size and end in "
                       r"-sym"):  # fmt: skip
        load_precision_map("fp8-sym")
    model = tiny_llama_model(seed=seed)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_tiny_llama(tmp_path / "m", seed=seed)
    arch = load_checkpoint(tmp_path / "m", load_tensors=False).arch
    x = torch.randn(3, arch.intermediate_size)
    dense = state["model.layers.0.mlp.down_proj.weight"].float()
    products = {}
    for word in ("int4-g32-sym", "int4-g32"):
        precision = PrecisionMap.from_mapping({"*.mlp.*": word}, "map.yaml")
        weights = build_weights(arch, state, "cpu", torch.float32,
                                fmt=ServingFormat(precision=precision))  # fmt: skip
        products[word] = int4_cpu_matmul(x, weights.layers[0].down_proj)
        assert f"{word} x" in weights.precision  # as `sitsctl versions` shows it
    for word, symmetric in (("int4-g32-sym", True), ("int4-g32", False)):
        codes = quantize_int4(dense, 32, symmetric=symmetric)
        assert (codes.zeros is None) == symmetric
        assert_close(products[word], x @ codes.dequantize().T, torch.bfloat16)
    assert not torch.allclose(products["int4-g32-sym"], products["int4-g32"], atol=1e-3)


def test_a_precision_map_that_splits_a_fused_weight_or_quantizes_a_norm_is_refused(seed):
    from tests.weights.tiny_models import state_dict_of, tiny_llama_model

    model = tiny_llama_model(seed=seed)
    state = state_dict_of(model)
    from sitsd.model.arch import arch_from_hf_config

    arch = arch_from_hf_config(model.config.to_dict())
    split = PrecisionMap.from_mapping({"*.q_proj.weight": "int4-g32"}, "map.yaml")
    with pytest.raises(QuantFormatError, match=r"q_proj.*k_proj.*share one"):
        build_weights(arch, state, "cpu", torch.float32, fmt=ServingFormat(precision=split))
    norm = PrecisionMap.from_mapping({"*norm.weight": "int8"}, "map.yaml")
    with pytest.raises(QuantFormatError, match=r"input_layernorm\.weight is not a linear weight"):
        build_weights(arch, state, "cpu", torch.float32, fmt=ServingFormat(precision=norm))


def test_a_gguf_permuted_row_order_is_undone_on_quantized_rows(tmp_path, seed):
    # The raw Q/K bytes are in llama.cpp's order; converted and reordered, the layout's W is
    # the HF order: the same as the dequantized tensors the loader unpermutes.
    path, source = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="Q8_0", seed=seed)
    ckpt = load_checkpoint(path)
    dense = load_checkpoint(path, keep_quantized=False)
    name = "model.layers.1.self_attn.q_proj"
    w = ckpt.quant.convert(ckpt.tensors, name, tuple(source[name + ".weight"].shape), "cpu")
    assert torch.equal(w.dequantize(), dense.tensors[name + ".weight"])
    assert not torch.equal(w.dequantize(), torch.from_numpy(permute_qk(
        dense.tensors[name + ".weight"].numpy(), 4)))  # fmt: skip


def test_bad_quantized_tensors_are_named(tmp_path, seed):
    write_quantized_llama(tmp_path, "gptq", seed=seed)
    ckpt = load_checkpoint(tmp_path)
    tensors = dict(ckpt.tensors)
    name = "model.layers.1.mlp.up_proj.scales"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 3] = float("nan")
    with pytest.raises(QuantFormatError, match=r"model.layers.1.mlp.up_proj.scales holds NaN"):
        build_weights(ckpt.arch, tensors, "cpu", torch.float32, source=ckpt.quant)
    tensors = dict(ckpt.tensors)
    name = "model.layers.0.self_attn.o_proj.qweight"
    tensors[name] = tensors[name][:-1]
    with pytest.raises(QuantFormatError, match=r"o_proj.qweight has shape \(7, 64\), expected"):
        build_weights(ckpt.arch, tensors, "cpu", torch.float32, source=ckpt.quant)
