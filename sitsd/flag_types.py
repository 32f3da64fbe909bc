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


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0.0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def tiers_file(text: str) -> TiersConfig:
    from sitsd.engine.tiers import load_tiers_file  # yaml and the plugin loader: only when used

    try:
        return load_tiers_file(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0.0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def fraction_or_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def key_values(text: str) -> tuple[tuple[str, str], ...]:
    """`k1=v1,k2=v2` (the OTEL_* list format, values URL-encoded) as pairs."""
    pairs = []
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            pairs.append((unquote(key.strip()), unquote(value.strip())))
    return tuple(pairs)
