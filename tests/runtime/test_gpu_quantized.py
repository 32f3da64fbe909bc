"""Quantized weights on the GPU (marker `gpu`): each checkpoint format through the Triton model
against the same model with its weights dequantized to bf16, and SmolLM2 served from its own
Q4_1 bits, with and without CUDA graphs, alone and batched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sitsd.model.arch import LlamaArch
from sitsd.model.llama import LlamaModel, ServingFormat, build_weights
from sitsd.model.ops import KernelSet, triton_kernels
from sitsd.model.qlinear import int4_split_counters
from sitsd.model.weights import expected_shapes
from sitsd.quant.layout import Fp8Weight, Int4Weight, Int8Weight
from sitsd.quant.precision import PrecisionMap
from sitsd.runtime.input_batch import CachedRequestState, build_step_inputs
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.types import SamplingParams
from sitsd.weights import load_checkpoint
from tests.kernels.helpers import assert_close
from tests.model.quant_checkpoints import FORMATS, write_quantized_llama
from tests.runtime.test_gpu_runtime import QUESTIONS, chat_ids, greedy, runner_for

pytestmark = pytest.mark.gpu
BLOCK = 16
# Every linear in bf16: the dequantized model the quantized one is held against.
BF16 = PrecisionMap.from_mapping(
    {"*_proj.weight": "bf16", "lm_head.weight": "bf16", "model.embed_tokens.weight": "bf16"}
)


def triton_logits(
    arch, weights, token_ids: list[int], kernels: KernelSet | None = None
) -> torch.Tensor:
    """Logits of every position `[len, vocab]`: the prompt (all but the last four ids) as a
    prefill in two chunks, the second reading the first's KV, then four decode steps of one id
    each, through the Triton kernels (`kernels`, or the plain set) in bf16."""
    model = LlamaModel(arch, kernels or triton_kernels(), 256, "cuda")
    kv = allocate_kv_caches(arch, 8, BLOCK, torch.bfloat16, "cuda")
    prompt, follow = token_ids[:-4], token_ids[-4:]
    state = CachedRequestState("a", list(prompt), len(prompt), SamplingParams(), 0,
                               [5, 2, 7, 0, 3, 1, 6, 4], 0)  # fmt: skip
    half = len(prompt) // 2
    rows = []
    with torch.inference_mode():
        for n, next_id in ((half, None), (len(prompt) - half, None), *((1, t) for t in follow)):
            if next_id is not None:
                state.token_ids.append(next_id)
            inputs = build_step_inputs([state], {"a": n}, BLOCK, "cuda")
            hidden = model.forward(weights, inputs.input_ids, inputs.positions, inputs.meta, kv)
            rows.append(model.compute_logits(weights, hidden).float())
            state.num_computed_tokens += n
    return torch.cat(rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_on_the_gpu_gives_the_dequantized_models_logits(tmp_path, fmt, fresh_seed):
    seed = fresh_seed
    reference = write_quantized_llama(tmp_path, fmt, seed=seed)
    ckpt = load_checkpoint(tmp_path)
    weights = build_weights(ckpt.arch, ckpt.tensors, "cuda", torch.bfloat16, source=ckpt.quant)
    layout = Fp8Weight if fmt.startswith("fp8") else Int4Weight
    assert all(isinstance(w, layout) for w in list(weights.linears())[:-1])
    as_bf16 = ServingFormat(torch.device("cuda"), torch.bfloat16, BF16)
    dense = build_weights(ckpt.arch, reference, "cuda", torch.bfloat16, fmt=as_bf16)
    ids = torch.randint(3, ckpt.arch.vocab_size, (27,)).tolist()
    got = triton_logits(ckpt.arch, weights, ids)
    want = triton_logits(ckpt.arch, dense, ids)
    # FP8 on CUDA is W8A8: the activations are rounded to e4m3 per token as well.
    assert_close(got, want, torch.bfloat16, scale=4.0 if fmt.startswith("fp8") else 1.0)


def test_int4_layers_with_pdl_and_merged_splits_give_the_plain_kernels_bits(tmp_path, fresh_seed):
    # As the daemon builds them (builder.kernels_for): INT4 decode launches with PDL, their
    # split-K partials summed by each tile's last program in the runner's counters.
    write_quantized_llama(tmp_path, "awq", seed=fresh_seed)
    ckpt = load_checkpoint(tmp_path)
    weights = build_weights(ckpt.arch, ckpt.tensors, "cuda", torch.bfloat16, source=ckpt.quant)
    counters = int4_split_counters(ckpt.arch, torch.device("cuda"))
    served = triton_kernels(pdl=True, int4_split_counters=counters)
    ids = torch.randint(3, ckpt.arch.vocab_size, (27,)).tolist()
    assert torch.equal(triton_logits(ckpt.arch, weights, ids, served),
                       triton_logits(ckpt.arch, weights, ids))  # fmt: skip
    assert not counters.any()


@pytest.fixture(scope="module")
def smollm2_q4_1(smollm2_path):
    """SmolLM2 as the daemon serves it by default: the GGUF's Q4_1 (and Q8_0) bits kept."""
    return load_checkpoint(smollm2_path)


def test_smollm2_from_its_own_bits_is_identical_with_and_without_cuda_graphs(smollm2_q4_1):
    # float32 activations: in bf16 the padded graph batch and the eager one sum in other orders
    # (other kernel configurations), and a near tie flipped a greedy token 19 tokens in.
    prompts = [chat_ids(smollm2_q4_1, q) for q in QUESTIONS[:4]]
    graphs, info = runner_for(smollm2_q4_1, eager=False)
    layer = graphs.weights.layers[0]
    assert isinstance(layer.qkv_proj, Int4Weight)  # served in 4 bits, not dequantized
    assert isinstance(graphs.weights.lm_head, Int8Weight | torch.Tensor)
    assert info.graph_buckets
    with_graphs = greedy(graphs, prompts, 24)
    alone = greedy(graphs, prompts[:1], 24)[0]
    del graphs
    torch.cuda.empty_cache()
    eager, _ = runner_for(smollm2_q4_1, eager=True)
    assert eager.graphs is None
    assert greedy(eager, prompts, 24) == with_graphs
    assert alone == with_graphs[0]
    assert "Paris" in smollm2_q4_1.tokenizer.decode(with_graphs[0])


def test_int4_g128_is_served_slice_major_and_gives_the_act_order_paths_logits(fresh_seed):
    # A model whose K are multiples of 128 (hidden 256, intermediate 512), INT4 g128 at load:
    # every linear's codes slice-major on CUDA. The same weights with the flag off take the
    # kernels' generic act-order paths (x gathered through the permutation): the same model.
    arch = LlamaArch(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64,
                     max_position_embeddings=256)  # fmt: skip
    gen = torch.Generator().manual_seed(fresh_seed)
    tensors = {
        name: torch.randn(shape, generator=gen) * shape[-1] ** -0.5 if len(shape) == 2
        else 1.0 + 0.1 * torch.randn(shape, generator=gen)
        for name, shape in expected_shapes(arch).items()
    }  # fmt: skip
    int4 = PrecisionMap.from_mapping({"*_proj.weight": "int4-g128", "lm_head.weight": "bf16"})
    fmt = ServingFormat(torch.device("cuda"), torch.bfloat16, int4)
    weights = build_weights(arch, tensors, "cuda", torch.bfloat16, fmt=fmt)
    linears = [w for w in weights.linears() if isinstance(w, Int4Weight)]
    assert len(linears) == 4 * arch.num_layers
    assert all(w.slice_major for w in linears)
    generic = dataclasses.replace(weights, layers=[
        dataclasses.replace(layer, **{name: dataclasses.replace(getattr(layer, name),
                                                                slice_major=False)
                                      for name in ("qkv_proj", "o_proj", "gate_up_proj",
                                                   "down_proj")})
        for layer in weights.layers
    ])  # fmt: skip
    ids = torch.randint(3, arch.vocab_size, (27,), generator=gen).tolist()
    assert_close(triton_logits(arch, weights, ids), triton_logits(arch, generic, ids),
                 torch.bfloat16)  # fmt: skip
