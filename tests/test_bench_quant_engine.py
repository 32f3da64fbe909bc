"""`bench.bench_quant_engine`'s table and targets from a run's numbers (the measuring needs a
GPU): with a bf16 run each INT4 format's targets are judged against it; a run of one format
without prefill (an A/B of kernel changes) prints its decode rows, no ratios, no prefill table,
and judges no target."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def engine_bench(monkeypatch):
    """`bench.bench_quant_engine`, with the repository's root on the import path."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    import bench.bench_quant_engine as engine_bench

    return engine_bench


def _run(rates: dict[int, float], prefill_s: float | None) -> dict:
    run: dict = {"weight_bytes": 6e9, "step_weight_bytes": 6e9,
                 "decode": {b: {"decode_tok_s": r} for b, r in rates.items()}}  # fmt: skip
    if prefill_s is not None:
        run["prefill"] = {"wall_s": prefill_s}
    return run


def _results(runs: dict) -> dict:
    return {"copy_bw": 3e12, "matmul_rate": 7e14, "fp8_rate": 1.2e15, "runs": runs}


def test_int4_targets_are_judged_against_the_bf16_run(engine_bench, capsys):
    runs = {"bf16": _run({1: 180.0, 32: 5000.0}, 1.0),
            "int4-g128": _run({1: 420.0, 32: 8000.0}, 1.1),
            "fp8": _run({1: 200.0, 32: 6000.0}, 0.7)}  # fmt: skip
    checks = dict(engine_bench.print_table(_results(runs), [1, 32], 128))
    out = capsys.readouterr().out
    assert "prefill, 64 x 512 tokens" in out
    assert checks["int4-g128 batch 1 >= 2.3x bf16: 2.33x"] is True
    assert checks["int4-g128 batch 32 >= 1.8x bf16: 1.60x"] is False
    assert checks["int4-g128 never slower than bf16: worst 1.60x at batch 32"] is True
    assert checks["FP8 prefill >= 1.3x bf16: 1.43x"] is True
    # the floor: 6 GB of weights and Llama-3-8B's KV (131,072 bytes a token) at 192 tokens a
    # sequence (the prompt's 128 and half the new ones), at 3 TB/s: 2.0084 ms a step at
    # batch 1, so 420 tok/s is 0.84 of it
    assert checks["int4-g128 batch 1 at >= 0.65 of its floor: 0.84"] is True


def test_one_format_without_prefill_prints_its_rows_and_judges_nothing(engine_bench, capsys):
    runs = {"int4-g128": _run({1: 420.0, 32: 8000.0}, None)}
    assert engine_bench.print_table(_results(runs), [1, 32], 128) == []
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("int4-g128 ")]
    # batch 32 reads 32 x 192 tokens of KV beside the weights: 2.2684 ms a step, so 8000 tok/s
    # is 0.57 of its floor
    assert [(row[2], row[3], row[-2], row[-1]) for row in rows] == [
        ("1", "420", "0.84", "-"),
        ("32", "8000", "0.57", "-"),
    ]
    assert "prefill" not in out
    assert "targets" not in out
