"""Accuracy of 4-bit SmolLM2-135M: perplexity on offline English text, per precision.

The text is the licence texts Debian ships (`/usr/share/common-licenses`, each file once, links
followed; `--exclude` leaves files out), tokenized with the model's tokenizer and
cut into windows of `--window` tokens, the first `--tokens` of them scored (next-token NLL of
every position but each window's first). Each model runs in float32 through the plain reference
forward (`sitsd.weights.reference_llama`) on the exact dequantization of its weights (what the
INT4 kernels compute, to their accumulation order):

    16-bit          the embedded GGUF dequantized, as transformers reads it
    Q4_1 shipped    the embedded GGUF's own Q4_1 linear weights (Q8_0 embedding, as shipped)
    DIR ...         version directories `sitsd quantize` wrote (any layout), loaded by sitsd
    WORD ...        the 16-bit model's `*_proj` weights rounded as `sitsd serve --quantize WORD`
                    rounds them at load (`int4-g64`, `int4-g64-sym`; lm_head, embedding 16-bit)

The only SmolLM2 available offline is that Q4_1 file: its "16-bit" model is the Q4_1 weights
dequantized (the two rows agree), and `sitsd quantize` re-quantizes those; with a 16-bit
checkpoint (`--model DIR` here and in `sitsd quantize`) the rows measure what they say.

    python -m bench.quant_accuracy --write-calibration FILE   # docstrings of Python's stdlib
    python -m bench.quant_accuracy --quantized NAME=DIR [...] [--at-load NAME=WORD [...]]
        [--tokens 50000] [--exclude FILE] [--device cuda] [--json PATH [--resume]]

With `--resume`, the rows already in `--json PATH` (same name, same token count) are read
from it instead of measured again, and the new ones added: a table can grow one row at a time.

The table comes last. Its commands and results: `bench/results/quant-accuracy-cpu.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from sitsd.quant.precision import Precision, parse_precision
from sitsd.quant.rtn import quantize_int4_as
from sitsd.weights import load_checkpoint
from sitsd.weights.checkpoint import Checkpoint
from sitsd.weights.formats import resolve_model_path
from sitsd.weights.reference_llama import ReferenceLlama, dense_tensors, perplexity

LICENSES = Path("/usr/share/common-licenses")


def licence_text(exclude: set[str]) -> tuple[str, list[str]]:
    """Every licence text once (links resolved), sorted by name; (text, file names)."""
    seen, names, parts = set(), [], []
    for path in sorted(LICENSES.iterdir()):
        real = path.resolve()
        if not real.is_file() or real in seen or real.name in exclude or path.name in exclude:
            continue
        seen.add(real)
        names.append(real.name)
        parts.append(real.read_text(errors="replace"))
    return "\n\n".join(parts), names


_STDLIB = ("argparse", "asyncio", "collections", "contextlib", "dataclasses", "functools",
           "itertools", "json", "logging", "os", "pathlib", "re", "subprocess", "threading",
           "typing", "unittest")  # fmt: skip


def stdlib_docstrings() -> str:
    """The docstrings of some of Python's standard library (calibration text: another source
    than the scored one)."""
    import importlib
    import inspect

    parts = []
    for name in _STDLIB:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for _, member in sorted(vars(module).items()):
            if (inspect.isclass(member) or inspect.isfunction(member)) and getattr(
                member, "__module__", ""
            ).startswith(name):
                parts.append(inspect.getdoc(member) or "")
    return "\n\n".join(p for p in parts if p)


def rounded_at_load(dense: Checkpoint, precision: Precision) -> Checkpoint:
    """`dense` with every `*_proj` weight replaced by its INT4 rounding (RTN, as `sitsd serve
    --quantize` rounds at load), dequantized: what the INT4 kernels multiply."""
    if precision.kind != "int4":
        raise SystemExit(f"--at-load takes INT4 precision words, not {precision}")
    tensors = dict(dense.tensors)
    for name, w in dense.tensors.items():
        if name.endswith("_proj.weight"):
            tensors[name] = quantize_int4_as(w.float(), precision, name).dequantize().to(w.dtype)
    return dataclasses.replace(dense, tensors=tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="the 16-bit (or GGUF) source")
    parser.add_argument("--quantized", nargs="*", default=[], metavar="NAME=DIR")
    parser.add_argument("--at-load", nargs="*", default=[], metavar="NAME=WORD",
                        help="an INT4 precision word, RTN at load")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--exclude", nargs="*", default=[], help="licence files left out")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the forward runs (float32)")
    parser.add_argument("--json", default="")
    parser.add_argument("--resume", action="store_true",
                        help="the rows already in --json: read, not measured")  # fmt: skip
    parser.add_argument(
        "--write-calibration",
        default="",
        metavar="FILE",
        help="write the calibration text (standard library docstrings), exit",
    )
    args = parser.parse_args()
    if args.write_calibration:
        Path(args.write_calibration).write_text(stdlib_docstrings())
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    dense = load_checkpoint(path, keep_quantized=False)
    text, names = licence_text(set(args.exclude))
    ids = dense.tokenizer.encode(text, add_special_tokens=False)
    rows = min(len(ids) // args.window, -(-args.tokens // (args.window - 1)))  # >= --tokens
    windows = torch.tensor(ids[: rows * args.window]).reshape(rows, args.window).to(args.device)
    print(f"text: {len(names)} files of {LICENSES} ({', '.join(names)}), {len(ids)} tokens; "
          f"scored: {rows} windows of {args.window}", flush=True)  # fmt: skip
    models: list[tuple[str, Checkpoint]] = [("16-bit (the source dequantized)", dense)]
    if path.suffix == ".gguf":  # the embedded model: its Q4_1 weights as shipped
        models.append(("GGUF as shipped", load_checkpoint(path)))
    for spec in args.quantized:
        name, _, directory = spec.partition("=")
        models.append((name, load_checkpoint(directory)))
    for spec in args.at_load:
        name, _, word = spec.partition("=")
        models.append((name, rounded_at_load(dense, parse_precision(word))))
    done = {}
    if args.resume and args.json and Path(args.json).exists():
        done = {r["model"]: r for r in json.loads(Path(args.json).read_text())
                if r["tokens"] == rows * (args.window - 1)}  # fmt: skip
    results = []
    for name, ckpt in models:
        if name in done:
            results.append(done[name])
            print(f"{name}: perplexity {done[name]['perplexity']:.3f} (from {args.json})")
            continue
        t0 = time.monotonic()
        dense_ckpt = dense_tensors(ckpt.arch, ckpt.tensors, ckpt.quant)
        tensors = {n: t.to(args.device) for n, t in dense_ckpt.items()}
        model = ReferenceLlama(ckpt.arch, tensors, args.window)
        ppl, count = perplexity(model, windows)
        results.append({"model": name, "perplexity": ppl, "tokens": count})
        print(f"{name}: perplexity {ppl:.3f} over {count} tokens ({time.monotonic() - t0:.0f}s)",
              flush=True)  # fmt: skip
        if args.json:  # after every row: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))
    base = results[0]["perplexity"]
    print(f"\n{'model':<44} {'perplexity':>10} {'vs 16-bit':>10} {'tokens':>8}")
    for r in results:
        print(f"{r['model']:<44} {r['perplexity']:>10.3f} {r['perplexity'] / base:>9.3f}x "
              f"{r['tokens']:>8}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
