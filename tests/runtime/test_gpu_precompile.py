"""A capture beside serving into INT4 loads its kernels from Triton's disk cache, compiled by a
child process first (`sitsd.runtime.precompile`; marker `gpu`).

The check runs in a process of its own with an empty Triton cache (this one has compiled the
INT4 kernels already, in memory), and listens to Triton's compiles there: while the slot's
graphs are captured again, no INT4 kernel may be compiled in that process, only loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sitsd.children import module_command

pytestmark = pytest.mark.gpu

INT4_KERNELS = {
    "_int4_matmul_kernel", "_split_sum_kernel", "int4_mma_kernel", "int4_gemv_kernel",
    "_int4_dequant_kernel",
}  # fmt: skip


def test_a_capture_into_int4_beside_serving_compiles_no_int4_kernel_itself(tmp_path):
    from tests.model.quant_checkpoints import write_quantized_llama
    from tests.weights.tiny_models import write_tiny_llama

    write_tiny_llama(tmp_path / "dense", seed=3)
    write_quantized_llama(tmp_path / "int4", "awq", seed=3)
    argv, env = module_command("tests.runtime.test_gpu_precompile",
                               TRITON_CACHE_DIR=str(tmp_path / "triton"))  # fmt: skip
    done = subprocess.run([*argv, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=900, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    assert report["build_compiled"], "the listener hears the start-up's compiles"
    assert any("compiled in a child process" in m for m in report["logged"]), report["logged"]
    int4_compiled = [n for n in report["capture_compiled"] if n in INT4_KERNELS]
    assert not int4_compiled, "compiled in the capture's process:\n" + "\n".join(
        report["compiled_for"]
    )
    assert set(report["capture_loaded"]) & INT4_KERNELS, "the capture loaded INT4 kernels"
    assert report["served"] == 4 * 6, "the INT4 slot's graphs serve"


def _capture_in_a_fresh_process(root: Path) -> dict[str, object]:
    """Build a two-slot runner on the dense model (bfloat16, as served: `mma` runs from 3
    rows), stage the INT4 one into its standby slot and capture that slot beside serving,
    listening to Triton and to the runner's log; what happened, as a dict."""
    import logging

    import triton

    from sitsd.weights import load_checkpoint
    from tests.runtime.test_gpu_weight_slots import build_fresh
    from tests.runtime.test_weight_slots import greedy

    heard: list[tuple[str, bool]] = []

    compiled: list[str] = []

    def listener(*, src, cache_hit: bool = False, **_: object) -> None:
        heard.append((getattr(src, "name", str(src)), cache_hit))
        if not cache_hit:  # what it was compiled for, to tell what the child's plan missed
            compiled.append(f"{src.name} {src.signature} {src.constants}")

    triton.knobs.compilation.listener = listener
    dense, int4 = load_checkpoint(root / "dense"), load_checkpoint(root / "int4")

    logged: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logging.getLogger("sitsd.runtime.model_runner").addHandler(Record())
    logging.getLogger("sitsd.runtime.model_runner").setLevel(logging.INFO)
    runner, _ = build_fresh(dense, "dense", eager=False, dtype="bfloat16")
    build_compiled = [name for name, hit in heard if not hit]
    heard.clear()
    slots = runner.slots
    standby = slots.standby
    slots.release(standby)
    slots.copy_into(standby, int4.tensors, chunk_bytes=4096, source=int4.quant)
    assert slots.take_restructured(standby)
    compiled.clear()
    runner.recapture_graphs(standby, beside_serving=True)
    capture = list(heard)
    slots.fill(standby, "int4")
    prompts = {f"r{i}": [(7 * i + j) % dense.arch.vocab_size for j in range(5 + 3 * i)]
               for i in range(4)}  # fmt: skip
    served = greedy(runner, {r: (p, "int4") for r, p in prompts.items()}, 6)
    return {
        "build_compiled": build_compiled,
        "capture_compiled": [name for name, hit in capture if not hit],
        "capture_loaded": [name for name, hit in capture if hit],
        "logged": logged,
        "compiled_for": compiled,
        "served": sum(len(tokens) for tokens in served.values()),
    }


if __name__ == "__main__":
    print(json.dumps(_capture_in_a_fresh_process(Path(sys.argv[1]))))
