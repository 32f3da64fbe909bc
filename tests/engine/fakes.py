"""Test doubles for the engine: a fake model runner that checks what the scheduler sends."""

from __future__ import annotations

from sitsd.engine.outputs import ModelRunnerOutput, SchedulerOutput


class FakeRunner:
    """Tracks request state like the real runner and emits `(last token + 1) % vocab`.

    It asserts the scheduler's protocol as it goes: known requests only, block tables long
    enough for every scheduled token, no block shared by two requests unless both reached it
    through the prefix cache.
    """

    weights_version = "fake@0"

    def __init__(self, block_size: int, vocab_size: int = 1000, overlaps: bool = False) -> None:
        self.overlaps_host_work = overlaps  # like the CUDA runner: the engine defers detok
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.num_steps = 0
        self.fail_next = False

    def launch(self, so: SchedulerOutput) -> _Done:
        return _Done(self.execute(so))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            for d in (self.tokens, self.blocks, self.computed):
                d.pop(req_id, None)
        for new in so.new_reqs:
            assert new.req_id not in self.tokens, "new request already known to the runner"
            self.tokens[new.req_id] = list(new.token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for cached in so.cached_reqs:
            assert cached.req_id in self.tokens, "cached request unknown to the runner"
            assert cached.num_computed_tokens == self.computed[cached.req_id]
            self.blocks[cached.req_id] += cached.new_block_ids
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected model failure")
        self.num_steps += 1
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            end = self.computed[req_id] + n
            assert end <= len(self.tokens[req_id])
            assert len(self.blocks[req_id]) * self.block_size >= end, "block table too short"
            self.computed[req_id] = end
            req_ids.append(req_id)
            if end == len(self.tokens[req_id]):
                token = (self.tokens[req_id][-1] + 1) % self.vocab_size
                self.tokens[req_id].append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled)


class _Done:
    def __init__(self, out: ModelRunnerOutput) -> None:
        self._out = out

    def result(self) -> ModelRunnerOutput:
        return self._out
