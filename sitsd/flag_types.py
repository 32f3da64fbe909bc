"""Value types for `sitsd serve`'s flags: each parses one flag's text or raises
`argparse.ArgumentTypeError` with a message that says what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from urllib.parse import unquote

from sitsd.config import TiersConfig, parse_size


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _float(text: str, what: str = "a number") -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def _refuse(value: float, bound: str) -> None:
    raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")


# Each comparison is written so that NaN fails it.


def fraction(text: str) -> float:
    """In (0, 1]."""
    value = _float(text)
    if not 0.0 < value <= 1.0:
        _refuse(value, "in (0, 1]")
    return value


def fraction_or_zero(text: str) -> float:
    """In [0, 1]."""
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        _refuse(value, "in [0, 1]")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0.0:
        _refuse(value, "> 0")
    return value


def seconds(text: str) -> float:
    value = _float(text, "a number of seconds")
    if not value >= 0.0:
        _refuse(value, ">= 0")
    return value


def tiers_file(text: str) -> TiersConfig:
    from sitsd.tiers_file import load_tiers_file  # yaml: only when used

    try:
        return load_tiers_file(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def key_values(text: str) -> tuple[tuple[str, str], ...]:
    """`k1=v1,k2=v2` (the OTEL_* list format, values URL-encoded) as pairs."""
    pairs = []
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            pairs.append((unquote(key.strip()), unquote(value.strip())))
    return tuple(pairs)
