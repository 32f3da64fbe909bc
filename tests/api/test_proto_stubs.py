"""The committed gRPC stubs are exactly what `proto/generate.py` produces from the protos."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = Path("sitsd/api/v1")
GENERATED = sorted(
    f"{stem}{suffix}"
    for stem in ("inference", "admin")
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
)


def test_regenerating_the_stubs_changes_nothing(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=60,
    )

    produced = sorted(p.name for p in (tmp_path / STUB_DIR).iterdir())
    assert produced == GENERATED
    for name in GENERATED:
        committed = (REPO_ROOT / STUB_DIR / name).read_bytes()
        fresh = (tmp_path / STUB_DIR / name).read_bytes()
        assert fresh == committed, f"{STUB_DIR / name} is stale: run `python proto/generate.py`"
