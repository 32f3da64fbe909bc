"""The slot writer: a pushed version written into a released slot in pieces, the rest copied
from the serving slot, values checked where they will serve."""

from __future__ import annotations

import itertools
import random
import re
import time

import pytest
import torch

from sitsd.model.llama import ServingFormat, build_weights, weight_copy_plan
from sitsd.quant.precision import PrecisionMap
from sitsd.runtime.slot_writer import SlotWriteError, SlotWriter, pieces
from sitsd.runtime.weight_slots import WeightSlots, slot_views
from tests.runtime.test_weight_slots import tiny


def writer_for(
    seed: int, tied: bool = False, chunk_bytes: int = 1000, device: str = "cpu", **options: float
):
    """Two float32 slots of a tiny model on `device` (v1 active), a writer into the second
    (`options`: SlotWriter's keywords), v1's tensors and another version's."""
    arch, first = tiny(seed, tie_word_embeddings=tied)
    _, second = tiny(seed + 1, tie_word_embeddings=tied)
    slots = WeightSlots(arch, build_weights(arch, first, device, torch.float32), "v1")
    slots.release(1)
    writer = SlotWriter(slots.views(1), slots.views(0), chunk_bytes=chunk_bytes,
                        **options)  # fmt: skip
    return slots, writer, first, second


def named(slots: WeightSlots, index: int) -> dict[str, torch.Tensor]:
    return {name: view for view, name in weight_copy_plan(slots.arch, slots.weights(index))}


@pytest.mark.parametrize("tied", [False, True])
def test_pieces_of_random_sizes_and_dtypes_land_exactly_where_a_whole_copy_would(tied):
    seed = random.randrange(2**20)
    slots, writer, _, second = writer_for(seed, tied)
    rng = random.Random(seed)
    for name, tensor in second.items():
        src = tensor.to(rng.choice([torch.float32, torch.bfloat16, torch.float16])).view(-1)
        start = 0
        while start < src.numel():
            n = rng.randrange(1, 200)
            writer.write_piece(name, start, src[start : start + n])
            start += n
        assert writer.written(name) == src.numel()
        torch.testing.assert_close(
            named(slots, 1)[name], src.view(tensor.shape).float(), rtol=0, atol=0, msg=name
        )
    assert writer.unfinished() == []
    assert writer.copy_rest() == []  # everything was pushed: nothing kept from the base
    assert writer.first_nonfinite(list(second)) is None


def test_copy_rest_fills_exactly_the_tensors_not_written_from_the_base_slot():
    slots, writer, _, second = writer_for(random.randrange(2**20))
    pushed = random.sample(sorted(second), 3)
    for name in pushed:
        writer.write(name, second[name].to(torch.bfloat16))
    rest = writer.copy_rest(on_progress=lambda done, total: None)
    assert sorted(rest) == sorted(set(second) - set(pushed))
    got, base = named(slots, 1), named(slots, 0)
    for name in second:
        want = second[name].to(torch.bfloat16).float() if name in pushed else base[name]
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)


def test_write_all_lands_views_of_any_dtype_and_strides_as_whole_copies_would(rng):
    slots, writer, _, second = writer_for(random.randrange(2**20))
    names = rng.sample(sorted(second), rng.randrange(1, len(second)))
    srcs = []
    for name in names:
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        tensor = second[name].to(dtype)
        # Some as a transposed view's transpose (strided, not contiguous), as a shared
        # storage's tensors may be.
        srcs.append(tensor.t().contiguous().t() if tensor.dim() == 2 and rng.random() < 0.5
                    else tensor)  # fmt: skip
    writer.write_all(names, srcs)
    got = named(slots, 1)
    for name, src in zip(names, srcs, strict=True):
        assert writer.written(name) == src.numel()
        torch.testing.assert_close(got[name], src.float(), rtol=0, atol=0, msg=name)
    assert sorted(writer.copy_rest()) == sorted(set(second) - set(names))


def test_write_all_refuses_a_wrong_shape_or_name_before_copying_anything():
    _, writer, _, second = writer_for(random.randrange(2**20))
    first, other = random.sample(sorted(n for n, t in second.items() if t.dim() == 2), 2)
    with pytest.raises(SlotWriteError, match=re.escape(f"{other} has shape")):
        writer.write_all([first, other], [second[first], second[other].T.contiguous()[:1]])
    with pytest.raises(SlotWriteError, match=r"model\.nope is not a tensor"):
        writer.write_all([first, "model.nope"], [second[first], second[first]])
    assert writer.written(first) == 0


def test_a_nonfinite_value_is_found_in_the_tensor_it_landed_in():
    slots, writer, _, second = writer_for(random.randrange(2**20), chunk_bytes=64)
    names = sorted(second)
    bad = random.choice(names)
    for name in names:
        t = second[name].clone()
        if name == bad:
            t.view(-1)[random.randrange(t.numel())] = random.choice([float("nan"), float("inf")])
        writer.write(name, t)
    assert writer.first_nonfinite(names) == bad
    # A float32 value too large for float16 is finite where it was sent, not where it serves.
    slots16 = WeightSlots(slots.arch, build_weights(slots.arch, second, "cpu", torch.float16), "a")
    slots16.release(1)
    w16 = SlotWriter(slots16.views(1), slots16.views(0), chunk_bytes=64)
    big = second["model.norm.weight"].clone()
    big[0] = 1e6
    w16.write("model.norm.weight", big)
    assert w16.first_nonfinite(["model.norm.weight"]) == "model.norm.weight"


def test_pieces_that_do_not_fit_are_refused_naming_the_tensor():
    _, writer, _, second = writer_for(random.randrange(2**20))
    norm = second["model.norm.weight"]
    with pytest.raises(SlotWriteError, match=r"model\.bogus\.weight is not a tensor"):
        writer.write("model.bogus.weight", norm)
    with pytest.raises(SlotWriteError, match=r"model.norm.weight has shape \(3,\)"):
        writer.write("model.norm.weight", torch.ones(3))
    with pytest.raises(SlotWriteError, match=r"model.norm.weight: elements \[60, 70\)"):
        writer.write_piece("model.norm.weight", 60, torch.ones(10))
    writer.write_piece("model.norm.weight", 0, torch.ones(10))
    assert writer.unfinished() == ["model.norm.weight"]


def test_a_slot_holding_quantized_layers_is_refused_naming_the_first():
    arch, tensors = tiny(random.randrange(2**20))
    layer = random.randrange(arch.num_layers)
    precision = PrecisionMap.from_mapping({f"model.layers.{layer}.mlp.down_proj*": "int8"})
    fmt = ServingFormat(torch.device("cpu"), torch.float32, precision)
    quantized = build_weights(arch, tensors, "cpu", torch.float32, fmt=fmt)
    dense = build_weights(arch, tensors, "cpu", torch.float32)
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    assert slot_views(arch, quantized).quantized == (name,)
    assert slot_views(arch, dense).quantized == ()
    for slot, base in ((quantized, dense), (dense, quantized)):
        with pytest.raises(SlotWriteError, match=rf"{re.escape(name)} is held quantized"):
            SlotWriter(slot_views(arch, slot), slot_views(arch, base), chunk_bytes=1000)


def test_pieces_are_consecutive_runs_covering_every_item_once_within_the_bound():
    rng = random.Random(random.randrange(2**20))
    bound = rng.randrange(1, 500)
    sizes = [rng.randrange(0, 3 * bound) for _ in range(rng.randrange(0, 60))]
    runs = list(pieces(sizes, bound))
    assert [i for run in runs for i in range(len(sizes))[run]] == list(range(len(sizes)))
    for run in runs:
        assert run.stop > run.start
        assert sum(sizes[run]) <= bound or run.stop - run.start == 1  # or one large item
    # A run ends only where the next item would not fit.
    for before, after in itertools.pairwise(runs):
        assert sum(sizes[before]) + sizes[after.start] > bound


def test_whole_tensors_copied_in_small_pieces_land_exactly_and_copy_rest_keeps_the_rest():
    piece_bytes = random.randrange(64, 4096)  # tensors split by rows across pieces
    slots, writer, _, second = writer_for(random.randrange(2**20), piece_bytes=piece_bytes)
    names = random.sample(sorted(second), len(second) // 2)
    srcs = [second[n].to(random.choice([torch.float32, torch.bfloat16])) for n in names]
    writer.write_all(names, srcs)
    assert sorted(writer.copy_rest()) == sorted(set(second) - set(names))
    got, base = named(slots, 1), named(slots, 0)
    for name in second:
        want = srcs[names.index(name)].float() if name in names else base[name]
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)


@pytest.mark.gpu
def test_paced_device_work_moves_at_most_its_share_of_the_bandwidth_and_lands_exactly():
    """With `device_share` the writer waits out each piece and pauses: the bytes its copies and
    checks moved took at least as long as that share of the card's bandwidth allows, and the
    slot holds what was sent."""
    # A share so small that pacing, not the copies, sets the time (~1 s for a tiny model on a
    # card of a few TB/s): unpaced, these calls take milliseconds.
    share = random.uniform(3e-7, 5e-7)
    slots, writer, _, second = writer_for(random.randrange(2**20), device="cuda",
                                          device_share=share, piece_bytes=4096)  # fmt: skip
    names = random.sample(sorted(second), len(second) // 2)
    srcs = [second[n].cuda() for n in names]
    started = time.perf_counter()
    writer.write_all(names, srcs)
    writer.copy_rest()
    assert writer.first_nonfinite(sorted(second)) is None
    wall = time.perf_counter() - started
    moved, rate = writer.device_traffic
    size = sum(t.numel() * 4 for t in second.values())  # float32
    assert moved == 2 * size + size  # every tensor copied (read + written), then read once
    assert 0.1 < moved / rate <= wall
    got, base = named(slots, 1), named(slots, 0)
    for name in second:
        want = srcs[names.index(name)] if name in names else base[name]
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)


@pytest.mark.gpu
def test_on_the_gpu_host_pieces_and_device_tensors_land_exactly_on_the_side_stream():
    seed = random.randrange(2**20)
    arch, first = tiny(seed)
    _, second = tiny(seed + 1)
    slots = WeightSlots(arch, build_weights(arch, first, "cuda", torch.float32), "v1")
    slots.release(1)
    writer = SlotWriter(slots.views(1), slots.views(0), chunk_bytes=512)
    names = sorted(second)
    from_host, from_device = names[::3], names[1::3]
    for name in from_host:  # pinned uploads of pageable pieces, cast on the device
        flat = second[name].to(torch.bfloat16).view(-1)
        for start in range(0, flat.numel(), 300):
            writer.write_piece(name, start, flat[start : start + 300])
    # Device to device: one by one, and in one call as an IPC push copies (the same dtype as
    # the slot, or cast on the device).
    one_by_one, in_one = from_device[::2], from_device[1::2]
    for name in one_by_one:
        writer.write(name, second[name].cuda().half())
    srcs = [second[n].cuda().half() if i % 2 else second[n].cuda() for i, n in enumerate(in_one)]
    writer.write_all(in_one, srcs)
    sent = dict(zip(in_one, srcs, strict=True))
    rest = writer.copy_rest()
    bad = writer.first_nonfinite(from_host + from_device)
    writer.sync()
    assert bad is None
    assert sorted(rest) == sorted(set(names) - set(from_host) - set(from_device))
    got, base = named(slots, 1), named(slots, 0)
    for name in names:
        if name in from_host:
            want = second[name].to(torch.bfloat16).float().cuda()
        elif name in one_by_one:
            want = second[name].half().float().cuda()
        elif name in sent:
            want = sent[name].float()
        else:
            want = base[name]
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)


@pytest.mark.gpu
def test_the_fused_check_on_a_gpu_finds_the_nonfinite_tensor_and_not_a_finite_overflowing_one():
    """One summed pass, then an exact look at a tensor whose sum is not finite: finite values
    whose magnitudes add past float32's range are no NaN."""
    arch, first = tiny(random.randrange(2**20))
    slots = WeightSlots(arch, build_weights(arch, first, "cuda", torch.bfloat16), "v1")
    slots.release(1)
    writer = SlotWriter(slots.views(1), slots.views(0), chunk_bytes=64)
    names = sorted(first)
    bad, huge = random.sample(names, 2)
    for name in names:
        t = first[name].clone()
        if name == huge:
            t.fill_(3e38)  # finite in bfloat16; the sum of its magnitudes overflows
        writer.write(name, t)
    assert writer.first_nonfinite(names) is None
    t = first[bad].clone()
    t.view(-1)[random.randrange(t.numel())] = random.choice([float("nan"), float("-inf")])
    writer.write(bad, t)
    assert writer.first_nonfinite(names) == bad
