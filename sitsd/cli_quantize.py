"""`sitsd quantize`: the command line of `sitsd.weights.quantize` (a bar per layer on stderr)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_quantize_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from sitsd.quant.export import FORMATS
    from sitsd.weights.quantize import METHODS, SCALE_SEARCHES

    quantize = commands.add_parser(
        "quantize",
        help="quantize a 16-bit checkpoint into a deployable 4-bit version directory",
        description="Quantize the linear layers of --model to 4 bits (rtn: round to nearest; "
        "awq: activation-aware scales first; gptq: rounding with error feedback over the "
        "calibration inputs' Hessian) into a Hugging Face directory (AWQ, GPTQ or "
        "compressed-tensors layout, with manifest.json) in --out: what `sitsctl deploy` and "
        "the watched directory take.",
    )
    quantize.add_argument("--model", required=True, help="the source checkpoint (a Hugging "
                          "Face directory, a .gguf file, or `default`)")  # fmt: skip
    quantize.add_argument("--method", choices=METHODS, default="rtn")
    quantize.add_argument("--bits", type=int, choices=(4,), default=4)
    quantize.add_argument("--group-size", type=int, choices=(32, 64, 128), default=128)
    quantize.add_argument(
        "--calibration",
        default="",
        help="a text file of calibration text "
        "(default: without it, the scale search weighs every input alike)",
    )
    quantize.add_argument("--calibration-tokens", type=int, default=4096,
                          help="the most calibration tokens used")  # fmt: skip
    quantize.add_argument("--scale-search", choices=SCALE_SEARCHES, default="mse",
                          help="mse: the range clipping per group that minimises the output "
                          "error on the calibration inputs; kl: per layer, the clipping that "
                          "keeps the model's next-token distributions closest to the 16-bit "
                          "model's; "
                          "none: the full range")  # fmt: skip
    quantize.add_argument(
        "--precision-map",
        default="",
        help="a YAML precision map (or a "
        "word): which linear weights become int4, which stay 16-bit",
    )
    quantize.add_argument("--format", choices=FORMATS, default="awq",
                          help="the directory's layout: awq (AutoAWQ GEMM), gptq (GPTQModel), "
                          "compressed-tensors (llm-compressor pack-quantized W4A16)")  # fmt: skip
    quantize.add_argument("--act-order", action="store_true",
                          help="gptq: quantize the input columns loudest first (--format gptq: "
                          "groups in that order, g_idx; compressed-tensors: the inputs' own "
                          "groups, actorder weight)")  # fmt: skip
    quantize.add_argument("--gptq-damp", type=float, default=0.01,
                          help="gptq: the Hessian's damping, a fraction of its mean "
                          "diagonal")  # fmt: skip
    quantize.add_argument("--out", required=True, help="the version directory to write")
    quantize.add_argument("--no-progress", action="store_true", help="no progress bar")


def _calibration_text(path: str) -> str:
    """The calibration file's text ("" without one); OSError naming the flag and the file."""
    if not path:
        return ""
    try:
        return Path(path).read_text(errors="replace")
    except OSError as exc:
        raise OSError(f"--calibration {path}: {exc.strerror or exc}") from None


def run_quantize(args: argparse.Namespace) -> int:
    """Run `sitsd quantize`; the exit code (1 with a message on bad input)."""
    from tqdm import tqdm

    from sitsd.quant.errors import QuantFormatError
    from sitsd.quant.precision import load_precision_map
    from sitsd.weights import CheckpointError, load_checkpoint
    from sitsd.weights.formats import resolve_model_path
    from sitsd.weights.quantize import QuantizeConfig, check_request, quantize_checkpoint

    try:
        precision = load_precision_map(args.precision_map) if args.precision_map else None
        text = _calibration_text(args.calibration)
        ckpt = load_checkpoint(resolve_model_path(args.model), keep_quantized=False)
        config = QuantizeConfig(
            method=args.method,
            bits=args.bits,
            group_size=args.group_size,
            scale_search=args.scale_search,
            precision=precision,
            calibration_tokens=args.calibration_tokens,
            format=args.format,
            act_order=args.act_order,
            gptq_damp=args.gptq_damp,
        )
        check_request(ckpt, config, bool(text))  # before the bar: a refusal is one line
        with tqdm(total=ckpt.arch.num_layers, unit="layer", disable=args.no_progress,
                  file=sys.stderr) as bar:  # fmt: skip
            manifest = quantize_checkpoint(
                ckpt,
                config,
                text,
                Path(args.out),
                on_layer=lambda done, _: bar.update(done - bar.n),
            )
    except (QuantFormatError, CheckpointError, OSError) as exc:
        print(f"sitsd quantize: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.out}: {args.method} int4 g{args.group_size} ({args.format} layout), "
        f"{manifest.total_bytes / 2**20:.1f} MiB, manifest sha256 {manifest.digest[:16]}"
    )
    return 0
