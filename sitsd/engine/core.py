"""The engine core: one loop on its own thread that owns the scheduler and the model runner.

Each turn of the loop drains the inbox (new requests, aborts; a request admission control
refuses is finished at once), aborts requests whose deadline has passed and drops those that
waited past their tier's queue limit, then runs one step:

    scheduler.schedule() -> SchedulerOutput
    runner.launch()      -> (GPU busy)  ... .result() -> ModelRunnerOutput
    scheduler.update_from_output() -> token updates -> detokenizer -> RequestDeltas

and hands the deltas to `on_deltas` (the asyncio side posts them to its loop). When the runner
works asynchronously (CUDA), the detokenization and delivery of step N's tokens happen after
step N+1 is launched, while the GPU computes: they leave the step's critical path. (A stop
string is then found one step late; the extra token is discarded.) On the CPU the runner
computes inside `launch`, so nothing would overlap and deltas go out at once. With
asynchronous scheduling (the default on CUDA; `--no-async-scheduling` turns it off) the loop
goes further: it schedules and launches step N+1 before it takes step N's tokens
(`step_ahead.py`), so the GPU never waits for the host's update and scheduling; a request that
stops at EOS learns it one step late and the extra token is dropped. Swaps and `EngineCall`s
first finish the step ahead (`finish_ahead`) and run one step at a time. An
`EngineObserver` (`observer.py`; telemetry implements it) is told of every request added,
preempted, migrated and finished, of every step and of the status after each turn. Weight
swaps commit between two steps (`SwapCommand`, handled by `commit.CommitControl`); short work
that must not race the loop (reserving a weight slot, a canary prompt) comes as `EngineCall`s.
Nothing else touches the scheduler or the runner, so no lock guards them; other threads read
`status()`, a snapshot replaced after every turn, and `admission_refusal()`, which checks a new
request against the queue snapshot of the last turn.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Protocol

from sitsd.engine.admission import QueueSnapshot, refusal_reason
from sitsd.engine.commit import CommitControl, WeightSlotsLike
from sitsd.engine.detokenizer import IncrementalDetokenizer
from sitsd.engine.messages import AbortRequest, AddRequest, EngineCall, SwapCommand
from sitsd.engine.observer import EngineObserver, GuardedObserver, NullObserver, StepRecord
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler, TokenUpdate
from sitsd.engine.step_ahead import LaunchedStep, StepAhead
from sitsd.engine.tiers import queue_key
from sitsd.outputs import EngineStatus, ModelRunnerOutput, SchedulerOutput
from sitsd.types import AbortCause, FinishReason, RequestDelta, Tier, Usage

log = logging.getLogger(__name__)

DeltaSink = Callable[[list[RequestDelta]], None]
Message = AddRequest | AbortRequest | SwapCommand | EngineCall


class PendingStepLike(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class ModelRunnerLike(Protocol):
    """What the core needs of a model runner (see `sitsd.runtime.model_runner.ModelRunner`)."""

    @property
    def slots(self) -> WeightSlotsLike:
        """The weight slots: which version each holds, which one is active."""
        ...

    @property
    def overlaps_host_work(self) -> bool:
        """True when `launch` returns before the device has finished the step."""
        ...

    def launch(self, sched_out: SchedulerOutput) -> PendingStepLike: ...


class EngineCore(StepAhead):
    """Runs the step loop; see the module docstring."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunnerLike,
        tokenizer: object,
        model_name: str,
        default_tier: Tier = Tier.SILVER,
        observer: EngineObserver | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_tier = default_tier
        self._eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self._inbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._deferred: list[TokenUpdate] = []  # last step's updates, not yet detokenized
        # Asynchronous scheduling: the launched step whose output is not in yet.
        self._ahead: LaunchedStep | None = None
        self._seeds = random.Random()  # seeds for requests that bring none; per engine
        self._on_deltas: DeltaSink = lambda deltas: None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Told of requests and steps; a failing hook is logged, never costs a request.
        self.observer = GuardedObserver(observer or NullObserver())
        # Replies and swap events go out after the status snapshot shows their effect.
        self.commits = CommitControl(scheduler, runner.slots, self.observer, self._refresh)
        self.num_steps = 0
        # Refusals by `admission_refusal` (the API's thread; read here for the status).
        self._early_refusals: dict[str, int] = {}
        self._queue: QueueSnapshot = scheduler.queue_snapshot()
        self._status = self._snapshot()

    # ----------------------------------------------------------------------------- lifecycle

    def start(self, on_deltas: DeltaSink) -> None:
        """Run the loop on a new thread."""
        thread = threading.Thread(
            target=self.run, args=(on_deltas,), name="sitsd-engine", daemon=True
        )
        thread.start()

    def run(self, on_deltas: DeltaSink) -> None:
        """Run the loop on the calling thread until `stop()`.

        On the CPU, run it on the thread that built the model: OpenMP keeps a thread team per
        calling thread, and torch work split across two threads made each step ~1.5x slower.
        """
        self._on_deltas = on_deltas
        self._thread = threading.current_thread()
        self.observer.on_engine_started(self.model_name, self.runner.slots.active_version)
        self._run()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after its current step and wait for the thread."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, message: Message) -> None:
        """Post a message from any thread; handled before the next step."""
        self._inbox.put(message)

    @property
    def max_num_live_requests(self) -> int:
        cfg = self.scheduler.config
        return cfg.max_num_seqs + cfg.max_num_waiting

    def status(self) -> EngineStatus:
        return self._status

    def admission_refusal(self, tier: Tier | None, arrival_time: float) -> str | None:
        """Why a new request must be refused at once (RESOURCE_EXHAUSTED), or None.

        Called on the API's thread against the queue as of the last engine turn; the engine
        thread checks again with its live queue (`Scheduler.admission_refusal`).
        """
        snapshot = self._queue
        if not snapshot.enabled:
            return None
        tier = tier or self.default_tier
        tier_config = self.scheduler.tiers_config.tier(tier.value)
        key = queue_key(arrival_time, tier_config)
        reason = refusal_reason(snapshot, tier, key, tier_config.max_queue_wait_s)
        if reason is not None:
            self._early_refusals[tier.value] = self._early_refusals.get(tier.value, 0) + 1
        return reason

    # ---------------------------------------------------------------------------------- loop

    def _run(self) -> None:
        while not self._stopping.is_set():
            deltas: list[RequestDelta] = []
            try:
                busy = self.scheduler.has_work() or self._ahead is not None
                deltas += self._drain_inbox(block=not busy)
                deltas += self._abort_expired()
                if self.scheduler.has_work() or self._ahead is not None:
                    deltas += self.step()  # flushes the last step's updates after its launch
                else:
                    deltas += self._flush_deferred()
                    self.commits.when_idle()
            except Exception as exc:  # a bug must cost requests, never the engine thread
                log.exception("engine loop failed; failing every live request")
                deltas += self._fail_all(f"internal engine error: {type(exc).__name__}: {exc}")
            # Snapshot before delivering, so a client that sees its last delta also sees the
            # blocks it held returned.
            self._status = self._snapshot()
            self.observer.on_status(self._status)
            self._queue = self.scheduler.queue_snapshot()
            self._on_deltas_safe(deltas)
        # Leaving: whatever is still live is aborted so no client waits forever.
        deltas = self._flush_deferred() + self._drain_inbox(block=False)
        deltas += self._fail_all("the engine stopped", FinishReason.ABORT)
        self._status = self._snapshot()
        self._on_deltas_safe(deltas)

    def _fail_all(
        self, message: str, reason: FinishReason = FinishReason.ERROR
    ) -> list[RequestDelta]:
        deltas = [self._finish(req_id, reason, message) for req_id in list(self.scheduler.requests)]
        return [d for d in deltas if d is not None]

    def _drain_inbox(self, block: bool) -> list[RequestDelta]:
        deltas = []
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(message, AddRequest):
                    refused = self._add(message)
                    if refused is not None:
                        deltas.append(refused)
                elif isinstance(message, AbortRequest):
                    delta = self._finish(message.req_id, FinishReason.ABORT, message.reason)
                    if delta is not None:
                        deltas.append(delta)
                elif isinstance(message, SwapCommand):
                    deltas += self.finish_ahead()  # a commit goes between two finished steps
                    self.commits.handle(message)
                elif isinstance(message, EngineCall):
                    deltas += self.finish_ahead()  # the call may run the model
                    self._call(message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return deltas

    def _call(self, message: EngineCall) -> None:
        try:
            result = message.fn(self)
        except Exception as exc:  # the caller's failure, reported to it; the loop goes on
            message.reply(None, exc)
        else:
            self._refresh()  # the caller may read `status()` next: it shows what fn did
            message.reply(result, None)

    def _refresh(self) -> None:
        self._status = self._snapshot()

    def _add(self, msg: AddRequest) -> RequestDelta | None:
        """Queue a new request; the finishing delta instead if admission control refuses it."""
        seed = msg.params.seed if msg.params.seed is not None else self._seeds.getrandbits(63)
        request = Request(
            req_id=msg.req_id,
            prompt_token_ids=msg.prompt_token_ids,
            params=msg.params,
            seed=seed,
            tier=msg.tier or self.default_tier,
            arrival_time=msg.arrival_time,
            deadline=msg.deadline,
            trace_context=msg.trace_context,
            eos_token_ids=self._eos_token_ids,
            weights_version=self.runner.slots.active_version,
        )
        refusal = self.scheduler.admission_refusal(request)
        if refusal is not None:  # never queued: nothing to free
            return RequestDelta(
                req_id=msg.req_id,
                finish_reason=FinishReason.ABORT,
                usage=self._usage(request),
                weights_version=request.weights_version,
                error=refusal,
                abort_cause=AbortCause.OVERLOADED,
            )
        self.scheduler.add_request(request)
        self.observer.on_request_added(request)
        self._detok[msg.req_id] = IncrementalDetokenizer(
            self.tokenizer,
            msg.prompt_token_ids,
            msg.params.stop,  # type: ignore[arg-type]
        )
        return None

    def _abort_expired(self) -> list[RequestDelta]:
        now = time.monotonic()
        deltas = [
            self._finish(r, FinishReason.ABORT, "deadline exceeded", AbortCause.DEADLINE)
            for r in self.scheduler.expired_req_ids(now)
        ]
        deltas += [
            self._finish(r, FinishReason.ABORT, why, AbortCause.OVERLOADED)
            for r, why in self.scheduler.overdue_requests(now)
        ]
        return [d for d in deltas if d is not None]

    # ---------------------------------------------------------------------------------- step

    def step(self) -> list[RequestDelta]:
        """Schedule, launch, collect; returns the deltas ready now (see the module docstring)."""
        if self.scheduler.config.async_scheduling:
            if not self.commits.busy and self.scheduler.migration is None:
                return self._step_ahead()
            deltas = self.finish_ahead()  # swaps run one step at a time
            return deltas + (self._step_in_turn() if self.scheduler.has_work() else [])
        return self._step_in_turn()

    def _step_in_turn(self) -> list[RequestDelta]:
        """One step: schedule, launch, wait for its tokens, update."""
        start = time.monotonic()
        self.commits.on_step_start(start)
        sched_out = self.scheduler.schedule()
        self.commits.after_schedule(sched_out, start)
        for req_id in sched_out.preempted_req_ids:
            self.observer.on_request_preempted(self.scheduler.requests[req_id], start)
        if sched_out.is_empty:
            self.commits.after_step(time.monotonic())
            return self._flush_deferred()
        try:
            pending = self.runner.launch(sched_out)
            deltas = self._flush_deferred()  # overlaps the GPU's work on this step
            runner_out = pending.result()
        except Exception as exc:  # the batch fails, the engine keeps serving
            return self._fail_step(exc, list(sched_out.num_scheduled_tokens))
        return deltas + self._updates(sched_out, runner_out, start, defer=True)

    def _fail_step(self, exc: Exception, req_ids: list[str]) -> list[RequestDelta]:
        log.exception("model step failed; failing its %d requests", len(req_ids), exc_info=exc)
        message = f"internal error in the model step: {type(exc).__name__}: {exc}"
        deltas = self._flush_deferred()
        failed = [self._finish(r, FinishReason.ERROR, message) for r in req_ids]
        return deltas + [d for d in failed if d is not None]

    def _updates(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput, start: float, defer: bool
    ) -> list[RequestDelta]:
        """Apply a finished step's tokens; their deltas now, or deferred to the next launch."""
        self.num_steps += 1
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        end = time.monotonic()
        self.observer.on_step(StepRecord(sched_out, updates, start, end))
        self.commits.after_step(end)
        if defer and self.runner.overlaps_host_work and self.scheduler.has_work():
            self._deferred = updates
            return []
        return [self._to_delta(u) for u in updates]

    def _flush_deferred(self) -> list[RequestDelta]:
        updates, self._deferred = self._deferred, []
        # A request may have finished since (abort): its detokenizer is gone, skip it.
        return [self._to_delta(u) for u in updates if u.request.req_id in self._detok]

    def _to_delta(self, update: TokenUpdate) -> RequestDelta:
        request = update.request
        detok = self._detok[request.req_id]
        text = detok.step(update.new_token_ids)
        reason = update.finish_reason
        if reason is None and detok.stopped:
            reason = FinishReason.STOP
            self.scheduler.finish_request(request.req_id, reason)
        if reason is not None:
            text += detok.flush()
            del self._detok[request.req_id]
            self.observer.on_request_finished(request, time.monotonic())
        return RequestDelta(
            req_id=request.req_id,
            new_token_ids=update.new_token_ids,
            text=text,
            finish_reason=reason,
            usage=self._usage(request) if reason is not None else None,
            weights_version=update.weights_version or request.weights_version,
            logprobs=update.logprobs,
        )

    def _finish(
        self,
        req_id: str,
        reason: FinishReason,
        message: str,
        cause: AbortCause | None = None,
    ) -> RequestDelta | None:
        request = self.scheduler.finish_request(req_id, reason)
        detok = self._detok.pop(req_id, None)
        if request is None:
            return None
        self.observer.on_request_finished(request, time.monotonic())
        return RequestDelta(
            req_id=req_id,
            text=detok.flush() if detok is not None and reason is not FinishReason.ERROR else "",
            finish_reason=reason,
            usage=self._usage(request),
            weights_version=request.weights_version,
            error=message,
            abort_cause=cause,
        )

    @staticmethod
    def _usage(request: Request) -> Usage:
        return Usage(
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _on_deltas_safe(self, deltas: list[RequestDelta]) -> None:
        if not deltas:
            return
        try:
            self._on_deltas(deltas)
        except Exception:  # a broken sink must not kill the engine thread
            log.exception("delivering %d deltas failed", len(deltas))

    def _snapshot(self) -> EngineStatus:
        kv = self.scheduler.kv_cache
        slots = self.runner.slots
        return EngineStatus(
            model=self.model_name,
            weights_version=slots.active_version,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_used=kv.num_used_blocks,
            num_blocks_total=kv.num_blocks,
            block_size=kv.block_size,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            scheduling_policy=self.scheduler.config.policy,
            tiers=tuple(
                dataclasses.replace(
                    t, num_refused=t.num_refused + self._early_refusals.get(t.tier, 0)
                )
                for t in self.scheduler.tier_stats()
            ),
            slot_versions=tuple(v or "" for v in slots.versions),
            active_slot=slots.active,
            swapping=self.commits.busy,
        )
