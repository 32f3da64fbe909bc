"""Hot-swap on the GPU: CUDA graphs per weight slot, staging on a side stream, a flip copies
nothing, canary probes in captured mixed-step graphs (marker `gpu`)."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch

from sitsd.builder import build_runner
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig, WeightsConfig
from sitsd.model.llama import weight_copy_plan
from sitsd.model.qlinear import INT4_DEQUANT_FROM_ROWS
from tests.runtime.test_prompt_logprobs import serve, transformers_logprobs
from tests.runtime.test_weight_slots import greedy, tiny

pytestmark = pytest.mark.gpu


def gpu_runner(tensors, arch, eager: bool, version: str):
    cfg = SitsdConfig(
        model=ModelConfig(device="cuda", dtype="float32", enforce_eager=eager, max_model_len=256),
        cache=CacheConfig(num_blocks=64, block_size=16),  # the pool fixed: runners coexist
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        weights=WeightsConfig(weight_slots="2"),
    )
    return build_runner(cfg, arch, tensors, version)


def test_each_slot_replays_its_own_graphs_and_the_flip_moves_no_memory(rng):
    arch, first = tiny(random.randrange(1000))
    _, second = tiny(random.randrange(1000, 2000))
    runner, info = gpu_runner(first, arch, eager=False, version="v1")
    assert info.num_weight_slots == 2
    assert sorted(runner.slot_graphs) == [0, 1]
    slots = runner.slots
    standby = slots.standby
    addresses = [t.data_ptr() for _, t in slots.weights(standby).named_tensors()]
    slots.release(standby)
    slots.copy_into(standby, second, chunk_bytes=4096)  # side stream, many chunks
    slots.fill(standby, "v2")
    assert [t.data_ptr() for _, t in slots.weights(standby).named_tensors()] == addresses
    prompts = {f"r{i}": [rng.randrange(arch.vocab_size) for _ in range(rng.randrange(4, 30))]
               for i in range(4)}  # fmt: skip
    before = torch.cuda.memory_allocated()
    slots.activate("v2")  # the commit: an index
    assert torch.cuda.memory_allocated() == before
    # Decode-only steps replay the graphs of each request's slot; both versions in one step.
    mixed = greedy(runner, {f"{r}-{v}": (p, v) for r, p in prompts.items()
                            for v in ("v1", "v2")}, 8)  # fmt: skip
    for version, tensors in (("v1", first), ("v2", second)):
        eager, _ = gpu_runner(tensors, arch, eager=True, version=version)
        want = greedy(eager, {r: (p, version) for r, p in prompts.items()}, 8)
        assert {r: mixed[f"{r}-{version}"] for r in prompts} == want
        del eager
        torch.cuda.empty_cache()


def test_validation_on_the_gpu_finds_a_nan_in_any_chunk_of_a_pageable_tensor():
    from sitsd.weights.checks import ServingModel, VersionRejected, check_finite

    arch, tensors = tiny(random.randrange(1000))
    serving = ServingModel(arch, {}, (), torch.bfloat16, torch.device("cuda"))
    names = sorted(tensors)
    check_finite(tensors, names, serving, chunk_bytes=4096)  # many chunks, two pinned buffers
    name = max(names, key=lambda n: tensors[n].numel())
    bad = dict(tensors)
    bad[name] = tensors[name].clone()
    bad[name].view(-1)[-1] = float("nan")  # in the last chunk
    with pytest.raises(VersionRejected, match=name):
        check_finite(bad, names, serving, chunk_bytes=4096)
    bad[name] = tensors[name].clone()
    bad[name].view(-1)[0] = float("inf")  # in the first
    with pytest.raises(VersionRejected, match=name):
        check_finite(bad, names, serving, chunk_bytes=4096)


def test_staging_copies_measure_their_transfer_time_and_keep_their_pinned_buffers():
    arch, first = tiny(random.randrange(1000))
    _, second = tiny(random.randrange(1000, 2000))
    runner, _ = gpu_runner(first, arch, eager=True, version="v1")
    slots = runner.slots
    standby = slots.standby
    assert slots.copy_seconds == 0.0
    seen = []
    slots.release(standby)
    started = time.perf_counter()
    nbytes = slots.copy_into(standby, second, chunk_bytes=4096,
                             on_progress=lambda d, t: seen.append(slots.copy_seconds))  # fmt: skip
    wall = time.perf_counter() - started
    first_copy = slots.copy_seconds
    assert 0.0 < first_copy <= wall
    assert seen == sorted(seen), "it grows as the copy goes"
    pinned = [b.data_ptr() for b in slots._upload._buffers]
    slots.fill(standby, "v2")
    slots.release(standby)
    assert slots.copy_into(standby, first, chunk_bytes=4096) == nbytes
    assert slots.copy_seconds > first_copy
    assert [b.data_ptr() for b in slots._upload._buffers] == pinned, "no new pinned memory"


def test_version_checks_and_pushes_upload_through_the_pinned_buffers_made_at_start_up():
    """Allocating pinned memory stalls the engine's launches: the slots make their buffers
    before serving, and a version's check and a push's writer go through them too."""
    from sitsd.runtime.slot_writer import SlotWriter
    from sitsd.weights.checks import ServingModel, check_finite

    arch, first = tiny(random.randrange(1000))
    _, second = tiny(random.randrange(1000, 2000))
    runner, _ = gpu_runner(first, arch, eager=True, version="v1")
    slots = runner.slots
    uploads = slots.pinned_uploads()
    assert uploads is not None, "made with the slots, before any copy"
    pinned = [b.data_ptr() for b in uploads._buffers]
    serving = ServingModel(arch, {}, (), torch.float32, torch.device("cuda"))
    check_finite(second, sorted(second), serving, chunk_bytes=4096, uploads=uploads)
    checked = uploads.busy_s
    assert checked > 0.0, "the check's uploads went through the slots' buffers"
    standby = slots.standby
    slots.release(standby)
    writer = SlotWriter(slots.views(standby), slots.views(slots.active),
                        chunk_bytes=4096, uploads=uploads)  # fmt: skip
    for name, tensor in second.items():  # host tensors: uploaded in many chunks
        writer.write(name, tensor)
    writer.sync()
    uploads.wait()
    assert uploads.busy_s > checked, "so did the writer's"
    assert [b.data_ptr() for b in uploads._buffers] == pinned, "no new pinned memory"
    got = {name: view for view, name in weight_copy_plan(arch, slots.weights(standby))}
    for name, tensor in second.items():
        torch.testing.assert_close(got[name], tensor.cuda(), rtol=0, atol=0, msg=name)


def test_canary_probes_in_captured_mixed_graphs_equal_transformers_log_softmax(rng):
    seeds = random.sample(range(1000), 2)
    arch, first = tiny(seeds[0])
    _, second = tiny(seeds[1])
    runner, _ = gpu_runner(first, arch, eager=False, version="v1")
    assert runner.slot_mixed, "steps with prompt tokens replay mixed-step graphs"
    slots = runner.slots
    slots.release(slots.standby)
    slots.copy_into(slots.standby, second)
    slots.fill(slots.standby, "v2")
    requests = {f"r{i}": ([rng.randrange(arch.vocab_size) for _ in range(9)], "v1", 10)
                for i in range(3)}  # fmt: skip
    probes = [([rng.randrange(arch.vocab_size) for _ in range(37)], "v1"),
              ([rng.randrange(arch.vocab_size) for _ in range(21)], "v2")]  # fmt: skip
    alone, _, _ = serve(runner, requests, [])
    tokens, got, _ = serve(runner, requests, probes)
    assert tokens == alone
    for (prompt, version), logprobs in zip(probes, got):
        want = transformers_logprobs(seeds[0] if version == "v1" else seeds[1], prompt)
        torch.testing.assert_close(logprobs.cpu(), want, atol=2e-3, rtol=0)


def test_a_slot_restaged_across_precisions_replays_new_graphs_equal_to_a_fresh_runner(
    rng, tmp_path
):
    # Steps of up to 1024 tokens: the INT4 slot's prompts (~600 tokens in one step) run as
    # dequantize + cuBLAS in the workspace a two-slot dense start-up keeps for such a version.
    from sitsd.builder import standby_int4_workspace_numel
    from sitsd.weights import load_checkpoint
    from tests.model.quant_checkpoints import write_quantized_llama
    from tests.weights.tiny_models import write_tiny_llama

    seed = random.randrange(1000)
    write_tiny_llama(tmp_path / "dense", seed=seed)
    write_quantized_llama(tmp_path / "int4", "awq", seed=seed)
    dense, int4 = load_checkpoint(tmp_path / "dense"), load_checkpoint(tmp_path / "int4")
    runner, _ = build_fresh(dense, "dense", eager=False, max_tokens=1024)
    workspace = [t.numel() for t in runner.model.kernels.scratch if t.dtype == torch.float32]
    assert workspace == [standby_int4_workspace_numel(dense.arch)]
    slots = runner.slots
    standby = slots.standby
    slots.release(standby)
    slots.copy_into(standby, int4.tensors, chunk_bytes=4096, source=int4.quant)
    assert slots.take_restructured(standby)  # INT4 layouts: new tensors
    runner.recapture_graphs(standby)
    slots.fill(standby, "int4")
    assert slots.precision(standby).startswith("int4-g32")
    prompts = {f"r{i}": [rng.randrange(dense.arch.vocab_size) for _ in range(rng.randrange(4, 30))]
               for i in range(4)}  # fmt: skip
    long = {f"long{i}": [rng.randrange(dense.arch.vocab_size) for _ in range(200)]
            for i in range(3)}  # fmt: skip
    assert sum(map(len, long.values())) >= INT4_DEQUANT_FROM_ROWS
    mixed = greedy(runner, {f"{r}-{v}": (p, v) for r, p in prompts.items()
                            for v in ("dense", "int4")}, 8)  # fmt: skip
    long_int4 = greedy(runner, {r: (p, "int4") for r, p in long.items()}, 4)
    for version, ckpt in (("dense", dense), ("int4", int4)):
        eager, _ = build_fresh(ckpt, version, max_tokens=1024)  # as start-up builds it, eager
        want = greedy(eager, {r: (p, version) for r, p in prompts.items()}, 8)
        assert {r: mixed[f"{r}-{version}"] for r in prompts} == want
        if version == "int4":
            assert long_int4 == greedy(eager, {r: (p, "int4") for r, p in long.items()}, 4)
        del eager
        torch.cuda.empty_cache()


def test_a_slot_restaged_across_precisions_is_captured_beside_serving_from_the_other(rng, tmp_path):
    # `recapture_graphs(beside_serving=True)` runs on a thread of its own while this one goes
    # on serving from the active slot (graph replays, KV writes): what is served meanwhile is
    # what an eager runner computes (the warm-ups wrote no KV and none of the serving kernels'
    # scratch, the capture stopped nothing), and the new graphs then replay the INT4 version
    # as a fresh runner computes it. Contexts of up to 1024 tokens make decode attention split
    # (4 splits at 8 sequences) and merge through its counters, which the warm-ups of their
    # own model must not touch.
    from sitsd.weights import load_checkpoint
    from tests.model.quant_checkpoints import write_quantized_llama
    from tests.weights.tiny_models import write_tiny_llama

    seed = random.randrange(1000)
    write_tiny_llama(tmp_path / "dense", seed=seed)
    write_quantized_llama(tmp_path / "int4", "awq", seed=seed)
    for name in ("dense", "int4"):  # RoPE takes any position: longer contexts, same weights
        config_path = tmp_path / name / "config.json"
        config = json.loads(config_path.read_text())
        config["max_position_embeddings"] = 1024
        config_path.write_text(json.dumps(config))
    dense, int4 = load_checkpoint(tmp_path / "dense"), load_checkpoint(tmp_path / "int4")
    prompts = {f"r{i}": [rng.randrange(dense.arch.vocab_size) for _ in range(rng.randrange(4, 30))]
               for i in range(4)}  # fmt: skip
    want = {}
    for version, ckpt in (("dense", dense), ("int4", int4)):
        eager, _ = build_fresh(ckpt, version)
        want[version] = greedy(eager, {r: (p, version) for r, p in prompts.items()}, 8)
        del eager
        torch.cuda.empty_cache()
    runner, _ = build_fresh(dense, "dense", eager=False, max_model_len=1024)
    serving_scratch = runner.model.kernels.scratch
    assert serving_scratch, "decode attention merges its splits through counters"
    slots = runner.slots
    standby = slots.standby
    slots.release(standby)
    slots.copy_into(standby, int4.tensors, chunk_bytes=4096, source=int4.quant)
    assert slots.take_restructured(standby)
    done, outcome = threading.Event(), []

    def capture() -> None:
        try:
            outcome.append(runner.recapture_graphs(standby, beside_serving=True))
        except BaseException as exc:  # reported below, on the test's thread
            outcome.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=capture)
    thread.start()
    served = 0
    while not done.is_set() or not served:
        assert greedy(runner, {r: (p, "dense") for r, p in prompts.items()}, 8) == want["dense"]
        served += 1
    thread.join()
    assert isinstance(outcome[0], float), outcome
    assert sorted(runner.slot_graphs) == [0, 1]
    assert runner.slot_mixed[standby].captured
    torch.cuda.synchronize()
    for t in serving_scratch:  # each launch leaves its counters zero; nothing else wrote them
        if t.dtype == torch.int32:
            assert not t.count_nonzero(), t
    slots.fill(standby, "int4")
    both = greedy(runner, {f"{r}-{v}": (p, v) for r, p in prompts.items()
                           for v in ("dense", "int4")}, 8)  # fmt: skip
    for version in ("dense", "int4"):
        assert {r: both[f"{r}-{version}"] for r in prompts} == want[version], version
    print(f"captured beside serving in {outcome[0]:.2f} s, {served} batches served meanwhile")


def test_a_model_beside_serving_keeps_kernel_scratch_of_its_own(tmp_path):
    # What the warm-ups beside serving compute with: the same kernels, other counters and
    # (for an INT4 start-up version) another dequantize workspace of the same size.
    from sitsd.builder import model_beside_serving
    from sitsd.weights import load_checkpoint
    from tests.model.quant_checkpoints import write_quantized_llama

    write_quantized_llama(tmp_path / "int4", "awq")
    ckpt = load_checkpoint(tmp_path / "int4")
    runner, _ = build_fresh(ckpt, "int4")
    serving = runner.model.kernels
    cfg = ModelConfig(device="cuda", dtype="float32")
    workspace = next((t for t in serving.scratch if t.dtype == torch.float32), None)
    twin = model_beside_serving(ckpt.arch, torch.device("cuda"), cfg, 8, 256, workspace).kernels
    assert twin.name == serving.name
    assert workspace is not None, "an INT4 start-up version has a dequantize workspace"
    shapes = [(t.dtype, t.shape) for t in serving.scratch]
    assert [(t.dtype, t.shape) for t in twin.scratch] == shapes
    assert not {t.data_ptr() for t in twin.scratch} & {t.data_ptr() for t in serving.scratch}


def build_fresh(ckpt, version: str, eager: bool = True, max_tokens: int = 256,
                dtype: str = "float32", max_model_len: int = 256):  # fmt: skip
    """A two-slot runner on CUDA for `ckpt` (a fixed KV pool: runners coexist)."""
    cfg = SitsdConfig(
        model=ModelConfig(
            device="cuda", dtype=dtype, enforce_eager=eager, max_model_len=max_model_len
        ),
        cache=CacheConfig(num_blocks=64, block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_tokens),
        weights=WeightsConfig(weight_slots="2"),
    )
    return build_runner(cfg, ckpt.arch, ckpt.tensors, version, source=ckpt.quant)
