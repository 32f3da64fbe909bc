"""The real daemon's start-up under faults: user errors in one line before anything loads, and a
signal at any moment of start-up is a clean stop (exit 0, nothing half-written).

A SIGTERM during the model load used to abort the process ("terminate called without an active
exception", exit 134: Python's finalization raced the load's native threads); a bad
`--batch-controller` was found only once the model had loaded, as a model-load failure with a
traceback, and so were pickle refusals and `--device cuda` on a CPU-only torch.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.daemon_process import DaemonProcess, process_env

pytestmark = pytest.mark.slow

CRASHES = ("Traceback", "terminate called", "Aborted", "core dumped")


def run_serve(state_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`sitsd serve` with free ports, to its exit."""
    return subprocess.run(
        [sys.executable, "-m", "sitsd", "serve", "--port", "0", "--http-port", "0",
         "--metrics-port", "0", "--state-dir", str(state_dir), *flags],
        capture_output=True, text=True, env=process_env(state_dir), timeout=300,
    )  # fmt: skip


def error_lines(output: str) -> list[str]:
    """The events of the error-level JSON log lines, and any line that is not JSON."""
    out = []
    for line in output.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            out.append(line)
            continue
        if record.get("level") in ("error", "critical"):
            out.append(record["event"])
    return out


def write_pickle_checkpoint(directory: Path) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # pickle of the int 1
    return directory


EARLY = {
    "batch controller": (["--batch-controller", "nope"], "--batch-controller: no batch"),
    "plugin dir": (["--plugin-dir", "/nonexistent-plugins"], "--plugin-dir /nonexistent-plugins"),
    "model path": (["--model", "/nonexistent-model"], "--model: model path '/nonexistent"),
    "pickle": (["--model", "{pickle}"], "is a pickle checkpoint; sitsd refuses pickles"),
    "canary file": (["--canary-file", "/nonexistent.txt"], "--canary-file /nonexistent.txt"),
    "api key file": (["--api-key-file", "/nonexistent-keys"], "--api-key-file /nonexistent"),
    "watch dir": (["--watch-dir", "/nonexistent-watch"], "--watch-dir /nonexistent-watch"),
    "precision map": (["--quantize", "int3"], "--quantize: precision map 'int3' is neither"),
}


@pytest.mark.parametrize(("flags", "says"), EARLY.values(), ids=EARLY)
def test_a_bad_flag_is_one_line_before_anything_loads(tmp_path, flags, says):
    pickle = write_pickle_checkpoint(tmp_path / "pickled")
    result = run_serve(tmp_path / "state", *(f.format(pickle=pickle) for f in flags))
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert [says in line for line in error_lines(output)] == [True], output
    assert not any(crash in output for crash in CRASHES), output
    assert "listening on" not in output, output
    assert "loading model" not in output, output


def test_flags_that_cannot_work_together_are_a_usage_error(tmp_path):
    result = run_serve(tmp_path, "--swap-policy", "drain", "--weight-slots", "1")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith(
        "sitsd: error: --swap-policy drain needs two weight slots"
    )
    assert not any(crash in result.stderr for crash in CRASHES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="--device cuda works here")
def test_device_cuda_without_cuda_is_one_line_before_the_checkpoint_is_read(tmp_path):
    result = run_serve(tmp_path, "--device", "cuda")
    assert result.returncode == 1
    output = result.stdout + result.stderr
    (line,) = error_lines(output)
    assert "--device cuda: this torch" in line
    assert "use --device cpu" in line
    assert not any(crash in output for crash in CRASHES), output
    assert "sitsd.builder" not in output  # no "loading <checkpoint>" line: it was not read


# Moments of start-up, as the log shows them (None: as soon as the process catches the signal,
# during its first imports; before that, Python itself is starting and the signal kills it).
MOMENTS = {
    "during the first imports": None,
    "after the engine code was imported": r"engine code imported",
    "when gRPC listens": r"listening on",
    "when the load starts": r"loading model",
    "while the checkpoint is read": r'"event": "loading /',  # the builder's line
    "while the weights go to the device": r'"event": "checkpoint read in',
    "once the model is built": r"model \S+ ready in",
    "once serving": r"serving \S+ on port",
}


# SIGTERM at every moment; SIGINT takes the same path, so two moments suffice for it.
SIGNALS_AT = [(signal.SIGTERM, name) for name in MOMENTS] + [
    (signal.SIGINT, "during the first imports"),
    (signal.SIGINT, "while the weights go to the device"),
]


@pytest.mark.parametrize(
    ("signum", "moment"),
    [(signum, MOMENTS[name]) for signum, name in SIGNALS_AT],
    ids=[f"{signal.Signals(signum).name}-{name}" for signum, name in SIGNALS_AT],
)
def test_a_signal_at_any_moment_of_start_up_stops_cleanly(tmp_path, moment, signum):
    state_dir = tmp_path / "state"
    process = DaemonProcess(state_dir, "--model", "default")
    try:
        if moment is None:
            wait_until_caught(process)
        else:
            wait_for_log(process, moment)
        process.proc.send_signal(signum)
        code = process.proc.wait(300)
    finally:
        process.terminate()
    assert code == 0, process.log
    assert not any(crash in process.log for crash in CRASHES), process.log
    # Nothing half-written: at most the admin token, whole, and no temporary file.
    left = sorted(p.name for p in state_dir.iterdir()) if state_dir.exists() else []
    assert set(left) <= {"admin-token"}, left
    if left:
        assert len((state_dir / "admin-token").read_text().strip()) >= 32


def wait_until_caught(process: DaemonProcess) -> None:
    """Until sitsd's handlers are in place: the process catches SIGTERM (its SigCgt mask in
    /proc). Python catches SIGINT from its first instant, SIGTERM only once sitsd asks."""
    signum = signal.SIGTERM
    deadline = time.monotonic() + 60
    status = Path(f"/proc/{process.proc.pid}/status")
    while True:
        caught = next(line for line in status.read_text().splitlines() if line.startswith("SigCgt"))
        if int(caught.split()[1], 16) >> (signum - 1) & 1:
            return
        assert time.monotonic() < deadline, "the daemon never caught the signal"
        time.sleep(0.001)


def wait_for_log(process: DaemonProcess, pattern: str) -> None:
    deadline = time.monotonic() + 300
    while not re.search(pattern, process.log):
        assert process.proc.poll() is None, process.log
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{process.log}"
        time.sleep(0.02)
