"""The precision map: which tensors run in which bits, as glob patterns over tensor names.

A map is a YAML mapping, pattern -> precision, read in file order; the first pattern that
matches a tensor's Hugging Face name (`fnmatch`: `*` matches dots too) decides:

    "*.mlp.*": int4              # INT4, groups of 128 (RTN at load, the method's in PTQ)
    "*.self_attn.q_proj.*": int4-g64
    "*.o_proj.weight": bf16      # stays 16-bit
    "lm_head.weight": bf16

Precisions: `int4` (`int4-g32`, `int4-g64`, `int4-g128`: the group size; 128 by default; with
`-sym`, e.g. `int4-sym` or `int4-g128-sym`, symmetric: no zero points, GPTQ's `sym` format,
which the GPU's INT4 kernels run faster, at some accuracy), `int8` (per output row), `fp8`
(e4m3, per output row), `bf16`, `fp16`. A tensor no pattern matches keeps what the checkpoint
gives it (16 bits stay 16 bits, quantized modules keep their format). Only linear weights are
quantized; a map that names a norm or the embedding with a quantized precision is refused when
it is applied (`sitsd.model`'s weight table says which tensors are linear). The map drives
`sitsd quantize` (zero points only) and `sitsd serve --quantize`; a word instead of a file
(`--quantize int4`) is the map `"*": word`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from sitsd.kernels.quant_layout import GROUP_SIZES
from sitsd.quant.errors import QuantFormatError

__all__ = ["KINDS", "Precision", "PrecisionMap", "load_precision_map", "parse_precision"]

KINDS = ("int4", "int8", "fp8", "bf16", "fp16")
QUANTIZED_KINDS = ("int4", "int8", "fp8")
# What an INT4 word may add, for messages
_INT4_WORDS = "int4 may name its group size and end in -sym: int4-g64, int4-sym, int4-g64-sym"


@dataclass(frozen=True)
class Precision:
    """One precision a map can name."""

    kind: str  # one of KINDS
    group_size: int = 128  # INT4 only: inputs per scale
    symmetric: bool = False  # INT4 only: zero point 8, no zero points stored

    @property
    def quantized(self) -> bool:
        return self.kind in QUANTIZED_KINDS

    def __str__(self) -> str:
        if self.kind != "int4":
            return self.kind
        return f"int4-g{self.group_size}" + ("-sym" if self.symmetric else "")


def parse_precision(word: str, where: str = "precision") -> Precision:
    """`int4`, `int4-g64`, `int4-sym`, `int4-g64-sym`, `int8`, `fp8`, `bf16`, `fp16` ->
    `Precision`.

    Raises:
        QuantFormatError: Another word, or a group size the INT4 kernels do not take.
    """
    text = str(word).strip().lower()
    symmetric = text.endswith("-sym")
    kind, _, group = text.removesuffix("-sym").partition("-g")
    if kind not in KINDS or ((group or symmetric) and kind != "int4"):
        raise QuantFormatError(
            f"{where}: {word!r} is not a precision; use one of {', '.join(KINDS)} ({_INT4_WORDS})"
        )
    if not group:
        return Precision(kind, symmetric=symmetric)
    if not group.isdigit() or int(group) not in GROUP_SIZES:
        raise QuantFormatError(f"{where}: group size in {word!r} must be one of {GROUP_SIZES}")
    return Precision(kind, int(group), symmetric)


@dataclass(frozen=True)
class PrecisionMap:
    """Ordered (pattern, precision) rules; the first match decides."""

    rules: tuple[tuple[str, Precision], ...] = ()
    source: str = ""  # the file (or word) it came from, for messages

    def precision_for(self, tensor_name: str) -> Precision | None:
        """The precision of `tensor_name`, or None when no rule matches."""
        for pattern, precision in self.rules:
            if fnmatch.fnmatchcase(tensor_name, pattern):
                return precision
        return None

    def describe(self) -> str:
        return ", ".join(f"{p}: {prec}" for p, prec in self.rules) or "(empty)"

    @classmethod
    def from_mapping(cls, data: Mapping[str, object], source: str = "") -> PrecisionMap:
        """A map from a parsed YAML mapping.

        Raises:
            QuantFormatError: A key that is not a string, or a value that is no precision.
        """
        rules = []
        for pattern, value in data.items():
            if not isinstance(pattern, str) or not pattern:
                raise QuantFormatError(f"{source}: pattern {pattern!r} must be a string")
            rules.append((pattern, parse_precision(str(value), f"{source}: {pattern}")))
        return cls(tuple(rules), source)


def load_precision_map(value: str) -> PrecisionMap:
    """The map in YAML file `value`, or, for a precision word, the map `"*": value`.

    Raises:
        QuantFormatError: An unreadable or malformed file, or an unknown precision.
    """
    path = Path(value).expanduser()
    if not path.is_file():
        try:
            return PrecisionMap((("*", parse_precision(value, "--quantize")),), value)
        except QuantFormatError:
            raise QuantFormatError(
                f"precision map {value!r} is neither a file nor a precision ({', '.join(KINDS)}; "
                f"{_INT4_WORDS})"
            ) from None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise QuantFormatError(f"precision map {path} cannot be read: {exc}") from exc
    if not isinstance(data, dict) or not data:
        raise QuantFormatError(
            f"precision map {path} must be a YAML mapping of glob patterns to precisions, "
            'e.g. "*.mlp.*: int4"'
        )
    return PrecisionMap.from_mapping(data, str(path))
