"""The CUDA runtime: Triton kernels in the model, CUDA graphs, KV sizing (marker `gpu`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sitsd.builder import build_runner
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig
from sitsd.model.arch import arch_from_hf_config
from sitsd.model.llama import LlamaModel, build_weights
from sitsd.model.ops import triton_kernels
from sitsd.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from sitsd.runtime.input_batch import CachedRequestState, build_step_inputs
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.types import SamplingParams
from sitsd.weights import load_checkpoint

pytestmark = pytest.mark.gpu
BLOCK = 16


def tiny_hf(num_kv_heads=2):
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=num_kv_heads, vocab_size=1000,
                      max_position_embeddings=2048)  # fmt: skip
    torch.manual_seed(random.randrange(2**31))
    return LlamaForCausalLM(cfg).eval().cuda(), arch_from_hf_config(cfg.to_dict())


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
def test_triton_model_logits_match_transformers(dtype, atol, num_kv_heads):
    hf, arch = tiny_hf(num_kv_heads)
    weights = build_weights(arch, hf.state_dict(), "cuda", dtype)
    model = LlamaModel(arch, triton_kernels(), 2048, "cuda")
    kv = allocate_kv_caches(arch, 64, BLOCK, dtype, "cuda")
    ids = [random.randrange(arch.vocab_size) for _ in range(301)]
    blocks = random.sample(range(64), 20)
    state = CachedRequestState("a", ids, len(ids), SamplingParams(), 0, blocks, 0)
    logits = []
    with torch.inference_mode():
        for n in (128, 173):  # chunked prefill over a cached prefix, then decode steps
            inp = build_step_inputs([state], {"a": n}, BLOCK, "cuda")
            hidden = model.forward(weights, inp.input_ids, inp.positions, inp.meta, kv)
            logits.append(model.compute_logits(weights, hidden))
            state.num_computed_tokens += n
        for _ in range(5):
            state.token_ids.append(random.randrange(arch.vocab_size))
            inp = build_step_inputs([state], {"a": 1}, BLOCK, "cuda")
            hidden = model.forward(weights, inp.input_ids, inp.positions, inp.meta, kv)
            logits.append(model.compute_logits(weights, hidden))
            state.num_computed_tokens += 1
        want = hf.float()(torch.tensor([state.token_ids], device="cuda")).logits[0]
    got = torch.cat(logits)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


def runner_for(ckpt, *, eager, dtype="float32", max_num_seqs=16, pdl=None, max_model_len=1024):
    cfg = SitsdConfig(
        model=ModelConfig(
            device="cuda", dtype=dtype, enforce_eager=eager, max_model_len=max_model_len, pdl=pdl
        ),
        cache=CacheConfig(gpu_memory_utilization=0.5, gpu_memory_limit=16 * 2**30),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
    )
    return build_runner(cfg, ckpt.arch, ckpt.tensors, "test", ckpt.quant)


def greedy(runner, prompts, num_new):
    """Run requests to `num_new` tokens each with the runner alone (no scheduler)."""
    block_ids = iter(range(10_000))
    params = SamplingParams(max_tokens=num_new, temperature=0.0)
    reqs = {f"r{i}": p for i, p in enumerate(prompts)}
    blocks = {r: [next(block_ids) for _ in range(-(-(len(p) + num_new) // BLOCK))]
              for r, p in reqs.items()}  # fmt: skip
    new = [NewRequestData(r, list(p), len(p), params, 0, blocks[r], 0, runner.weights_version)
           for r, p in reqs.items()]  # fmt: skip
    out = runner.execute(SchedulerOutput(
        new_reqs=new, num_scheduled_tokens={r: len(p) for r, p in reqs.items()},
        total_num_scheduled_tokens=sum(map(len, reqs.values()))))  # fmt: skip
    tokens = {r: list(t) for r, t in zip(out.req_ids, out.sampled_token_ids)}
    for _ in range(num_new - 1):
        cached = [CachedRequestData(r, [], len(reqs[r]) + len(tokens[r]) - 1) for r in reqs]
        out = runner.execute(
            SchedulerOutput(
                cached_reqs=cached,
                num_scheduled_tokens=dict.fromkeys(reqs, 1),
                total_num_scheduled_tokens=len(reqs),
            )
        )
        for r, t in zip(out.req_ids, out.sampled_token_ids):
            tokens[r] += t
    runner.execute(SchedulerOutput(finished_req_ids=set(reqs)))
    return [tokens[r] for r in reqs]


@pytest.fixture(scope="module")
def smollm2_on_gpu(smollm2_path):
    # 16-bit serving: the GGUF's Q4_1 weights dequantized (quantized serving has its own tests).
    return load_checkpoint(smollm2_path, keep_quantized=False)


def chat_ids(ckpt, question):
    tok = ckpt.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}])
    return tok.encode(text, add_special_tokens=False)


QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count to ten.",
             "Why is the sky blue?", "Write a haiku about rain.", "What is 12 times 12?",
             "Say hello in Spanish.", "Describe a cat."]  # fmt: skip


def test_smollm2_greedy_is_identical_with_and_without_cuda_graphs(smollm2_on_gpu):
    prompts = [chat_ids(smollm2_on_gpu, q) for q in QUESTIONS[:4]]
    graphs, info = runner_for(smollm2_on_gpu, eager=False)
    assert info.graph_buckets
    assert graphs.graphs is not None
    with_graphs = greedy(graphs, prompts, 32)
    del graphs
    torch.cuda.empty_cache()
    eager, info = runner_for(smollm2_on_gpu, eager=True)
    assert not info.graph_buckets
    assert eager.graphs is None
    assert greedy(eager, prompts, 32) == with_graphs
    text = smollm2_on_gpu.tokenizer.decode(with_graphs[0])
    assert "Paris" in text


def test_smollm2_greedy_is_identical_with_and_without_pdl(smollm2_on_gpu):
    """bf16, CUDA graphs: the decode kernels launched with programmatic dependent launch (the
    sm_90+ default) against plain launches. The second runner's context (256) is shorter than
    its batch budget (512): the start-up profiling step splits its tokens."""
    prompts = [chat_ids(smollm2_on_gpu, q) for q in QUESTIONS[:4]]
    with_pdl, _ = runner_for(smollm2_on_gpu, eager=False, dtype="bfloat16", pdl=True)
    assert with_pdl.model.kernels.name == "triton-pdl"
    want = greedy(with_pdl, prompts, 32)
    del with_pdl
    torch.cuda.empty_cache()
    plain, _ = runner_for(smollm2_on_gpu, eager=False, dtype="bfloat16", pdl=False,
                          max_model_len=256)  # fmt: skip
    assert plain.model.kernels.name == "triton"
    assert greedy(plain, prompts, 32) == want


def test_smollm2_greedy_is_identical_alone_and_batched(smollm2_on_gpu):
    runner, _ = runner_for(smollm2_on_gpu, eager=False)
    prompts = [chat_ids(smollm2_on_gpu, q) for q in QUESTIONS]
    batched = greedy(runner, prompts, 24)
    alone = [greedy(runner, [p], 24)[0] for p in prompts[:3]]
    assert alone == batched[:3]


KV_SIZING_CHILD = """
import json, torch
from tests.runtime.test_gpu_runtime import tiny_hf
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig
from sitsd.builder import build_runner
from sitsd.runtime.kv_cache import bytes_per_block
hf, arch = tiny_hf()
tensors = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
del hf
torch.cuda.empty_cache()
limit = 6 * 2**30
cfg = SitsdConfig(
    model=ModelConfig(device="cuda", dtype="bfloat16"),
    cache=CacheConfig(gpu_memory_utilization=0.5, gpu_memory_limit=limit),
    scheduler=SchedulerConfig(max_num_seqs=8),
)
free_before, total = torch.cuda.mem_get_info()
runner, info = build_runner(cfg, arch, tensors, "test")
free_after, _ = torch.cuda.mem_get_info()
print(json.dumps({
    "limit": limit,
    "pool_bytes": info.num_blocks * bytes_per_block(arch, 16, torch.bfloat16),
    "runner_bytes": free_before - free_after,
    "graphs": runner.graphs is not None,
}))
"""


def test_kv_pool_fits_the_memory_limit():
    """In a fresh process (its own CUDA context), so that nothing earlier tests hold counts."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", KV_SIZING_CHILD], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    limit = got["limit"]
    # Everything the runner took from the device (weights, KV pool, graph pool, workspaces)
    # stays within 0.5 x the limit, and the KV pool is most of it.
    assert got["runner_bytes"] <= 0.5 * limit
    assert 0.25 * limit < got["pool_bytes"] < 0.5 * limit  # the CUDA context, graphs: the rest
    assert got["graphs"]


def test_builds_of_one_step_do_not_wait_on_the_host_for_the_forward_their_copies_queue_behind():
    # A step of two weights versions builds twice; the second build's copies queue behind the
    # first sub-batch's forward (one stream). The builds write host buffer sets in turn, so
    # the second returns while the stream is still busy (here: a kernel sleeping seconds).
    from sitsd.runtime.input_batch import HOST_SETS, StepInputBuilder

    builder = StepInputBuilder(64, 4, 8, BLOCK, torch.device("cuda"))
    params = SamplingParams(max_tokens=4)
    states = [CachedRequestState(f"r{i}", [1, 2, 3, 4], 3, params, 0, [i], 3) for i in range(2)]
    torch.cuda._sleep(5 * 10**9)  # a few seconds of the GPU's cycles ahead of every copy
    busy = torch.cuda.Event()
    busy.record()
    assert HOST_SETS >= 2
    builder.build(states[:1], {"r0": 1})  # the first version's sub-batch
    builder.build(states[1:], {"r1": 1})  # the second's
    assert not busy.query(), "a build waited for the stream"
    torch.cuda.synchronize()
    inputs = builder.build(states, {"r0": 1, "r1": 1})
    assert inputs.input_ids.tolist() == [4, 4]
    assert inputs.meta.slot_mapping.tolist() == [0 * BLOCK + 3, 1 * BLOCK + 3]
