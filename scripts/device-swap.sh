#!/usr/bin/env bash
# Hot-swap on the lent GPU machine: the GPU weight-slot tests, then bench.bench_swap with
# Llama-3-8B shapes (two ~16 GB versions written under /tmp/swap first, reused while the
# machine stays warm): one daemon per stream count, one swap per policy. Logs go to $OUT.
#   scripts/device-swap.sh [bench_swap flags...]   e.g. --clients 32 --steady 10 --after 6
set -uo pipefail
cd "$(dirname "$0")/.."
# A call that carries no wheels (its transfer went to something else) uses the ones a
# previous call on the same warm machine installed.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" --import-mode=importlib \
  tests/runtime/test_gpu_weight_slots.py 2>&1 | tee "$OUT/gpu-swap-tests.log" | tail -15
python3 -m bench.bench_swap --device cuda --work-dir /tmp/swap --max-load 1000 \
  --json "$OUT/bench_swap_gpu.json" "$@" 2>&1 | tee "$OUT/bench-swap-gpu.log" | grep -v "^$"
cp /tmp/swap/daemon-*.log "$OUT/" 2>/dev/null
