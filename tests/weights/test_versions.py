"""The version registry's state machine, and the atomically persisted active version."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from sitsd.weights.errors import UnknownVersionError, VersionConflictError, VersionError
from sitsd.weights.versions import (
    ACTIVE_STATE_FILE,
    ActiveVersionStore,
    PersistedVersion,
    VersionRegistry,
    VersionState,
)


def test_a_version_goes_staged_validated_active_retired_and_back_on_rollback():
    reg = VersionRegistry("tiny")
    reg.register("v1", "/w/v1", "d1", "startup", VersionState.ACTIVE)
    reg.register("v2", "/w/v2", "d2", "watch", VersionState.STAGED)
    reg.set_state("v2", VersionState.VALIDATED)
    reg.activate("v2")
    assert (reg.active, reg.previous) == ("v2", "v1")
    assert reg.get("v1").state is VersionState.RETIRED
    assert reg.get("v2").state is VersionState.ACTIVE
    reg.activate("v1")  # rollback
    assert (reg.active, reg.previous) == ("v1", "v2")
    assert reg.get("v2").state is VersionState.RETIRED


def test_rejection_keeps_the_reason_and_forbids_activation():
    reg = VersionRegistry("tiny")
    reg.register("bad", "/w/bad", "d", "watch", VersionState.STAGED)
    reg.set_state("bad", VersionState.REJECTED, "checksum mismatch: model.safetensors")
    assert reg.get("bad").reason == "checksum mismatch: model.safetensors"
    with pytest.raises(VersionError):
        reg.set_state("bad", VersionState.ACTIVE)


def test_an_id_taken_by_other_content_is_refused_but_a_fixed_rejected_one_restages():
    reg = VersionRegistry("tiny")
    reg.register("v2", "/w/v2", "d1", "watch", VersionState.STAGED)
    _, new = reg.register("v2", "/w/v2", "d1", "deploy", VersionState.STAGED)
    assert not new
    with pytest.raises(VersionConflictError, match="exists already"):
        reg.register("v2", "/w/v2", "other", "deploy", VersionState.STAGED)
    reg.set_state("v2", VersionState.REJECTED, "NaN")
    record, new = reg.register("v2", "/w/v2", "fixed", "watch", VersionState.STAGED)
    assert new
    assert record.state is VersionState.STAGED
    assert record.reason == ""


def test_unknown_versions_are_named_in_the_error():
    with pytest.raises(UnknownVersionError, match="nope"):
        VersionRegistry("tiny").get("nope")


def test_the_active_version_persists_per_model(tmp_path):
    store = ActiveVersionStore(tmp_path)
    assert store.load("tiny") == (None, None)
    v1, v2 = PersistedVersion("v1", "/w/v1", "d1"), PersistedVersion("v2", "/w/v2", "d2")
    store.save("tiny", v2, v1)
    store.save("other", v1, None)
    assert ActiveVersionStore(tmp_path).load("tiny") == (v2, v1)
    assert ActiveVersionStore(tmp_path).load("other") == (v1, None)
    assert oct((tmp_path / ACTIVE_STATE_FILE).stat().st_mode & 0o777) == "0o600"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


SAVE_FOREVER = """
import sys
from sitsd.weights.versions import ActiveVersionStore, PersistedVersion
store, i = ActiveVersionStore(sys.argv[1]), 0
while True:
    i += 1
    store.save("tiny", PersistedVersion(f"v{i}", f"/w/v{i}" * 50, "d" * 64), None)
"""


def test_a_writer_killed_mid_save_leaves_a_whole_state_file(tmp_path):
    ActiveVersionStore(tmp_path).save("tiny", PersistedVersion("v0", "/w/v0", "d"), None)
    # A separate interpreter that imports only sitsd (a clean clone has no `tests` package on
    # a spawned child's path).
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVE_FOREVER, str(tmp_path)], stderr=subprocess.PIPE
    )
    try:
        state = tmp_path / ACTIVE_STATE_FILE
        first = state.stat().st_mtime_ns
        deadline = time.monotonic() + 30
        while state.stat().st_mtime_ns == first:  # wait until it is rewriting in a loop
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    body = json.loads((tmp_path / ACTIVE_STATE_FILE).read_text())  # never half a file
    active, _ = ActiveVersionStore(tmp_path).load("tiny")
    assert active is not None
    assert active.version == body["models"]["tiny"]["active"]["version"]
