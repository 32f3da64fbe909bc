#!/usr/bin/env bash
# Wheels the GPU machine's python3 (3.12, manylinux x86_64) lacks, at the versions this
# checkout's .venv has, into .whl/ (git ignores it; carry it with a device call, and
# scripts/device-check.sh installs it there): the daemon's gRPC, protobuf, structlog,
# OpenTelemetry, watchdog, gguf and llguidance, and the HTTP API's FastAPI, uvicorn, pydantic
# and theirs (the end-to-end tests' daemons serve HTTP too). About 15 MB.
#   scripts/device-wheels.sh [DIR]   (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
names='gguf grpcio grpcio-health-checking grpcio-reflection protobuf structlog opentelemetry-.*
googleapis-common-protos watchdog llguidance fastapi starlette pydantic pydantic-core uvicorn h11
anyio sniffio annotated-types annotated-doc typing-inspection click idna typing-extensions'
pattern=$(echo $names | sed 's/-/[-_]/g; s/ /|/g')
list=$(mktemp)
.venv/bin/pip freeze | grep -i -E "^($pattern)==" > "$list"
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d "$dest" -r "$list" 2>&1 \
  | grep -v "^WARNING: Location" || true
echo "$(wc -l < "$list") packages, $(ls "$dest"/*.whl | wc -l) wheels in $dest"
rm -f "$list"
