"""The weights subsystem at daemon start-up: restart recovery, the registry, the swap manager.

After every commit the daemon persists its model's active version (`versions.
ActiveVersionStore`, in the state directory). `choose_startup` serves that version when its
directory still holds the manifest recorded at commit (files are hashed again only when swapped
to), else the `--model` checkpoint, saying why. The served model keeps the name `--model` gives
it (or `--served-model-name`), whatever version serves. `create_swap_manager` then registers
what serves as the active version and the persisted previous one as the rollback target, reads
the canary prompts, and builds the `SwapManager`; `create_weight_pushes` the receiving side of
trainers' pushes on top of it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sitsd.config import SitsdConfig
from sitsd.weights.formats import resolve_model_path
from sitsd.weights.manifest import IncompleteVersion, ManifestError, read_manifest
from sitsd.weights.versions import (
    ActiveVersionStore,
    PersistedVersion,
    VersionRegistry,
    VersionState,
    is_version_id,
)

if TYPE_CHECKING:
    from sitsd.engine.swap_port import SwapPort
    from sitsd.observability import Observability
    from sitsd.types import TokenizerLike
    from sitsd.weights.push import WeightPushes
    from sitsd.weights.swap import SwapManager

log = logging.getLogger("sitsd.swap")

# On a CPU device staging shares the cores with the engine's OpenMP team: small pieces, and
# at most a tenth of one core (bench/bench_swap.py measured what more costs).
_CPU_CHUNK_BYTES = 4 * 2**20
_STAGING_SHARE = 0.1  # of a core, on a CPU device
# Of the host-to-device link, on a GPU: 16 GB in ~7 s on an H200 (a tenth took 17.6 s, the
# streams' ITL P99 1.08x of steady while it ran: the link has room to spare).
_GPU_STAGING_SHARE = 0.25


@dataclass(frozen=True)
class StartupChoice:
    """What a starting daemon serves."""

    served_name: str  # the model's name for clients, whatever version serves
    model_path: Path  # the checkpoint to load
    version: str | None  # its id: the directory's name for a version directory; None: the
    # builder derives one from the checkpoint's files (a checkpoint without a manifest)
    restored: PersistedVersion | None  # the persisted version, when it is what serves
    previous: PersistedVersion | None  # the persisted rollback target

    def config_for(self, config: SitsdConfig) -> SitsdConfig:
        """`config` with the checkpoint to load and the served name filled in."""
        model = dataclasses.replace(
            config.model, model=str(self.model_path), served_model_name=self.served_name
        )
        return dataclasses.replace(config, model=model)


def checkpoint_name(path: Path) -> str:
    """The name a checkpoint path gives the model (as the loaders name it)."""
    return path.stem if path.is_file() else path.name


def manifest_digest(path: Path) -> str:
    """sha256 of the manifest in directory `path`; "" when there is none (or it is invalid)."""
    try:
        return read_manifest(path).digest if path.is_dir() else ""
    except (IncompleteVersion, ManifestError):
        return ""


def choose_startup(config: SitsdConfig) -> StartupChoice:
    """The persisted active version if it is still there unchanged, else `--model`.

    Raises:
        CheckpointError: the `--model` path does not exist (and nothing was restored).
    """
    name = config.model.served_model_name
    state_dir = config.server.state_dir
    model_path = None
    if not name:
        model_path = resolve_model_path(config.model.model)
        name = checkpoint_name(model_path)
    active, previous = (None, None)
    if state_dir:
        active, previous = ActiveVersionStore(state_dir).load(name)
    if active is not None:
        path = Path(active.path)
        if manifest_digest(path) == active.manifest_digest and path.exists():
            log.info("restoring weights version %s of %s from %s", active.version, name, path)
            return StartupChoice(name, path, active.version, active, previous)
        log.warning(
            "the persisted weights version %s of %s is gone or changed at %s; serving --model",
            active.version, name, path,
        )  # fmt: skip
    model_path = model_path or resolve_model_path(config.model.model)
    # A version directory (it has a manifest) is named like any version: by the directory
    # (unless that is no version id; the builder then derives one from the files).
    version = model_path.name if manifest_digest(model_path) else None
    if version is not None and not is_version_id(version):
        version = None
    return StartupChoice(name, model_path, version, None, previous)


def startup_registry(choice: StartupChoice, serving_version: str) -> VersionRegistry:
    """The registry a daemon starts with: what serves (active) and the rollback target."""
    registry = VersionRegistry(choice.served_name)
    source = "restored" if choice.restored else "startup"
    path = choice.model_path.resolve()
    registry.register(serving_version, str(path), manifest_digest(path), source,
                      VersionState.ACTIVE)  # fmt: skip
    previous = choice.previous
    if previous and previous.version != serving_version and Path(previous.path).exists():
        registry.register(previous.version, previous.path, previous.manifest_digest,
                          "restored", VersionState.RETIRED)  # fmt: skip
        registry.set_previous(previous.version)
    return registry


def create_swap_manager(
    port: SwapPort,
    tokenizer: TokenizerLike,
    config: SitsdConfig,
    choice: StartupChoice,
    telemetry: Observability | None,
) -> SwapManager:
    """The daemon's `SwapManager` for a running engine (its `port`; `tokenizer` serves).

    Raises:
        CanaryFileError: the canary file cannot be used.
        ValueError: the swap policy needs a second weight slot and there is one.
    """
    # Imported here: torch and the model code; the daemon calls this once the engine runs.
    from sitsd.weights.canary import read_canary_prompts
    from sitsd.weights.checks import serving_model_of
    from sitsd.weights.staging import StagingSettings
    from sitsd.weights.swap import SwapManager, SwapSettings

    if config.swap.policy == "drain" and port.num_slots == 1:
        raise ValueError(
            "--swap-policy drain needs two weight slots, and only one fits here: choose "
            "--swap-policy migrate or restart, or make room for a second slot"
        )
    wcfg = config.weights
    prompts: list[list[int]] = []
    if wcfg.canary_file:
        prompts = read_canary_prompts(wcfg.canary_file, tokenizer, wcfg.canary_max_tokens)
        if port.num_slots == 1:
            log.warning("--canary-file: with one weight slot there is no canary (it compares "
                        "both slots); versions commit after validation alone")  # fmt: skip
    on_cpu = port.device.type == "cpu"
    chunk = min(wcfg.chunk_bytes, _CPU_CHUNK_BYTES) if on_cpu else wcfg.chunk_bytes
    staging = StagingSettings(
        chunk_bytes=chunk,
        share=wcfg.staging_share or (_STAGING_SHARE if on_cpu else _GPU_STAGING_SHARE),
        to_gpu=not on_cpu,
        slot_wait_s=config.swap.slot_wait_s,
        canary_prompts=tuple(tuple(p) for p in prompts) if port.num_slots == 2 else (),
        canary_max_kl=wcfg.canary_max_kl,
        watch_root=wcfg.watch_dir,
    )
    serving = serving_model_of(port.arch, tokenizer, port.dtype, port.device)
    registry = startup_registry(choice, port.status().weights_version)
    store = ActiveVersionStore(config.server.state_dir) if config.server.state_dir else None
    settings = SwapSettings(default_policy=config.swap.policy, staging=staging)
    return SwapManager(port, registry, serving, settings, store, telemetry)


def create_weight_pushes(
    manager: SwapManager, config: SitsdConfig, telemetry: Observability | None
) -> WeightPushes:
    """The daemon's `WeightPushes`: trainers' pushes through `manager`'s staging path."""
    from sitsd.weights.push import PushSettings, WeightPushes

    settings = PushSettings(keep_pushed=config.weights.keep_pushed_versions,
                            ipc_keep_mapped=config.weights.ipc_keep_mapped)  # fmt: skip
    return WeightPushes(manager, settings, telemetry)
