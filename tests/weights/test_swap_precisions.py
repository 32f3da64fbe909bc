"""Hot-swap across precisions on a real in-process engine (the tiny Llama, CPU): its dense
(float32) version and its INT4 version (AWQ) swap both ways under load with every policy, the
canary gate (`--canary-max-kl`) rejects a badly quantized version, bad quantized input is
rejected at staging naming the tensor, and `ListVersions` / `Status` show each version's
precision and weight bytes. The same on the real daemon with SmolLM2:
`tests/e2e/test_swap_precisions.py`."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sitsd.types import FinishReason, SamplingParams
from sitsd.weights.errors import VersionRejectedError
from sitsd.weights.manifest import write_manifest
from sitsd.weights.versions import VersionState
from tests.model.quant_checkpoints import write_quantized_llama
from tests.observability.tools import wait_for
from tests.weights.test_swap_manager import Served
from tests.weights.tiny_versions import write_version

DOWN = "model.layers.1.mlp.down_proj"


def write_int4_version(directory: Path, edit=None, config_edit=None) -> Path:
    """The tiny model (seed 0, as `tiny_versions.write_version`) in AWQ 4 bits, group 32;
    `edit` changes its tensors, `config_edit` its quantization_config, before the manifest."""
    write_quantized_llama(directory, "awq", seed=0)
    if edit is not None:
        path = directory / "model.safetensors"
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path))
    if config_edit is not None:
        config = json.loads((directory / "config.json").read_text())
        config_edit(config["quantization_config"])
        (directory / "config.json").write_text(json.dumps(config))
    write_manifest(directory)
    return directory


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("precisions")
    return {"dense": write_version(root / "dense"), "int4": write_int4_version(root / "int4")}


def fresh(directory: Path, state: Path, queries: list[tuple[list[int], int]], prompt: list[int]):
    """From an engine started fresh on `directory`: the greedy continuations of `queries`, and
    the next-token log-probabilities of every position of `prompt`."""
    served = Served(directory, state)
    try:
        tokens = [served.generate(p, n)[0] for p, n in queries]
        version = served.choice.version
        return tokens, served.run(served.engine.swap_port().prompt_logprobs(prompt, version))
    finally:
        served.close()


class Load:
    """Clients sending greedy requests until stopped; every request's (prompt, tokens with
    their versions, finish reasons)."""

    def __init__(self, served: Served, num_clients: int = 4) -> None:
        self.served = served
        self.stop = threading.Event()
        self.records: list[tuple[list[int], list[tuple[int, str]], list[FinishReason | None]]] = []
        self._clients = [
            asyncio.run_coroutine_threadsafe(self._client(i), served.loop)
            for i in range(num_clients)
        ]

    async def _client(self, seed: int) -> None:
        rng = random.Random(seed + random.randrange(2**30))
        while not self.stop.is_set():
            prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(2, 40))]
            params = SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0.0,
                                    ignore_eos=True)  # fmt: skip
            tokens: list[tuple[int, str]] = []
            finishes: list[FinishReason | None] = []
            self.records.append((prompt, tokens, finishes))
            async for delta in self.served.engine.add_request(prompt, params):
                tokens += [(t, delta.weights_version) for t in delta.new_token_ids]
                finishes.append(delta.finish_reason)

    def done_on(self, version: str) -> int:
        """Requests finished whose every token `version` computed."""
        return sum(bool(fs) and fs[-1] is not None and bool(toks)
                   and {v for _, v in toks} == {version}
                   for _, toks, fs in list(self.records))  # fmt: skip

    def finish(self) -> None:
        self.stop.set()
        for client in self._clients:
            client.result(120)


@pytest.mark.parametrize("policy", ["migrate", "drain", "restart"])
def test_the_dense_and_int4_versions_swap_both_ways_under_load_and_tokens_are_the_new_ones(
    versions, tmp_path, policy, caplog
):
    caplog.set_level(logging.INFO)
    served = Served(versions["dense"], tmp_path / "state")
    try:
        served.manager.register(str(versions["int4"]))
        load = Load(served)
        try:
            wait_for(lambda: load.done_on(served.choice.version) >= 2, 120, "dense requests")
            first = served.swap("int4", policy)
            wait_for(lambda: load.done_on("int4") >= 4, 120, "requests on INT4")
            back = served.swap("dense", policy)
            wait_for(lambda: load.done_on("dense") >= 2, 120, "requests back on the dense version")
        finally:
            load.finish()
        prompt = [random.randrange(1, 300) for _ in range(11)]
        after = served.generate(prompt, 12)
        served.swap("int4", policy)  # the standby slot holds INT4 again: a flip
        after_int4 = served.generate(prompt, 12)
        port = served.engine.swap_port()  # both versions in a slot now
        logprobs = {v: served.run(port.prompt_logprobs(prompt, v)) for v in versions}
    finally:
        served.close()
    assert (first.stage, back.stage) == ("committed", "committed")
    # Each copy of another precision moved the slot's tensors; the stager, not the engine
    # between two steps, made the slot ready for them (`SwapPort.capture_graphs`).
    assert not [r for r in caplog.records if "between two steps" in r.getMessage()]
    finishes = [f for _, _, fs in load.records for f in fs if f is not None]
    assert finishes
    assert set(finishes) == {FinishReason.LENGTH}, finishes  # no failed request
    # Tokens after each commit are the new precision's: against engines started fresh on it.
    only_int4 = [(p, [t for t, _ in toks]) for p, toks, _ in load.records
                 if toks and {v for _, v in toks} == {"int4"}][:4]  # fmt: skip
    want = {
        v: fresh(
            versions[v],
            tmp_path / f"fresh-{v}",
            [(prompt, 12)] + ([(p, len(t)) for p, t in only_int4] if v == "int4" else []),
            prompt,
        )
        for v in versions
    }
    assert after == (want["dense"][0][0], {"dense"})
    assert after_int4 == (want["int4"][0][0], {"int4"})
    assert want["int4"][0][1:] == [t for _, t in only_int4]
    # Each slot computes its own version's distributions, and the two precisions differ far
    # more than the tolerance (greedy tokens of the tiny model may agree under both).
    for v in versions:
        torch.testing.assert_close(logprobs[v], want[v][1], rtol=0, atol=1e-5)
    assert (logprobs["dense"] - logprobs["int4"]).abs().max() > 1e-3


def test_versions_and_status_show_each_versions_precision_and_weight_bytes(versions, tmp_path):
    from sitsd.api import convert

    served = Served(versions["dense"], tmp_path / "state")
    try:
        served.run(served.manager.deploy(str(versions["int4"])))
        view = {v.version: v for v in served.manager.versions().versions}
        status = convert.status_response(
            served.engine.status(), state="serving", uptime_s=1.0, version="x"
        )
        served.swap("int4")
        after = convert.status_response(
            served.engine.status(), state="serving", uptime_s=1.0, version="x"
        )
    finally:
        served.close()
    dense, int4 = view[served.choice.version], view["int4"]
    assert dense.precision == "fp32; lm_head fp32, embedding fp32"
    assert int4.precision == "int4-g32; lm_head bf16, embedding bf16"  # the CPU's int4 path
    assert 0 < int4.weight_bytes < dense.weight_bytes / 2
    proto = convert.weight_version(int4, "standby")
    assert (proto.precision, proto.weight_bytes) == (int4.precision, int4.weight_bytes)
    assert (status.weights_precision, status.weight_bytes) == (dense.precision, dense.weight_bytes)
    assert (after.weights_precision, after.weight_bytes) == (int4.precision, int4.weight_bytes)


def test_the_canary_rejects_a_badly_quantized_version_and_passes_a_good_one(versions, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text('Hello, world! How are you today?\n{"token_ids": [5, 17, 42, 99, 100, 7]}\n')
    # The tiny random model predicts nearly uniform distributions: its INT4 version measures
    # ~0.0002 nats from the dense one, the bad one ~0.01 (another model altogether ~0.03).
    # Every scale off by a random factor in [0.3, 3): still finite, non-zero and well formed.
    bad = write_int4_version(tmp_path / "bad", edit=lambda t: t.update({
        n: v * (0.3 + 2.7 * torch.rand(v.shape)).to(v.dtype)
        for n, v in t.items() if n.endswith(".scales")}))  # fmt: skip
    served = Served(versions["dense"], tmp_path / "state", canary_file=str(canary),
                    canary_max_kl=0.002)  # fmt: skip
    try:
        prompt = [random.randrange(1, 300) for _ in range(9)]
        want, _ = served.generate(prompt)
        with pytest.raises(VersionRejectedError, match=r"canary: mean KL \d"):
            served.run(served.manager.deploy(str(bad), "", served.progress.append))
        rejected = [p for p in served.progress if p.stage == "canary"][-1]
        assert rejected.canary_kl > 0.002
        assert "bad" not in served.slots()
        assert served.generate(prompt) == (want, {served.choice.version})  # serving goes on
        served.progress.clear()
        served.run(served.manager.deploy(str(versions["int4"]), "", served.progress.append))
        _, passed = [p for p in served.progress if p.stage == "canary"]  # started, measured
        assert 0 < passed.canary_kl <= 0.002
        assert served.manager.registry.get("int4").state is VersionState.VALIDATED
    finally:
        served.close()


def _set(name: str, make):
    return lambda t: t.update({name: make(t[name])})


# Bad quantized drops: (tensor edit, config edit, what the rejection names).
BAD_INT4 = {
    "nan-scales": (
        _set(f"{DOWN}.scales", lambda v: v.index_fill(1, torch.tensor([3]), float("nan"))),
        None,
        f"{DOWN}.scales",
    ),
    "zero-scales": (
        _set(f"{DOWN}.scales", lambda v: v.index_fill(0, torch.tensor([1]), 0.0)),
        None,
        f"{DOWN}.scales",
    ),
    "packed-shape": (
        _set(f"{DOWN}.qweight", lambda v: v[:, :-1].contiguous()),
        None,
        f"{DOWN}.qweight",
    ),
    "unknown-method": (None, lambda c: c.update(quant_method="marlin-9bit"), "quant_method"),
    "group-size": (None, lambda c: c.update(group_size=24), "group_size"),
}


@pytest.mark.parametrize("kind", sorted(BAD_INT4))
def test_bad_quantized_input_is_rejected_at_staging_naming_it_while_serving_goes_on(
    versions, tmp_path, kind
):
    edit, config_edit, named = BAD_INT4[kind]
    bad = write_int4_version(tmp_path / f"bad-{kind}", edit, config_edit)
    served = Served(versions["dense"], tmp_path / "state")
    try:
        served.run(served.manager.deploy(str(versions["int4"])))  # in the standby slot
        slots = served.slots()
        prompt = [random.randrange(1, 300) for _ in range(9)]
        want = served.generate(prompt)
        with pytest.raises(VersionRejectedError, match=re.escape(named)) as raised:
            served.run(served.manager.deploy(str(bad)))
        print(raised.value)
        assert served.manager.registry.get(bad.name).state is VersionState.REJECTED
        assert served.slots() == slots  # the standby slot was never touched
        assert served.generate(prompt) == want
        assert served.swap("int4").stage == "committed"  # and the good INT4 still commits
    finally:
        served.close()
