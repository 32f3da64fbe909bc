"""What an IPC push decides from its handles, on the CPU: which tensors share a storage (opened
once), each tensor as a view of its storage, which of the producer's counts to release, and the
checks that keep a view inside the memory it shares. Opening CUDA handles needs the GPU
(`tests/e2e/test_push_ipc_gpu.py`); here CPU storages stand for the opened ones."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from sitsd.client.tensors import DTYPE_NAMES, flat_copy
from sitsd.model.llama import build_weights
from sitsd.runtime.slot_writer import SlotWriter
from sitsd.runtime.weight_slots import WeightSlots
from sitsd.weights.checks import VersionRejected
from sitsd.weights.push_ipc import (
    IpcHandle,
    IpcMappings,
    IpcPush,
    counter_of,
    counters_to_release,
    first_of_each_storage,
    storage_key,
    storage_views,
)
from sitsd.weights.push_plan import PushPlan, TensorSpec
from tests.runtime.test_slot_writer import named
from tests.runtime.test_weight_slots import tiny


def handles_of(
    tensors: list[tuple[str, torch.Tensor]], count_per_storage: bool
) -> tuple[list[IpcHandle], dict[tuple[bytes, int], torch.UntypedStorage]]:
    """Handles as a trainer's reduction would describe `tensors` (a storage's address standing
    for its CUDA handle), a count per tensor or per storage; the storages by key."""
    handles, storages = [], {}
    for i, (name, t) in enumerate(tensors):
        storage = t.untyped_storage()
        handle = storage.data_ptr().to_bytes(8, "little")
        counter = (b"/torch_counters", storage.data_ptr() if count_per_storage else 10_000 + i)
        handles.append(IpcHandle(
            name=name, stride=tuple(t.stride()), storage_offset=t.storage_offset(),
            storage_handle=handle, storage_size_bytes=storage.nbytes(), storage_offset_bytes=0,
            ref_counter_handle=counter[0], ref_counter_offset=counter[1], event_handle=b"",
            event_sync_required=False,
        ))  # fmt: skip
        storages[(handle, 0)] = storage
    return handles, storages


def plan_of(tensors: list[tuple[str, torch.Tensor]]) -> PushPlan:
    return PushPlan(tuple(TensorSpec(n, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors))


def random_tensors(rng: random.Random, count: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return [
        (f"t{i}", torch.randn(rng.randrange(1, 30), rng.randrange(1, 30), generator=gen).to(
            rng.choice(dtypes)))
        for i in range(count)
    ]  # fmt: skip


@pytest.mark.parametrize("count_per_storage", [False, True])
def test_views_of_one_flat_buffer_open_one_storage_and_rebuild_every_tensor_exactly(
    rng,
    count_per_storage,
):
    tensors = random_tensors(rng, rng.randrange(3, 20))
    flat = flat_copy(tensors)
    apart = random_tensors(rng, 2)  # tensors of storages of their own, too
    apart[1] = (apart[1][0], apart[1][1].t())  # a strided view
    sent = [*flat, *apart]
    handles, storages = handles_of(sent, count_per_storage)
    firsts = first_of_each_storage(handles)
    assert [h.name for h in firsts] == [flat[0][0], apart[0][0], apart[1][0]]
    IpcPush(plan_of(sent), handles).check()
    views = storage_views(plan_of(sent), handles, storages)
    for (name, tensor), view in zip(sent, views, strict=True):
        assert view.dtype == tensor.dtype, name
        assert view.stride() == tensor.stride(), name
        assert view.data_ptr() == tensor.data_ptr(), name  # a view, not a copy
        assert torch.equal(view, tensor), name
    held = {counter_of(h) for h in firsts}
    released = counters_to_release(handles, held)
    if count_per_storage:  # one count per storage, held by its opening
        assert released == []
    else:  # every tensor's own count, but the openings'
        assert released == [counter_of(h) for h in handles if counter_of(h) not in held]
        assert len(released) == len(sent) - 3


def test_counts_of_storages_never_opened_are_released_each_once(rng):
    tensors = random_tensors(rng, 6)
    handles, _ = handles_of(flat_copy(tensors[:4]) + tensors[4:], count_per_storage=True)
    held = {counter_of(handles[0])}  # the flat buffer opened, the last two storages not
    assert counters_to_release(handles, held) == [counter_of(handles[4]), counter_of(handles[5])]


def test_pushed_views_land_in_the_slot_exactly_in_one_write():
    seed = random.randrange(2**20)
    arch, first = tiny(seed)
    _, second = tiny(seed + 1)
    slots = WeightSlots(arch, build_weights(arch, first, "cpu", torch.float32), "v1")
    slots.release(1)
    writer = SlotWriter(slots.views(1), slots.views(0), chunk_bytes=1000)
    rng = random.Random(seed)
    pushed = [(n, t.to(rng.choice([torch.float32, torch.bfloat16]))) for n, t in second.items()]
    sent = flat_copy(pushed)
    handles, storages = handles_of(sent, count_per_storage=True)
    plan = plan_of(sent)
    writer.write_all(plan.names, storage_views(plan, handles, storages))
    got = named(slots, 1)
    for name, tensor in pushed:
        torch.testing.assert_close(got[name], tensor.float(), rtol=0, atol=0, msg=name)
    assert writer.copy_rest() == []


def test_a_view_past_its_storage_or_a_storage_of_two_sizes_is_rejected_by_name(rng):
    tensors = random_tensors(rng, 4)
    flat = flat_copy(tensors)
    handles, _ = handles_of(flat, count_per_storage=True)
    last = handles[-1]
    short = [*handles[:-1], replace(last, storage_offset=last.storage_offset + 10**6)]
    with pytest.raises(VersionRejected, match=f"{last.name}: its view reaches byte"):
        IpcPush(plan_of(flat), short).check()
    # Two sizes for one storage: the first is opened, the other's view was checked against its
    # own (larger) size only.
    grown = replace(last, storage_size_bytes=last.storage_size_bytes * 4)
    with pytest.raises(VersionRejected, match=f"{last.name}: its IPC storage is"):
        IpcPush(plan_of(flat), [*handles[:-1], grown]).check()
    assert storage_key(grown) == storage_key(handles[0])


def test_kept_mappings_are_exactly_the_last_pushs_and_the_others_are_let_go(rng):
    keys = [(bytes([i]) * 66, rng.randrange(0, 2**20)) for i in range(6)]
    storages = {key: torch.UntypedStorage(8) for key in keys}
    kept = IpcMappings()
    first = dict(rng.sample(sorted(storages.items()), 3))
    kept.keep(first)
    assert len(kept) == 3
    assert all(kept.get(key) is storage for key, storage in first.items())
    second = dict(rng.sample(sorted(storages.items()), 3))
    kept.keep(second)
    assert {key for key in keys if kept.get(key) is not None} == set(second)
    assert all(kept.get(key) is storage for key, storage in second.items())
    kept.clear()
    assert len(kept) == 0
    assert all(kept.get(key) is None for key in keys)


@pytest.mark.parametrize("keep", [False, True])
def test_a_push_reuses_the_kept_mappings_only_when_the_daemon_keeps_them(rng, keep):
    from sitsd.weights.push import PushSettings, WeightPushes

    pushes = WeightPushes(None, PushSettings(ipc_keep_mapped=keep))  # type: ignore[arg-type]
    flat = flat_copy(random_tensors(rng, 3))
    handles, _ = handles_of(flat, count_per_storage=True)
    source = pushes.ipc_push(plan_of(flat), handles)
    assert (source.mappings is pushes.ipc_mappings) is keep
    assert source.mappings is None or len(source.mappings) == 0


class _Driver:
    """What `IpcPush._copy` asks of CUDA, on the CPU: an opening is the storage itself (its
    count held), a release and a wait for the producer are recorded."""

    def __init__(self, storages: dict[tuple[bytes, int], torch.UntypedStorage]) -> None:
        self.storages = storages
        self.opened: list[bytes] = []
        self.released: list[tuple[bytes, int]] = []
        self.waited: list[str] = []

    def open(self, handle: IpcHandle, device: torch.device) -> torch.UntypedStorage:
        self.opened.append(handle.storage_handle)
        return self.storages[storage_key(handle)]

    def release(self, counters: list[tuple[bytes, int]], device: torch.device) -> None:
        self.released += counters

    def wait(self, handle: IpcHandle, device: torch.device) -> None:
        self.waited.append(handle.name)


def test_pushes_from_kept_mappings_map_each_buffer_once_and_land_exactly(monkeypatch):
    """Three pushes through kept mappings: the first from a flat buffer maps it; the second,
    from the same buffer, maps nothing, waits for the producer and gives its count back; the
    third, from another buffer, maps that one, and the first buffer's mapping is let go."""
    import contextlib

    import sitsd.weights.push_ipc as push_ipc

    seed = random.randrange(2**20)
    arch, first = tiny(seed)
    slots = WeightSlots(arch, build_weights(arch, first, "cpu", torch.float32), "v1")
    names = sorted(first)
    kept = IpcMappings()
    buffers = [flat_copy([(n, tiny(seed + k)[1][n]) for n in names]) for k in (1, 2)]
    storages: dict[tuple[bytes, int], torch.UntypedStorage] = {}
    for flat in buffers:
        storages |= handles_of(flat, count_per_storage=True)[1]
    driver = _Driver(storages)
    monkeypatch.setattr(push_ipc, "_open", driver.open)
    monkeypatch.setattr(push_ipc, "_release", driver.release)
    monkeypatch.setattr(push_ipc, "_wait_for_producer", driver.wait)
    monkeypatch.setattr(push_ipc.torch.cuda, "device", lambda device: contextlib.nullcontext())
    for n, flat in enumerate([buffers[0], buffers[0], buffers[1]]):
        handles, _ = handles_of(flat, count_per_storage=True)
        handles = [replace(h, event_sync_required=True, event_handle=b"e") for h in handles]
        slots.release(1)
        writer = SlotWriter(slots.views(1), slots.views(0), chunk_bytes=1000)
        before = (len(driver.opened), len(driver.released), len(driver.waited))
        IpcPush(plan_of(flat), handles, kept)._copy(writer, f"v{n}")
        opened, released, waited = (len(driver.opened) - before[0],
                                    len(driver.released) - before[1],
                                    len(driver.waited) - before[2])  # fmt: skip
        assert (opened, released, waited) == [(1, 0, 0), (0, 1, 1), (1, 0, 0)][n]
        assert len(kept) == 1
        assert kept.get(storage_key(handles[0])) is not None, "this push's buffer stays mapped"
        got = named(slots, 1)
        for name, tensor in flat:
            torch.testing.assert_close(got[name], tensor.float(), rtol=0, atol=0, msg=name)
    assert kept.get(storage_key(handles_of(buffers[0], count_per_storage=True)[0][0])) is None
