#!/usr/bin/env bash
# The SLA-tier overload benchmark on the GPU machine: random Llama-3-8B weights written as a
# Hugging Face directory, then bench.bench_tiers against `sitsd serve --device cuda` with the
# built-in (SITS, GPU) tier targets. Needs the daemon's wheels in .whl/ (scripts/device-wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
[ -f /tmp/llama-3-8b/config.json ] || python3 -m bench.make_random_model /tmp/llama-3-8b --shape llama-3-8b
python3 -m bench.bench_tiers --model /tmp/llama-3-8b --device cuda --tiers builtin \
  --prompt-tokens 128:512 --max-tokens 64:256 --max-num-seqs 64 \
  --max-num-batched-tokens 2048 --duration "${DURATION:-45}" --capacity-duration 25 \
  --deadline 30 --out "${OUT:-/tmp}" "$@"
