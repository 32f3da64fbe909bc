"""The engine core: one loop on its own thread that owns the scheduler and the model runner.

Each turn of the loop:

    inbox      new requests (one admission control refuses is finished at once), aborts
               (the client's, a passed deadline, shutdown), swap commands (the swap
               controller's), engine calls (short work between steps)
    expiry     requests whose deadline has passed are aborted; those that waited past their
               tier's queue limit are shed
    step       schedule -> execute -> update -> deltas (`sitsd.engine.step`: in turn, or one
               step ahead with asynchronous scheduling, chosen once when the core is built)
    status     a snapshot for other threads, then the deltas go to `on_deltas`

Its parts: the `Scheduler` (which tokens to compute), the model runner (computing them), the
`OutputProcessor` (token updates -> `RequestDelta`s), the `SwapController` (weight slots and
commits, `sitsd.engine.swap_controller`) and an `EngineObserver` (telemetry), told of every
request added (and where it queued), refused, preempted, migrated and finished (and how), of
every step and of the status after each turn. Swap commands, and engine calls that may run the
model, first finish a step launched ahead. Nothing else touches the scheduler or the runner, so
no lock guards them (but for a weight slot the stager holds reserved: its copy, and the
capture of its graphs beside serving, `SwapPort.capture_graphs`); other threads read
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

from sitsd.engine.admission import QueuePlace, QueueSnapshot, Refusal
from sitsd.engine.messages import AbortRequest, AddRequest, EngineCall, SwapCommand
from sitsd.engine.observer import EngineObserver, GuardedObserver, NullObserver
from sitsd.engine.output import OutputProcessor
from sitsd.engine.request import Request
from sitsd.engine.runner import ModelRunnerLike
from sitsd.engine.scheduler import Scheduler
from sitsd.engine.step import AheadStep, HookList, InTurnStep, ObserverHooks, StepParts
from sitsd.engine.swap_controller import SwapController
from sitsd.outputs import EngineStatus
from sitsd.types import EndReason, RequestDelta, Tier, TokenizerLike

log = logging.getLogger(__name__)

DeltaSink = Callable[[list[RequestDelta]], None]
Message = AddRequest | AbortRequest | SwapCommand | EngineCall


class EngineCore:
    """Runs the step loop; see the module docstring."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunnerLike,
        tokenizer: TokenizerLike,
        model_name: str,
        default_tier: Tier = Tier.SILVER,
        observer: EngineObserver | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_tier = default_tier
        self._eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._inbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._seeds = random.Random()  # seeds for requests that bring none; per engine
        self._on_deltas: DeltaSink = _drop_deltas
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Told of requests and steps; a failing hook is logged, never costs a request.
        self.observer = GuardedObserver(observer or NullObserver())
        self.output = OutputProcessor(scheduler, tokenizer, self.observer)
        # Replies and swap events go out after the status snapshot shows their effect.
        self.swaps = SwapController(scheduler, runner, self.observer, self._refresh)
        hooks = HookList([self.swaps, scheduler.pacer, ObserverHooks(self.observer, scheduler)])
        in_turn = InTurnStep(StepParts(scheduler, runner, self.output, hooks))
        # The step function, chosen once.
        self._step: InTurnStep | AheadStep = (
            AheadStep(in_turn, self.swaps) if scheduler.config.async_scheduling else in_turn
        )
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
    def num_steps(self) -> int:
        return self._step.num_steps

    @property
    def max_num_live_requests(self) -> int:
        cfg = self.scheduler.config
        return cfg.max_num_seqs + cfg.max_num_waiting

    def status(self) -> EngineStatus:
        return self._status

    def admission_refusal(self, msg: AddRequest) -> Refusal | None:
        """Why a new request must be refused at once (RESOURCE_EXHAUSTED), or None.

        Called on the API's thread against the queue as of the last engine turn; the engine
        thread checks again with its live queue (`Scheduler.admission_refusal`). A refused
        request is reported to the observer from the calling thread (`on_request_refused`).
        """
        tier = msg.tier or self.default_tier
        refusal = self.scheduler.policy.early_refusal(self._queue, tier, msg.arrival_time)
        if refusal is not None:
            self._early_refusals[tier.value] = self._early_refusals.get(tier.value, 0) + 1
            request = self._request(msg, seed=0)  # never runs: any seed
            request.end_reason = EndReason.REFUSED
            self.observer.on_request_refused(request, time.monotonic(), refusal)
        return refusal

    # ---------------------------------------------------------------------------------- loop

    def step(self) -> list[RequestDelta]:
        """One engine step: schedule -> execute -> update -> deltas (`sitsd.engine.step`)."""
        return self._step()

    def _run(self) -> None:
        while not self._stopping.is_set():
            deltas: list[RequestDelta] = []
            try:
                busy = self.scheduler.has_work() or self._step.has_pending
                deltas += self._drain_inbox(block=not busy)
                deltas += self._abort_expired()
                if self.scheduler.has_work() or self._step.has_pending:
                    deltas += self.step()
                else:
                    deltas += self.output.flush()
                    self.swaps.when_idle()
            except Exception as exc:  # a bug must cost requests, never the engine thread
                log.exception("engine loop failed; failing every live request")
                message = f"internal engine error: {type(exc).__name__}: {exc}"
                deltas += self.output.finish_all(message)
                self.scheduler.probes.fail_all(message)
            self._publish(deltas)
        # Leaving: whatever is still live is aborted so no client waits forever.
        deltas = self.output.flush() + self._drain_inbox(block=False)
        deltas += self.output.finish_all("the engine stopped", EndReason.SHUTDOWN)
        self.scheduler.probes.fail_all("the engine stopped")
        self._status = self._snapshot()
        self._deliver(deltas)

    def _drain_inbox(self, block: bool) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(message, AddRequest):
                    refused = self._add(message)
                    if refused is not None:
                        deltas.append(refused)
                elif isinstance(message, AbortRequest):
                    delta = self.output.finish(message.req_id, message.cause, message.reason)
                    if delta is not None:
                        deltas.append(delta)
                elif isinstance(message, SwapCommand):
                    # A commit goes between finished steps; the finished one's tokens go out
                    # now, not after the next step.
                    self._publish(deltas + self._step.finish_ahead())
                    deltas = []
                    self.swaps.handle(message)
                elif isinstance(message, EngineCall):
                    if self._waits_for_ahead(message):
                        self._publish(deltas + self._step.finish_ahead())
                        deltas = []
                    self._call(message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return deltas

    def _waits_for_ahead(self, message: EngineCall) -> bool:
        """The call must wait for the step launched ahead (`EngineCall.waits_for`)."""
        if message.waits_for == "any":
            return True
        if message.waits_for == "none":
            return False
        slots = self.runner.slots
        index = slots.standby
        version = slots.versions[index] if index is not None else None
        return version is not None and self._step.ahead_reads(version)

    def _call(self, message: EngineCall) -> None:
        try:
            result = message.fn()
        except Exception as exc:  # the caller's failure, reported to it; the loop goes on
            message.reply(None, exc)
        else:
            self._refresh()  # the caller may read `status()` next: it shows what fn did
            message.reply(result, None)

    def _refresh(self) -> None:
        self._status = self._snapshot()

    def _request(self, msg: AddRequest, seed: int) -> Request:
        return Request(
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

    def _add(self, msg: AddRequest) -> RequestDelta | None:
        """Queue a new request; the finishing delta instead if admission control refuses it."""
        seed = msg.params.seed if msg.params.seed is not None else self._seeds.getrandbits(63)
        request = self._request(msg, seed)
        refusal = self.scheduler.admission_refusal(request)
        if refusal is not None:  # never queued: nothing to free
            delta = self.output.refused(request, refusal.message)
            self.observer.on_request_refused(request, time.monotonic(), refusal)
            return delta
        scheduler = self.scheduler
        scheduler.add_request(request)
        ahead = []  # whom it queues behind, in the policy's order
        for queued in scheduler.waiting:
            if queued is request:
                break
            ahead.append(queued.tier)
        self.observer.on_request_added(request, QueuePlace.behind(ahead, scheduler.num_running))
        self.output.add(request)
        return None

    def _abort_expired(self) -> list[RequestDelta]:
        now = time.monotonic()
        finish = self.output.finish
        deltas = [
            finish(r, EndReason.DEADLINE, "deadline exceeded")
            for r in self.scheduler.expired_req_ids(now)
        ]
        deltas += [
            finish(r, EndReason.SHED, why) for r, why in self.scheduler.overdue_requests(now)
        ]
        return [d for d in deltas if d is not None]

    def _publish(self, deltas: list[RequestDelta]) -> None:
        """Deliver `deltas` with the status and queue as they are now. Snapshot first, so a
        client that sees its last delta also sees the blocks it held returned."""
        self._status = self._snapshot()
        self.observer.on_status(self._status)
        self._queue = self.scheduler.queue_snapshot()
        self._deliver(deltas)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
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
            scheduling_policy=self.scheduler.policy.name,
            tiers=tuple(
                dataclasses.replace(
                    t, num_refused=t.num_refused + self._early_refusals.get(t.tier, 0)
                )
                for t in self.scheduler.tier_stats()
            ),
            slot_versions=tuple(v or "" for v in slots.versions),
            active_slot=slots.active,
            slot_precisions=tuple(slots.precision(i) for i in range(slots.num_slots)),
            slot_weight_bytes=tuple(slots.nbytes(i) for i in range(slots.num_slots)),
            swapping=self.swaps.busy,
        )


def _drop_deltas(deltas: list[RequestDelta]) -> None:
    """The delta sink before `run` sets the real one."""
