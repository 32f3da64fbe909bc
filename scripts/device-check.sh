#!/usr/bin/env bash
# GPU checks on the lent device machine (its python3 has torch, triton, transformers):
#   scripts/device-check.sh tests   GPU tests (kernels + runtime), summary last
#   scripts/device-check.sh bench   python3 -m bench.bench_gpu, table last
#   scripts/device-check.sh run CMD...   CMD with the same set-up (e.g. python3 -m bench.bench_gemv)
# Wheels for packages the device lacks travel in .whl/ (scripts/device-wheels.sh makes them); the
# SmolLM2 GGUF travels in two parts (.smol/part1, .smol2/part2: one call's transfer is capped at
# 64 MiB) and is joined here.
set -uo pipefail
cd "$(dirname "$0")/.."
# A call that carries no wheels (its transfer went to something else) uses the ones a
# previous call on the same warm machine installed.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/smol
[ -f .smol/part1 ] && cp .smol/part1 /tmp/smol/part1
if [ -f .smol2/part2 ] && [ -f /tmp/smol/part1 ]; then
  cat /tmp/smol/part1 .smol2/part2 > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
fi
[ -f /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf ] && \
  export SITSD_TEST_SMOLLM2=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONUNBUFFERED=1
case "${1:-tests}" in
  # With no paths, the files that hold GPU tests (others may import packages the device lacks).
  # A test stuck past the timeout dumps every thread's stack and ends the run (the thread
  # method: a signal cannot interrupt a wait inside a CUDA call).
  tests) shift
         if [ $# -eq 0 ] || [[ "${1:0:1}" == "-" ]]; then
           set -- $(grep -rlE "mark\.gpu|marks=pytest\.mark\.gpu" tests --include="test_*.py" \
                    | sort) "$@"
         fi
         python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
           --import-mode=importlib --timeout 240 --timeout-method thread "$@" 2>&1 \
           | tee "${OUT:-/tmp}/gpu-tests.log" | tail -40 ;;
  bench) shift; python3 -m bench.bench_gpu --json "${OUT:-/tmp}/bench_gpu.json" "$@" 2>&1 \
           | tee "${OUT:-/tmp}/bench-gpu.log" ;;
  run) shift; "$@" ;;
esac
