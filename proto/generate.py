"""Generate the Python gRPC stubs of `proto/sitsd/api/v1/*.proto` into `sitsd/api/v1/`.

Runs `grpc_tools.protoc` with `-Iproto`, so the stubs import each other as
`from sitsd.api.v1 import inference_pb2`. The stubs are committed; `make proto` runs this and
`tests/api/test_proto_stubs.py` checks that running it changes nothing. The package's
`sitsd/api/v1/__init__.py` is written by hand, not here.

Usage: python proto/generate.py [--out DIR]   (DIR defaults to the repository root)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILES = ("sitsd/api/v1/inference.proto", "sitsd/api/v1/admin.proto")


def generate(out_dir: Path) -> None:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` for every proto under `out_dir`.

    Raises:
        RuntimeError: protoc failed (its messages went to stderr).
    """
    # Imported here: grpcio-tools is a development dependency, the daemon never needs it.
    import grpc_tools
    from grpc_tools import protoc

    include_dir = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include_dir}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / name) for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="directory the sitsd/api/v1/ stubs go under (default: repo root)",
    )
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
