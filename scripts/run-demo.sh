#!/usr/bin/env bash
# `make run`: start sitsd on the embedded model, stream one chat completion through sitsctl once
# it is healthy, then keep the daemon in the foreground (Ctrl-C stops it gracefully).
# Extra `sitsd serve` flags: make run SITSD_ARGS="--port 50052".
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
ADDRESS="${SITSD_ADDRESS:-localhost:${SITSD_PORT:-50051}}"

"$BIN/sitsd" serve --port "${ADDRESS##*:}" ${SITSD_ARGS:-} &
daemon=$!
# Ctrl-C reaches the daemon too (same process group): wait for its graceful stop. Forwarding a
# second signal would make it exit at once, without letting requests finish.
trap 'wait "$daemon"; exit $?' INT
trap 'kill -TERM "$daemon" 2>/dev/null; wait "$daemon"; exit $?' TERM

if "$BIN/sitsctl" --address "$ADDRESS" health --wait 300 >/dev/null; then
  echo "--- sitsctl chat \"What is the capital of France?\"" >&2
  "$BIN/sitsctl" --address "$ADDRESS" chat --max-tokens 64 --temperature 0 "What is the capital of France?"
  echo "--- sitsd is serving on $ADDRESS (Ctrl-C to stop)" >&2
else
  echo "sitsd did not become healthy; see its log above" >&2
fi
wait "$daemon"
