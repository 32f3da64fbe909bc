"""`sitsd` flags -> `SitsdConfig`: defaults, sizes, the state dir, and refused values."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from sitsd import __version__
from sitsd.cli import build_parser, config_from_args, main
from sitsd.config import (
    CPU_TIME_SCALE,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SitsdConfig,
    SwapConfig,
    TiersConfig,
    default_state_dir,
    default_tiers,
)

ENV = {"SITSD_STATE_DIR": "/state"}


def config_of(*flags: str, environ: dict[str, str] | None = None) -> SitsdConfig:
    args = build_parser().parse_args(["serve", *flags])
    return config_from_args(args, ENV if environ is None else environ)


def test_no_flags_give_the_config_defaults():
    assert config_of() == SitsdConfig(
        server=ServerConfig(state_dir="/state"), tiers=default_tiers("cpu")
    )


def test_tiers_default_to_the_devices_table_and_a_file_wins(tmp_path):
    gpu, cpu = config_of("--device", "cuda").tiers, config_of().tiers
    assert gpu == TiersConfig()  # the SITS table: gold 80 ms / 120 ms in the queue
    for name in ("gold", "silver", "bronze"):
        ours, theirs = cpu.tier(name), gpu.tier(name)
        assert ours.ttft_p99_s == pytest.approx(CPU_TIME_SCALE * theirs.ttft_p99_s)
        assert ours.itl_p99_s == pytest.approx(CPU_TIME_SCALE * theirs.itl_p99_s)
        assert ours.max_queue_wait_s == pytest.approx(CPU_TIME_SCALE * theirs.max_queue_wait_s)
        assert ours.priority_offset_s == pytest.approx(CPU_TIME_SCALE * theirs.priority_offset_s)
        assert ours.max_batch_share == theirs.max_batch_share
    tiers_file = tmp_path / "tiers.yaml"
    tiers_file.write_text("tiers: {gold: {max_queue_wait_ms: 300}}\n")
    from_file = config_of("--tiers", str(tiers_file)).tiers
    assert from_file.gold.max_queue_wait_s == 0.3
    assert from_file.silver == TiersConfig().silver  # a file is read over the SITS table


def test_every_flag_reaches_its_config_field():
    config = config_of(
        "--model",
        "/models/llama",
        "--served-model-name",
        "llama",
        "--device",
        "cuda:1",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "4096",
        "--num-threads",
        "2",
        "--mixed-graphs",
        "--no-pdl",
        "--block-size",
        "32",
        "--kv-cache-memory",
        "2GiB",
        "--num-kv-blocks",
        "100",
        "--gpu-memory-utilization",
        "0.5",
        "--no-prefix-caching",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "512",
        "--max-num-waiting",
        "16",
        "--max-tokens-default",
        "64",
        "--async-scheduling",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--admin-token-file",
        "/etc/sitsd/token",
        "--state-dir",
        "/var/lib/sitsd",
        "--shutdown-grace",
        "2.5",
    )
    assert config == SitsdConfig(
        model=ModelConfig(
            model="/models/llama",
            served_model_name="llama",
            dtype="bfloat16",
            device="cuda:1",
            max_model_len=4096,
            num_threads=2,
            mixed_graphs=True,
            pdl=False,
        ),
        cache=CacheConfig(
            block_size=32,
            kv_cache_memory=2 * 2**30,
            gpu_memory_utilization=0.5,
            num_blocks=100,
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_num_waiting=16,
            max_tokens_default=64,
            async_scheduling=True,
        ),
        tiers=TiersConfig(),
        server=ServerConfig(
            host="0.0.0.0",
            port=0,
            shutdown_grace_s=2.5,
            admin_token_file="/etc/sitsd/token",
            state_dir="/var/lib/sitsd",
        ),
    )


def test_tier_flags_reach_the_scheduler_and_tiers_config(tmp_path):
    tiers_file = tmp_path / "tiers.yaml"
    tiers_file.write_text(
        "default_tier: gold\ncontroller: from-file\ntiers: {gold: {ttft_p99_ms: 400}}\n"
    )
    config = config_of(
        "--scheduling-policy",
        "fcfs",
        "--tiers",
        str(tiers_file),
        "--batch-controller",
        "fixed-caps",
        "--plugin-dir",
        "/opt/a",
        "--plugin-dir",
        "/opt/b",
    )
    assert config.scheduler.policy == "fcfs"
    assert config.tiers.gold.ttft_p99_s == 0.4
    assert config.tiers.default_tier == "gold"  # from the file: no --default-tier given
    assert config.tiers.controller == "fixed-caps"  # the flag beats the file
    assert config.tiers.plugin_dirs == ("/opt/a", "/opt/b")
    assert config_of("--default-tier", "bronze").tiers.default_tier == "bronze"
    assert config_of().scheduler.policy == "tiers"


def test_a_bad_tiers_file_is_a_usage_error_naming_the_key(tmp_path, capsys):
    tiers_file = tmp_path / "tiers.yaml"
    tiers_file.write_text("tiers: {gold: {ttft_p99: 1}}\n")
    with pytest.raises(SystemExit) as exit_info:
        config_of("--tiers", str(tiers_file))
    assert exit_info.value.code == 2
    assert "tiers.gold: unknown key 'ttft_p99'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("256MiB", 256 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1048576", 2**20),
        ("1G", 2**30),
        ("500MB", 500 * 10**6),
    ],
)
def test_kv_cache_memory_takes_sizes(text, size):
    assert config_of("--kv-cache-memory", text).cache.kv_cache_memory == size


@pytest.mark.parametrize(
    ("flag", "value", "complaint"),
    [
        ("--kv-cache-memory", "lots", "not a size"),
        ("--kv-cache-memory", "12 parsecs", "not a size"),
        ("--port", "70000", "must be in [0, 65535]"),
        ("--port", "http", "not an integer"),
        ("--max-num-seqs", "0", "must be >= 1"),
        ("--block-size", "-16", "must be >= 1"),
        ("--max-model-len", "-1", "must be >= 0"),
        ("--gpu-memory-utilization", "0", "must be in (0, 1]"),
        ("--gpu-memory-utilization", "1.5", "must be in (0, 1]"),
        ("--shutdown-grace", "-1", "must be >= 0"),
        ("--shutdown-grace", "nan", "must be >= 0"),
        ("--drain-hold", "-0.5", "must be >= 0"),
        ("--migration-deadline-steps", "0", "must be >= 1"),
        ("--migration-deadline", "0", "must be > 0"),
        ("--gil-switch-interval", "0", "must be > 0"),
        ("--dtype", "float64", "invalid choice"),
        ("--log-level", "verbose", "invalid choice"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(flag, value, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        config_of(flag, value)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert flag in error
    assert complaint in error


@pytest.mark.parametrize(
    ("flags", "mixed", "ahead", "pdl"),
    [
        ((), None, None, None),  # decided by the device when the engine is built
        (("--mixed-graphs", "--async-scheduling", "--pdl"), True, True, True),
        (("--no-mixed-graphs", "--no-async-scheduling", "--no-pdl"), False, False, False),
    ],
)
def test_mixed_graphs_async_scheduling_and_pdl_are_on_off_or_the_devices_default(
    flags, mixed, ahead, pdl
):
    config = config_of(*flags)
    assert config.model.mixed_graphs is mixed
    assert config.scheduler.async_scheduling is ahead
    assert config.model.pdl is pdl


def test_state_dir_flag_wins_over_the_environment():
    assert config_of("--state-dir", "/flag").server.state_dir == "/flag"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SITSD_STATE_DIR": "/env", "XDG_STATE_HOME": "/xdg"}, "/env"),
        ({"XDG_STATE_HOME": "/xdg"}, "/xdg/sitsd"),
        ({}, str(Path.home() / ".local" / "state" / "sitsd")),
    ],
)
def test_default_state_dir(environ, expected):
    assert default_state_dir(environ) == expected
    assert config_of(environ=environ).server.state_dir == expected


def test_every_serve_flag_documents_its_default():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [a for a in serve._actions if a.option_strings and a.dest != "help"]
    assert {"--model", "--kv-cache-memory", "--shutdown-grace"} <= {
        a.option_strings[0] for a in flags
    }
    for action in flags:
        assert "default" in (action.help or ""), f"{action.option_strings[0]} says no default"


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"sitsd {__version__}\n"


def test_no_command_prints_usage_and_exits_2(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().err


def test_parsing_flags_does_not_load_the_model_stack():
    code = "import sys, sitsd.cli; print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout
    assert out.strip() == "[]"


def test_drain_hold_reaches_the_swap_config():
    hold = round(random.uniform(0.1, 9.0), 2)
    assert config_of("--drain-hold", str(hold)).swap.drain_hold_s == hold
    assert config_of().swap.drain_hold_s == SwapConfig().drain_hold_s


def test_the_migration_deadline_is_in_steady_steps_unless_given_in_seconds():
    default = config_of().swap
    assert (default.migration_deadline_steps, default.migration_deadline_s) == (2000, 0.0)
    steps = random.randrange(1, 10_000)
    swap = config_of("--migration-deadline-steps", str(steps)).swap
    assert (swap.migration_deadline_steps, swap.migration_deadline_s) == (steps, 0.0)
    assert config_of("--migration-deadline", "7.5").swap.migration_deadline_s == 7.5


def test_gil_switch_interval_reaches_the_server_config():
    seconds = round(random.uniform(0.0001, 0.01), 5)
    assert config_of("--gil-switch-interval", str(seconds)).server.gil_switch_interval_s == seconds
    assert config_of().server.gil_switch_interval_s == ServerConfig().gil_switch_interval_s


def test_ipc_keep_mapped_reaches_the_weights_config_and_the_pushes_it_makes():
    from sitsd.weights.push import PushSettings

    assert config_of("--ipc-keep-mapped").weights.ipc_keep_mapped
    assert not config_of().weights.ipc_keep_mapped
    assert not PushSettings().ipc_keep_mapped
