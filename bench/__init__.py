"""sitsd's benchmarks: each runs from the repository root as `python -m bench.NAME`.

Benchmarks (the usage line of each is in its docstring):
    bench_cpu, bench_telemetry, bench_tiers, bench_swap, sim_tiers,  CPU (bench_swap, bench_tiers,
    bench_hostile                                                    bench_hostile also on a GPU)
    bench_gpu, bench_mixed, bench_pdl, bench_gemv, bench_skinny,     GPU only
    bench_kernels, profile_decode, gpu_busy
    make_random_model                                                writes a model directory

What they share, each in one place:
    timing         the one way to time a call (CUDA events or the host clock), percentiles
    floors         copy bandwidth and bf16 matmul rate, and the decode floors derived from them
    shapes         the Llama-3-8B and SmolLM2 shapes and their per-layer GEMM shapes
    engine_setup   random in-memory checkpoints, the engine's CUDA config, graph replay time
    daemon         `sitsd serve` in a subprocess

Never part of the test run (`tests/test_bench_package.py` only imports the modules and reads
their source); nothing in `sitsd` imports `bench`, and no benchmark imports `tests` (shared
doubles live in `sitsd.testing`). Past measurements are in `bench/results/`.
"""
