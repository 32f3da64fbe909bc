"""Where a constrained (`json_schema`) decode step's extra time goes: llguidance filling the
host bitmask, and `GrammarMasks.apply` masking the logits (fill included), at batch 32 over
SmolLM2's vocabulary on the CPU (or `--device cuda`, where apply also copies the bitmask to
the device and the timing waits for the device).

The grammar is `bench.bench_http`'s schema; each row's matcher has consumed a different prefix
of one valid document, as rows of a real batch have. Three layouts: every row constrained,
a run of rows, and every other row (the gathered path). Median and min of `--repeats` calls.

    .venv/bin/python -m bench.bench_grammar_mask [--rows 32] [--repeats 50] [--model PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
from llguidance.torch import fill_next_token_bitmask

from bench.bench_http import SCHEMA
from sitsd.runtime.grammar import GrammarCompiler, GrammarMasks, GrammarState
from sitsd.types import GrammarSpec
from sitsd.weights import load_checkpoint
from sitsd.weights.formats import resolve_model_path

DOCUMENT = '{"title":"The keeper","chapters":["Storm","Calm","The lamp","Morning"]}'


def timed_ms(work: Callable[[], None], repeats: int, device: torch.device) -> str:
    """'median (min) ms' of `repeats` calls: the min is what a machine with cores to spare gets."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return f"{statistics.median(times) * 1e3:9.3f} ({min(times) * 1e3:.3f}) ms"


def matchers(compiler: GrammarCompiler, tokenizer, rows: int) -> list[GrammarState]:
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    states = []
    for _ in range(rows):
        state = compiler.matcher(spec)
        state.advance(ids[: random.randrange(len(ids))])
        states.append(state)
    return states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="default", help="whose tokenizer (default: SmolLM2)")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokenizer = load_checkpoint(resolve_model_path(args.model), load_tensors=False).tokenizer
    vocab = tokenizer.vocab_size
    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab)
    states = matchers(compiler, tokenizer, args.rows)
    masks = GrammarMasks(vocab, 2 * args.rows, device)
    host = torch.zeros(args.rows, -(-vocab // 32), dtype=torch.int32)

    def fill() -> None:
        for i, state in enumerate(states):
            fill_next_token_bitmask(state.matcher, host, i)

    print(f"vocab {vocab}, {args.rows} rows, {device}, {torch.get_num_threads()} threads")
    print(f"{'':<32} median (min)")
    print(f"{'llguidance fill (host bitmask)':<32} {timed_ms(fill, args.repeats, device)}")
    n = args.rows
    for name, num_rows, rows in (
        ("apply: every row", n, list(range(n))),
        ("apply: a run of rows", n + n // 2, list(range(n // 4, n // 4 + n))),
        ("apply: every other row", 2 * n, list(range(0, 2 * n, 2))),
    ):
        logits = torch.randn(num_rows, vocab, device=device)
        apply = functools.partial(masks.apply, logits, rows, states)
        print(f"{name:<32} {timed_ms(apply, args.repeats, device)}")


if __name__ == "__main__":
    main()
