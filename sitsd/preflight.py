"""The daemon's start-up checks: every setting that can be checked without the model, before
anything is bound or loaded, so that a user error is one line naming its flag, at once.

`check_startup(config)` raises `ConfigError` for the first setting that cannot work:

- `--model`: a path that exists and holds a format sitsd reads, never a pickle checkpoint
  (`sitsd.weights.formats.checkpoint_source`, which decides from file names alone);
- `--batch-controller` / `--plugin-dir`: a controller of that name exists
  (`sitsd.engine.tiers.find_batch_controller`, which runs the plugin files);
- `--quantize`: a precision word, or a precision map file that reads
  (`sitsd.quant.load_precision_map`);
- the files flags name: `--admin-token-file`, `--api-key-file` and `--canary-file` are
  readable files, `--watch-dir` is a directory.

It reads the file system: the daemon calls it off the event loop. What only the model or the
device can tell (CUDA, the model's context length, memory) the builder checks first thing,
with `ConfigError` too; flag combinations that need no file are `sitsd.cli`'s (usage errors).
"""

from __future__ import annotations

import os
from pathlib import Path

from sitsd.config import ConfigError, SitsdConfig
from sitsd.engine.tiers import find_batch_controller
from sitsd.weights import CheckpointError, resolve_model_path
from sitsd.weights.formats import checkpoint_source


def check_startup(config: SitsdConfig) -> None:
    """Raise `ConfigError` naming the first flag whose setting cannot work (module docstring)."""
    try:
        checkpoint_source(resolve_model_path(config.model.model))
    except CheckpointError as exc:
        raise ConfigError(f"--model: {exc}") from None
    if config.scheduler.policy == "tiers":
        find_batch_controller(config.tiers)
    if config.model.quantize:
        _check_precision_map(config.model.quantize)
    _check_file("--admin-token-file", config.server.admin_token_file)
    _check_file("--api-key-file", config.http.api_key_file if config.http.enabled else "")
    _check_file("--canary-file", config.weights.canary_file)
    watch_dir = config.weights.watch_dir
    if watch_dir and not Path(watch_dir).expanduser().is_dir():
        raise ConfigError(f"--watch-dir {watch_dir}: not a directory (create it first)")


def _check_precision_map(value: str) -> None:
    # Imported here: the quantized layouts import torch, which a daemon without --quantize
    # imports only once the checks have passed.
    from sitsd.quant.errors import QuantFormatError
    from sitsd.quant.precision import load_precision_map

    try:
        load_precision_map(value)
    except QuantFormatError as exc:
        raise ConfigError(f"--quantize: {exc}") from None


def _check_file(flag: str, path: str) -> None:
    if not path:
        return
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    if not os.access(file, os.R_OK):
        raise ConfigError(f"{flag} {path}: not readable by this user")
