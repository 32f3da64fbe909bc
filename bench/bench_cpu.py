"""CPU benchmark: sitsd from the embedded SmolLM2-135M-Instruct's own 4-bit weights, sitsd
on the same weights dequantized to float32, and Hugging Face transformers on those float32
weights.

Measured in one run, on this machine, same prompts (chat template applied), greedy, every
request generating exactly NEW_TOKENS tokens:

1. batch 1: decode tokens/s (after the first token) and end-to-end tokens/s;
2. 16 concurrent requests: aggregate output tokens/s over the wall time;
3. the bytes of the served weights (the weight slot's, as `sitsctl versions` shows them).

sitsd runs twice: as it serves the GGUF by default (its Q4_1 linears as INT4 g32, the
embedding and lm_head in bfloat16; `make run`) and with `--dequantize` (every weight float32:
the CPU path before quantized serving). Beside them, transformers' `generate` on the float32
weights (batch 1, the 16 requests one after another, and the 16 as one left-padded batch).
sitsd runs its real engine (scheduler, paged KV cache, sampler, detokenizer, the asyncio
bridge), in process, without gRPC. Medians of REPEATS runs. Targets (the 4-bit path against
float32): at least 1.5x faster at batch 1, at least 3x less weight memory.

    make bench-cpu        # or: .venv/bin/python -m bench.bench_cpu [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import torch

from bench.timing import now
from sitsd.builder import launch_engine
from sitsd.config import CacheConfig, ModelConfig, SitsdConfig
from sitsd.types import SamplingParams
from sitsd.weights import load_checkpoint, resolve_model_path

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Name three prime numbers.",
    "How do airplanes fly?",
    "Give me a tip for learning Python.",
    "What causes rain?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "What is a black hole?",
    "Suggest a name for a bakery.",
    "How do vaccines work?",
    "What is the tallest mountain?",
    "Translate 'good morning' into Spanish.",
    "What is machine learning?",
]


def prompts_ids(tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]


async def sitsd_runs(
    prompts: list[list[int]], new_tokens: int, repeats: int, dequantize: bool
) -> dict:
    cfg = SitsdConfig(
        model=ModelConfig(dequantize=dequantize), cache=CacheConfig(kv_cache_memory=512 * 2**20)
    )
    engine = await launch_engine(cfg)
    status = engine.status()
    weights = {"bytes": status.slot_weight_bytes[status.active_slot],
               "precision": status.slot_precisions[status.active_slot]}  # fmt: skip
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> tuple[float, float, float]:
        t0 = now()
        first = None
        async for _ in engine.add_request(ids, params):
            first = first or now()
        assert first is not None, "every request generates new_tokens tokens"
        return t0, first, now()

    await one(prompts[0])  # warm-up
    decode, e2e, agg = [], [], []
    for _ in range(repeats):
        t0, first, end = await one(prompts[0])
        decode.append((new_tokens - 1) / (end - first))
        e2e.append(new_tokens / (end - t0))
    for _ in range(repeats):
        t0 = now()
        await asyncio.gather(*(one(p) for p in prompts))
        agg.append(len(prompts) * new_tokens / (now() - t0))
    await engine.shutdown(1.0)
    return {
        "decode": statistics.median(decode),
        "e2e": statistics.median(e2e),
        "concurrent": statistics.median(agg),
        **weights,
    }


def hf_runs(path: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()

    def generate(batch: list[list[int]], n: int) -> float:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = now()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + n
        return now() - t0

    generate([prompts[0]], 8)  # warm-up
    decode, e2e = [], []
    for _ in range(repeats):
        t_first = generate([prompts[0]], 1)
        t_all = generate([prompts[0]], new_tokens)
        decode.append((new_tokens - 1) / (t_all - t_first))
        e2e.append(new_tokens / t_all)
    sequential = len(prompts) * new_tokens / sum(generate([p], new_tokens) for p in prompts)
    batched = statistics.median(
        len(prompts) * new_tokens / generate(prompts, new_tokens) for _ in range(repeats)
    )
    return {
        "decode": statistics.median(decode),
        "e2e": statistics.median(e2e),
        "sequential": sequential,
        "batched": batched,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = resolve_model_path("default")
    prompts = prompts_ids(load_checkpoint(path, load_tensors=False).tokenizer)
    print(
        f"model {path.name}, {len(prompts)} prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, {args.new_tokens} new tokens each, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    q = asyncio.run(sitsd_runs(prompts, args.new_tokens, args.repeats, dequantize=False))
    f = asyncio.run(sitsd_runs(prompts, args.new_tokens, args.repeats, dequantize=True))
    h = hf_runs(path, prompts, args.new_tokens, args.repeats)
    print(f"sitsd 4-bit: {q['precision']}, {q['bytes'] / 2**20:.1f} MiB of weights")
    print(f"sitsd float32: {f['precision']}, {f['bytes'] / 2**20:.1f} MiB of weights")
    rows = [
        ("batch 1, decode tok/s", q["decode"], f["decode"], h["decode"], "batch 1"),
        ("batch 1, end-to-end tok/s", q["e2e"], f["e2e"], h["e2e"], "batch 1"),
        ("16 concurrent, aggregate tok/s", q["concurrent"], f["concurrent"], h["sequential"],
         "the 16 one by one"),
        ("16 concurrent, aggregate tok/s", q["concurrent"], f["concurrent"], h["batched"],
         "one padded batch of 16"),
    ]  # fmt: skip
    print(f"\n{'measure':<32}{'4-bit':>8}{'float32':>9}{'4-bit/f32':>11}{'transformers':>14}"
          f"{'4-bit/hf':>10}  transformers ran")  # fmt: skip
    for name, four, f32, peer, what in rows:
        print(f"{name:<32}{four:>8.1f}{f32:>9.1f}{four / f32:>10.2f}x{peer:>14.1f}"
              f"{four / peer:>9.2f}x  {what}")  # fmt: skip
    memory = f["bytes"] / q["bytes"]
    print(f"{'weights, MiB':<32}{q['bytes'] / 2**20:>8.1f}{f['bytes'] / 2**20:>9.1f}"
          f"{1 / memory:>10.2f}x  ({memory:.2f}x less)")  # fmt: skip
    print(f"\ntargets: 4-bit batch 1 decode >= 1.5x float32 ({q['decode'] / f['decode']:.2f}x), "
          f"weights >= 3x less ({memory:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
