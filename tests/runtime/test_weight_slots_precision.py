"""Weight slots across precisions: a 16-bit version and its INT4 version (AWQ, GPTQ,
compressed-tensors) have different slot structures; staging one into a slot that held the other
rebuilds the fields that changed (marked for new CUDA graphs), copies in place the ones that did
not, and leaves exactly what start-up would have built from that version."""

from __future__ import annotations

import pytest
import torch

from sitsd.model.llama import ServingFormat, build_weights
from sitsd.runtime.weight_slots import WeightSlots, slot_views
from sitsd.weights import load_checkpoint
from tests.model.quant_checkpoints import write_quantized_llama
from tests.weights.tiny_models import write_tiny_llama

CPU = ServingFormat(torch.device("cpu"), torch.float32)


def built(ckpt):
    return build_weights(ckpt.arch, ckpt.tensors, "cpu", torch.float32, source=ckpt.quant, fmt=CPU)


def assert_slot_is(slots: WeightSlots, index: int, ckpt) -> None:
    want = built(ckpt)
    got = slots.weights(index)
    names = [n for n, _ in got.named_tensors()]
    assert names == [n for n, _ in want.named_tensors()]
    for (name, a), (_, b) in zip(got.named_tensors(), want.named_tensors(), strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert slots.precision(index) == want.precision
    assert slots.nbytes(index) == want.nbytes


def stage(slots: WeightSlots, ckpt, version: str) -> tuple[int, bool]:
    """Copy `ckpt` into the standby slot; (its index, whether it was restructured)."""
    index = slots.standby
    assert index is not None
    slots.release(index)
    slots.copy_into(index, ckpt.tensors, chunk_bytes=777, source=ckpt.quant)
    restructured = slots.take_restructured(index)
    slots.fill(index, version)
    return index, restructured


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct-sym"])
def test_a_16_bit_version_and_its_int4_version_swap_slots_both_ways(tmp_path, fmt):
    write_tiny_llama(tmp_path / "dense", seed=3)
    dense = load_checkpoint(tmp_path / "dense")
    write_quantized_llama(tmp_path / "int4", fmt, seed=3)
    int4 = load_checkpoint(tmp_path / "int4")
    slots = WeightSlots(dense.arch, built(dense), "dense", fmt=CPU)
    index, restructured = stage(slots, int4, "int4")
    assert restructured  # its linears are quantized layouts now: graphs must be captured again
    assert_slot_is(slots, index, int4)
    assert "int4-g32" in slots.precision(index)
    assert slots.nbytes(index) < slots.nbytes(slots.active) / 2
    slots.activate("int4")
    # And back: the former active slot, built dense at start-up, takes the dense version again.
    write_tiny_llama(tmp_path / "dense2", seed=4)
    dense2 = load_checkpoint(tmp_path / "dense2")
    back, restructured = stage(slots, dense2, "dense2")
    assert back != index
    assert not restructured  # the same structure as the start-up version: copied in place
    assert_slot_is(slots, back, dense2)
    slots.activate("dense2")
    # The slot that held INT4 takes a dense version: rebuilt, and equal to start-up's build.
    again, restructured = stage(slots, dense, "dense")
    assert again == index
    assert restructured
    assert_slot_is(slots, again, dense)
    assert slots.precision(again) == slots.precision(back)


def test_two_int4_versions_copy_in_place_and_keep_their_tensor_addresses(tmp_path):
    write_quantized_llama(tmp_path / "a", "awq", seed=5)
    write_quantized_llama(tmp_path / "b", "awq", seed=6)
    a, b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    write_tiny_llama(tmp_path / "dense", seed=5)
    slots = WeightSlots(a.arch, built(load_checkpoint(tmp_path / "dense")), "dense", fmt=CPU)
    index, _ = stage(slots, a, "a")
    slots.activate("a")
    stage(slots, b, "b")  # the dense slot becomes INT4 too
    slots.activate("b")
    addresses = [t.data_ptr() for _, t in slots.weights(index).named_tensors()]
    again, restructured = stage(slots, b, "b2")
    assert again == index
    assert not restructured
    assert [t.data_ptr() for _, t in slots.weights(index).named_tensors()] == addresses
    assert_slot_is(slots, index, b)


def test_a_slots_views_are_kept_while_its_tensors_stay_and_made_again_once_they_moved(tmp_path):
    write_tiny_llama(tmp_path / "dense", seed=7)
    dense = load_checkpoint(tmp_path / "dense")
    write_quantized_llama(tmp_path / "int4", "awq", seed=7)
    int4 = load_checkpoint(tmp_path / "int4")
    slots = WeightSlots(dense.arch, built(dense), "dense", fmt=CPU)
    index = slots.standby
    assert index is not None
    kept = slots.views(index)
    assert slots.views(index) is kept, "made once, not at every push"
    assert kept.quantized == ()
    _, restructured = stage(slots, int4, "int4")
    assert restructured
    moved = slots.views(index)
    assert moved is not kept, "its linears are new tensors: the old views would write nowhere"
    fresh = slot_views(slots.arch, slots.weights(index))
    assert moved.quantized == fresh.quantized
    assert {n: (v.data_ptr(), v.shape) for n, v in moved.dense.items()} == {
        n: (v.data_ptr(), v.shape) for n, v in fresh.dense.items()
    }
    assert moved.quantized
    assert all(".mlp." in n or ".self_attn." in n for n in moved.quantized)
    # The other slot's tensors never moved: its views are the ones made first.
    assert slots.views(slots.active) is slots.views(slots.active)
