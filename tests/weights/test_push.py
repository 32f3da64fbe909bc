"""Live pushes on a real in-process engine (the tiny Llama): what lands in the slots, what is
refused and why, the versions kept, rollback, the prefix cache across a push."""

from __future__ import annotations

import random
import re
import threading

import pytest
import torch

from sitsd.engine.errors import InvalidRequestError
from sitsd.types import SamplingParams
from sitsd.weights.errors import SwapRefusedError, VersionRejectedError
from sitsd.weights.push import PushHeader
from sitsd.weights.push_plan import PushPlan
from sitsd.weights.push_stream import StreamedPush, TensorPiece
from sitsd.weights.versions import VersionState
from tests.model.quant_checkpoints import write_quantized_llama
from tests.weights.push_harness import (
    PushServed,
    pieces,
    spec_of,
    streamed,
    version_tensors,
    write_two_versions,
)

GATE = "model.layers.1.mlp.gate_proj.weight"
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    return write_two_versions(tmp_path_factory.mktemp("push-versions"))


@pytest.fixture
def served(versions, tmp_path):
    instance = PushServed(versions["v1"], tmp_path, keep_pushed=3)
    yield instance
    instance.close()


def random_prompt() -> list[int]:
    return [random.randrange(3, 300) for _ in range(random.randrange(5, 20))]


def test_a_streamed_push_serves_exactly_the_tensors_it_sent_with_its_timings(served, versions):
    v1 = served.manager.registry.active
    pushed = version_tensors(versions["v2"])
    some = [random_prompt() for _ in range(3)]  # v2 may greedily agree with v1 on one run
    before = served.greedy_runs(some)
    report = served.push(streamed(pushed, chunk_bytes=random.randrange(64, 5000)),
                         PushHeader(version="step-7", origin="run 1"))  # fmt: skip
    assert (report.outcome, report.version, report.transport) == ("committed", "step-7", "grpc")
    assert report.num_bytes == sum(t.numel() * 4 for t in pushed.values())
    assert set(report.stage_s) == {"receive", "validate", "commit"}  # no canary configured
    assert all(s > 0 for s in report.stage_s.values())
    assert report.total_s >= report.stage_s["receive"]
    got = served.slot_tensors("step-7")
    assert set(got) == set(pushed)
    for name, tensor in pushed.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    assert served.generate(some[0])[1] == {"step-7"}
    assert served.greedy_runs(some) != before
    record = served.manager.registry.get("step-7")
    assert (record.source, record.state) == ("push", VersionState.ACTIVE)
    assert record.path == "grpc push from test (run 1)"
    assert served.manager.versions().slots == {"step-7": "active", v1: "standby"}
    assert served.pushes.last == report
    stages = [p.stage for p in served.progress]
    assert stages.index("receive") < stages.index("validate") < stages.index("committed")


def test_a_partial_push_changes_exactly_the_named_tensors(served, versions):
    v1 = served.manager.registry.active
    old = served.slot_tensors(v1)
    new = version_tensors(versions["v2"])
    named = random.sample(sorted(new), 4)
    served.push(streamed({n: new[n].to(torch.bfloat16) for n in named}, partial=True),
                PushHeader(version="partial-1"))  # fmt: skip
    got = served.slot_tensors("partial-1")
    for name in got:
        want = new[name].to(torch.bfloat16).float() if name in named else old[name]
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(got[n], old[n]) for n in named)
    # The standby slot still holds v1 untouched: the rollback target.
    for name, tensor in served.slot_tensors(v1).items():
        torch.testing.assert_close(tensor, old[name], rtol=0, atol=0, msg=name)


def bad_push(kind: str, tensors: dict[str, torch.Tensor]) -> tuple[StreamedPush, str]:
    """A push that must be rejected, and what the reason must say."""
    gate = tensors[GATE]
    if kind == "unknown":
        t = {**tensors, "model.layers.9.mlp.up_proj.weight": gate}
        return streamed(t), "model.layers.9.mlp.up_proj.weight is not a tensor of the serving model"
    if kind == "shape":
        return streamed({**tensors, GATE: gate.T.contiguous()}), f"{GATE} has shape (64, 128)"
    if kind == "dtype":
        return streamed({**tensors, GATE: gate.to(torch.int32)}), f"{GATE} has dtype int32"
    if kind in ("nan", "inf"):
        broken = gate.clone()
        broken.view(-1)[random.randrange(broken.numel())] = float(kind)
        return streamed({**tensors, GATE: broken}), f"{GATE} holds NaN or Inf values"
    if kind == "missing":
        return streamed({n: t for n, t in tensors.items() if n != GATE}), "1 tensors missing"
    plan = PushPlan(tuple(spec_of(n, t) for n, t in tensors.items()))
    if kind == "truncated":  # the stream ends before the last tensor's last bytes
        last = list(tensors)[-1]
        cut = [(n, t if n != last else t.view(-1)[:-1]) for n, t in tensors.items()]
        return StreamedPush(plan, pieces(cut, 999)), f"incomplete push: {last} got"
    assert kind == "order"  # the gate's bytes before the tensor the table puts first

    async def out_of_order():
        yield TensorPiece(GATE, gate.view(-1)[:4].numpy().tobytes())

    return StreamedPush(plan, out_of_order()), f"{GATE} came while {next(iter(tensors))} had 0"


TABLE_ERRORS = ("unknown", "shape", "dtype", "missing")  # found before any slot is touched


@pytest.mark.parametrize("kind", [*TABLE_ERRORS, "nan", "inf", "truncated", "order"])
def test_a_bad_push_is_rejected_naming_the_tensor_and_nothing_is_committed(served, versions, kind):
    v1 = served.manager.registry.active
    tensors = version_tensors(versions["v2"])
    served.push(streamed(tensors), PushHeader(version="good"))  # v1 goes to the standby slot
    old = served.slot_tensors("good")
    want_tokens, _ = served.generate(prompt := random_prompt())
    source, reason = bad_push(kind, tensors)
    with pytest.raises(VersionRejectedError, match=re.escape(reason)):
        served.push(source, PushHeader(version=f"bad-{kind}"))
    record = served.manager.registry.get(f"bad-{kind}")
    assert record.state is VersionState.REJECTED
    assert reason in record.reason
    assert served.pushes.last.outcome == "rejected"
    assert served.manager.registry.active == "good"
    assert served.generate(prompt) == (want_tokens, {"good"})  # serving goes on, unchanged
    for name, tensor in served.slot_tensors("good").items():
        torch.testing.assert_close(tensor, old[name], rtol=0, atol=0, msg=name)
    # A wrong table never touches the standby slot (v1, the rollback target, stays there);
    # values can only be checked once received into it, which costs v1 its place.
    slots = served.manager.versions().slots
    assert slots == (
        {"good": "active", v1: "standby"} if kind in TABLE_ERRORS else {"good": "active"}
    )
    assert served.engine.status().num_blocks_used == 0


def test_a_refused_push_names_its_field_and_a_push_needs_two_slots(served, versions, tmp_path):
    pushed = version_tensors(versions["v2"])
    with pytest.raises(InvalidRequestError, match="version"):
        served.push(streamed(pushed), PushHeader(version="has spaces"))
    assert served.pushes.last.outcome == "refused"
    with pytest.raises(InvalidRequestError, match="policy"):
        served.push(streamed(pushed), PushHeader(version="p", policy="sideways"))
    served.push(streamed(pushed), PushHeader(version="twice"))
    with pytest.raises(Exception, match="exists already"):
        served.push(streamed(pushed), PushHeader(version="twice"))
    one_slot = PushServed(versions["v1"], tmp_path / "one", weight_slots="1")
    try:
        with pytest.raises(SwapRefusedError, match="one slot"):
            one_slot.push(streamed(pushed), PushHeader(version="x"))
    finally:
        one_slot.close()


def test_a_push_into_quantized_weights_is_refused_before_anything_is_touched(tmp_path):
    write_quantized_llama(tmp_path / "awq", "awq", seed=random.randrange(2**20))
    quantized = PushServed(tmp_path / "awq", tmp_path / "state")
    try:
        before = quantized.manager.versions()
        with pytest.raises(SwapRefusedError, match=r"quantized \(e\.g\. model\.layers\.0\."):
            quantized.push(streamed({NORM: torch.ones(64)}, partial=True), PushHeader(version="q"))
        assert quantized.manager.versions() == before  # nothing registered, no slot released
        prompt = random_prompt()
        assert len(quantized.generate(prompt)[0]) == 8  # serving goes on
    finally:
        quantized.close()


def test_rollback_after_pushes_flips_back_and_a_pushed_version_out_of_its_slot_is_refused(
    served, versions
):
    v1 = served.manager.registry.active
    tensors = version_tensors(versions["v2"])
    some = [random_prompt() for _ in range(3)]  # a may greedily agree with v1 on one run
    tokens_v1 = served.greedy_runs(some)
    served.push(streamed(tensors), PushHeader(version="a"))
    tokens_a = served.greedy_runs(some)
    served.push(streamed({NORM: tensors[NORM] * 2}, partial=True), PushHeader(version="b"))
    done = served.run(served.manager.rollback())  # b -> a: a flip, a is still in its slot
    assert (done.stage, served.manager.registry.active) == ("committed", "a")
    assert served.generate(some[0])[1] == {"a"}
    assert served.greedy_runs(some) == tokens_a
    served.push(streamed({NORM: tensors[NORM] * 3}, partial=True), PushHeader(version="c"))
    # b's slot was reused by c: b has no files to come back from.
    with pytest.raises(SwapRefusedError, match="b was pushed and is in no weight slot"):
        served.run(served.manager.swap("b"))
    served.run(served.manager.rollback())  # c -> a
    served.run(served.manager.swap(v1))  # a file version comes back from its directory
    assert served.generate(some[0])[1] == {v1}
    assert served.greedy_runs(some) == tokens_v1
    assert tokens_a != tokens_v1


def test_only_the_newest_pushed_versions_are_kept_never_the_active_or_rollback_target(
    served, versions
):
    v1 = served.manager.registry.active
    norm = version_tensors(versions["v2"])[NORM]
    for n in range(6):
        served.push(
            streamed({NORM: norm * (1 + n / 10)}, partial=True), PushHeader(version=f"p{n}")
        )
    listed = [v.version for v in served.manager.versions().versions]
    assert listed == [v1, "p3", "p4", "p5"]  # keep_pushed=3: the newest three pushed ones
    served.run(served.manager.rollback())  # p5 -> p4: a flip
    assert served.manager.registry.active == "p4"
    with pytest.raises(VersionRejectedError):
        served.push(streamed({NORM: norm * float("nan")}, partial=True), PushHeader(version="nan"))
    listed = [v.version for v in served.manager.versions().versions]
    assert listed == [v1, "p4", "p5", "nan"]  # p5, the rollback target, is kept
    # ...but the rejected push was received into its slot: p5 has no files to come back from.
    with pytest.raises(SwapRefusedError, match="p5 was pushed and is in no weight slot"):
        served.run(served.manager.rollback())


def test_the_prefix_cache_never_serves_kv_of_the_version_before_a_push(served, versions):
    # Two full blocks of 16 and more, each; three: v2 may greedily agree with v1 on one run.
    prompts = [[random.randrange(3, 300) for _ in range(40)] for _ in range(3)]

    def cached_runs() -> tuple[list[list[int]], list[int]]:
        """Each prompt's 16 greedy tokens, and how many of its tokens the cache served."""

        async def go(tokens: list[int]) -> tuple[list[int], int]:
            out, cached = [], 0
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            async for delta in served.engine.add_request(tokens, params):
                out += delta.new_token_ids
                if delta.usage is not None:
                    cached = delta.usage.cached_tokens
            return out, cached

        runs = [served.run(go(p)) for p in prompts]
        return [out for out, _ in runs], [cached for _, cached in runs]

    first, _ = cached_runs()
    again, cached = cached_runs()
    assert again == first
    assert min(cached) > 0  # v1's blocks are reused under v1
    served.push(streamed(version_tensors(versions["v2"])), PushHeader(version="fresh"))
    after_push, cached_after = cached_runs()
    assert cached_after == [0, 0, 0]  # nothing computed by v1 is reused
    repeat, cached_repeat = cached_runs()
    assert repeat == after_push
    assert min(cached_repeat) > 0  # its own blocks are, under its version
    assert after_push != first


def test_a_streamed_push_reads_a_piece_only_once_the_one_two_before_is_copied(served, versions):
    """Bounded memory: the daemon holds the piece it is copying and the next one, no more. And
    the slot writer is made, and the slots' layouts checked, off the event loop (walking both
    slots' tensors there would hold every stream's next token)."""
    tensors = version_tensors(versions["v2"])
    port = served.manager.stager.port
    writers = []
    open_writer = port.slot_writer

    def recording_writer(index, *, chunk_bytes, device_share=1.0):
        writer = open_writer(index, chunk_bytes=chunk_bytes, device_share=device_share)
        writers.append((writer, threading.current_thread()))
        return writer

    port.slot_writer = recording_writer
    checked_on = []  # the threads the quantized-layout check ran on
    check_layouts = port.quantized_tensors

    def recording_check():
        checked_on.append(threading.current_thread())
        return check_layouts()

    port.quantized_tensors = recording_check
    plan_source = streamed(tensors)
    read = [0]
    last = [0]  # bytes of the piece read last
    loop_threads = set()

    async def watched():
        async for piece in pieces(tensors.items(), random.randrange(64, 2048)):
            loop_threads.add(threading.current_thread())
            # By the time the next piece is asked for, every byte read before the last piece
            # is in the slot (that one may still be copying).
            copied = sum(writers[0][0].written(n) * 4 for n in tensors) if writers else 0
            assert read[0] - last[0] <= copied <= read[0]
            read[0] += len(piece.data)
            last[0] = len(piece.data)
            yield piece

    source = StreamedPush(plan_source.plan, watched())
    served.push(source, PushHeader(version="bounded"))
    assert read[0] == sum(t.numel() * 4 for t in tensors.values())
    [(_, made_on)] = writers
    assert len(loop_threads) == 1
    assert made_on not in loop_threads
    assert checked_on
    assert not set(checked_on) & loop_threads
