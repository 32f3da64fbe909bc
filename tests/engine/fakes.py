"""Test doubles for the engine: a fake model runner that checks what the scheduler sends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from sitsd.model.arch import LlamaArch
from sitsd.outputs import ModelRunnerOutput, SchedulerOutput
from sitsd.quant.source import QuantSource

FAKE_ARCH = LlamaArch(
    vocab_size=1000, hidden_size=8, intermediate_size=16,
    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True,
)  # fmt: skip


class FakeSlots:
    """Weight slots without tensors: which version each slot holds, and which is active.
    `copy_into` records each copy: (thread name, slot, versions then, tensor names, chunk)."""

    arch = FAKE_ARCH
    dtype = torch.float32
    device = torch.device("cpu")
    slot_nbytes = 0
    copy_seconds = 0.0

    def __init__(self, version: str = "fake@0", num_slots: int = 2) -> None:
        self.versions: list[str | None] = [version] + [None] * (num_slots - 1)
        self.active = 0
        self.copies: list[tuple[str, int, list[str | None], list[str], int]] = []

    @property
    def num_slots(self) -> int:
        return len(self.versions)

    @property
    def standby(self) -> int | None:
        return 1 - self.active if len(self.versions) == 2 else None

    @property
    def active_version(self) -> str:
        version = self.versions[self.active]
        assert version is not None
        return version

    @property
    def standby_version(self) -> str | None:
        return None if self.standby is None else self.versions[self.standby]

    def index_of(self, version: str) -> int | None:
        return self.versions.index(version) if version in self.versions else None

    def activate(self, version: str) -> None:
        index = self.index_of(version)
        assert index is not None, f"{version} is in no slot"
        self.active = index

    def release(self, index: int) -> None:
        assert index != self.active or len(self.versions) == 1
        self.versions[index] = None

    def fill(self, index: int, version: str) -> None:
        self.versions[index] = version

    def copy_into(
        self,
        index: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        chunk_bytes: int,
        on_progress: Callable[[int, int], None] | None = None,
        source: QuantSource | None = None,
    ) -> int:
        assert self.versions[index] is None, "copy only into a released slot"
        name = threading.current_thread().name
        self.copies.append((name, index, list(self.versions), sorted(tensors), chunk_bytes))
        return 0

    def pinned_uploads(self) -> None:
        return None  # no GPU: nothing uploads

    def precision(self, index: int) -> str:
        return "fp32"

    def nbytes(self, index: int) -> int:
        return 0

    def restructured(self, index: int) -> bool:
        return False  # a fake copy moves no tensor: no graph to capture again

    def take_restructured(self, index: int) -> bool:
        return False

    def load(self, version: str) -> None:
        """Test helper: put `version` in the standby slot, as staging would."""
        standby = self.standby
        assert standby is not None
        self.release(standby)
        self.fill(standby, version)


def next_token(last: int, version: str, vocab_size: int) -> int:
    """What the fake model samples after `last` under version `fake@N`: `last + 1 + N`."""
    return (last + 1 + int(version.rsplit("@", 1)[1])) % vocab_size


class FakeRunner:
    """Tracks request state like the real runner and emits `next_token(last, version)`.

    It asserts the scheduler's protocol as it goes: known requests only, at least one token
    per scheduled request, block tables long enough for every scheduled token, computed counts
    in step with the scheduler's, every request on a loaded version, no KV slot written by two
    requests in one step, and no forward pass mixing versions: every KV slot a request reads
    holds its own token, written under its own weights version.
    """

    def __init__(
        self, block_size: int, vocab_size: int = 1000, overlaps: bool = False, num_slots: int = 2
    ) -> None:
        self.overlaps_host_work = overlaps  # like the CUDA runner: the engine defers detok
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.slots = FakeSlots(num_slots=num_slots)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.versions: dict[str, str] = {}
        self.samples: dict[str, bool] = {}
        # KV slot (block * size + offset) -> (version, token) of what was written there.
        self.kv_writer: dict[int, tuple[str, int]] = {}
        self.num_steps = 0
        self.max_versions_in_step = 0
        self.fail_next = False
        self.probes: set[str] = set()  # canary probes the runner holds
        self.probe_logprobs: dict[str, list[torch.Tensor]] = {}  # per probe, one per chunk
        self.step_log: list[dict[str, int]] = []  # num_scheduled_tokens of every step run
        # Tokens sampled by a launched step whose result() has not been taken: the host has
        # not seen them (by the request that samples them; its shadow shares the list).
        self.unseen: dict[str, set[int]] = {}
        self.owner: dict[str, str] = {}  # shadow -> the request whose token list it shares

    @property
    def weights_version(self) -> str:
        return self.slots.active_version

    def launch(self, so: SchedulerOutput) -> _Done:
        """Computes at once, but the tokens it samples count as unseen by the host until
        `result()`: only the request that samples one may read it next (the real runner copies
        it into that request's inputs on the device), never a shadow."""
        out = self.execute(so)
        sampled = {r: len(self.tokens[r]) - 1 for r, t in zip(out.req_ids, out.sampled_token_ids)
                   if t and r in self.tokens}  # fmt: skip
        for req_id, index in sampled.items():
            self.unseen.setdefault(req_id, set()).add(index)
        return _Done(out, lambda: self._seen(sampled))

    def _seen(self, sampled: dict[str, int]) -> None:
        for req_id, index in sampled.items():
            self.unseen.get(req_id, set()).discard(index)

    def take_prompt_logprobs(self, req_id: str) -> torch.Tensor:
        """A computed probe's log-probabilities ([len(prompt), vocab]); `next_token` of each
        position nearly certain, under the probe's version."""
        chunks = self.probe_logprobs.pop(req_id)
        return torch.cat(chunks)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update(so)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected model failure")
        self.num_steps += 1
        self.step_log.append(dict(so.num_scheduled_tokens))
        versions = {self.versions[r] for r in so.num_scheduled_tokens}
        assert versions <= set(self.slots.versions), f"{versions} not all in {self.slots.versions}"
        self.max_versions_in_step = max(self.max_versions_in_step, len(versions))
        req_ids, sampled = [], []
        written: set[int] = set()
        for req_id, n in so.num_scheduled_tokens.items():
            assert n > 0, f"{req_id!r} scheduled with no token"
            req_ids.append(req_id)
            sampled.append(self._compute(req_id, n, written))
        return ModelRunnerOutput(req_ids, sampled)

    def _update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            for d in (self.tokens, self.blocks, self.computed, self.versions, self.samples,
                      self.probe_logprobs, self.owner):  # fmt: skip
                d.pop(req_id, None)
            self.probes.discard(req_id)
        for new in sorted(so.new_reqs, key=lambda n: n.shadow_of is not None):
            assert new.req_id not in self.tokens, "new request already known to the runner"
            if new.shadow_of is None:
                self.tokens[new.req_id] = list(new.token_ids)
            else:  # shares its request's token list, like the real runner
                self.tokens[new.req_id] = self.tokens[new.shadow_of]
                self.owner[new.req_id] = new.shadow_of
                assert self.tokens[new.req_id][: len(new.token_ids)] == new.token_ids
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.versions[new.req_id] = new.weights_version
            self.samples[new.req_id] = new.shadow_of is None and not new.probe
            if new.probe:
                assert new.num_computed_tokens == 0, "a probe reads no cached block"
                self.probes.add(new.req_id)
            self._check_reads(new.req_id, new.num_computed_tokens)  # prefix-cache hits
        for migrated in so.migrated:
            assert migrated.req_id in self.tokens, "migrated request unknown to the runner"
            self.blocks[migrated.req_id] = list(migrated.block_ids)
            self.computed[migrated.req_id] = migrated.num_computed_tokens
            self.versions[migrated.req_id] = migrated.weights_version
            self._check_reads(migrated.req_id, migrated.num_computed_tokens)
        for cached in so.cached_reqs:
            assert cached.req_id in self.tokens, "cached request unknown to the runner"
            assert cached.num_computed_tokens == self.computed[cached.req_id]
            self.blocks[cached.req_id] += cached.new_block_ids

    def _compute(self, req_id: str, n: int, written: set[int]) -> list[int]:
        start = self.computed[req_id]
        end = start + n
        tokens, version = self.tokens[req_id], self.versions[req_id]
        assert end <= len(tokens)
        assert len(self.blocks[req_id]) * self.block_size >= end, "block table too short"
        self._check_reads(req_id, start)
        unseen = self.unseen.get(self.owner.get(req_id, req_id), set())
        for pos in unseen & set(range(start, end)):  # the host has not seen that token yet
            assert self.samples[req_id], f"{req_id!r} reads position {pos}, unseen by the host"
            assert pos == end - 1, f"{req_id!r} reads unseen {pos} before its last position"
        for pos in range(start, end):
            slot = self._slot(req_id, pos)
            assert slot not in written, f"{req_id!r} writes KV slot {slot} another request writes"
            written.add(slot)
            self.kv_writer[slot] = (version, tokens[pos])
        self.computed[req_id] = end
        if req_id in self.probes:
            logits = torch.zeros(n, self.vocab_size)
            for i, token in enumerate(tokens[start:end]):
                logits[i, next_token(token, version, self.vocab_size)] = 20.0
            self.probe_logprobs.setdefault(req_id, []).append(torch.log_softmax(logits, -1))
        if end == len(tokens) and self.samples[req_id]:
            token = next_token(tokens[-1], version, self.vocab_size)
            tokens.append(token)
            return [token]
        return []

    def _check_reads(self, req_id: str, num_tokens: int) -> None:
        """The KV of positions [0, num_tokens) must be its own tokens', under its own version."""
        version, tokens = self.versions[req_id], self.tokens[req_id]
        for pos in range(num_tokens):
            found = self.kv_writer.get(self._slot(req_id, pos))
            assert found == (version, tokens[pos]), (
                f"{req_id!r} on {version} reads position {pos} holding {found}"
            )

    def _slot(self, req_id: str, pos: int) -> int:
        return self.blocks[req_id][pos // self.block_size] * self.block_size + pos % self.block_size


class _Done:
    def __init__(self, out: ModelRunnerOutput, on_result=None) -> None:
        self._out = out
        self._on_result = on_result

    def result(self) -> ModelRunnerOutput:
        if self._on_result is not None:
            self._on_result()
        return self._out
