"""Request deltas from token updates: detokenization, stop strings, usage, finishes.

`OutputProcessor` turns what the scheduler's `update_from_output` returns (`TokenUpdate`s,
token ids per request) into the `RequestDelta`s the API streams: the new text (held back
across incomplete UTF-8 and possible stop strings by each request's `IncrementalDetokenizer`),
the finish reason and, on the last delta, the usage. A stop string the detokenizer finds
finishes the request in the scheduler (its blocks are freed at once). It also builds the
deltas of requests that end outside a step: refused at admission, aborted, failed. Every
request it finishes gets its `end_reason` (what happened, for telemetry) before the observer
hears of it; the delta keeps the client's `FinishReason` and, for the API's status, the
`AbortCause`.

Updates may be deferred (`defer`) and turned into deltas later (`flush`): on a GPU the engine
does that work after the next step is launched, while the device computes. A request that
finished meanwhile (an abort) has no detokenizer any more and its deferred update is dropped.
Engine thread only; which tokens exist is the scheduler's business.
"""

from __future__ import annotations

import time

from sitsd.engine.detokenizer import Decoder, IncrementalDetokenizer
from sitsd.engine.observer import EngineObserver
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler, TokenUpdate
from sitsd.types import AbortCause, EndReason, FinishReason, RequestDelta, Usage

# What the API must answer for a request the engine ended: overloaded, or out of time.
_ABORT_CAUSES = {
    EndReason.REFUSED: AbortCause.OVERLOADED,
    EndReason.SHED: AbortCause.OVERLOADED,
    EndReason.DEADLINE: AbortCause.DEADLINE,
}


class OutputProcessor:
    """Token updates -> `RequestDelta`s; owns each live request's detokenizer."""

    def __init__(self, scheduler: Scheduler, tokenizer: Decoder, observer: EngineObserver) -> None:
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._observer = observer
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._deferred: list[TokenUpdate] = []  # a step's updates, not yet detokenized

    def add(self, request: Request) -> None:
        """A request was queued: its text starts after its prompt."""
        self._detok[request.req_id] = IncrementalDetokenizer(
            self._tokenizer, request.prompt_token_ids, request.params.stop
        )

    def deltas(self, updates: list[TokenUpdate]) -> list[RequestDelta]:
        """The deltas of a step's updates, now."""
        return [self._to_delta(u) for u in updates]

    def defer(self, updates: list[TokenUpdate]) -> None:
        """Keep a step's updates for the next `flush` (overlapping the next step's compute)."""
        self._deferred = updates

    def flush(self) -> list[RequestDelta]:
        """The deltas of the deferred updates (none if nothing was deferred)."""
        updates, self._deferred = self._deferred, []
        # A request may have finished since (abort): its detokenizer is gone, skip it.
        return [self._to_delta(u) for u in updates if u.request.req_id in self._detok]

    def finish(self, req_id: str, end: EndReason, message: str) -> RequestDelta | None:
        """End a live request outside a step (shed, deadline, cancelled, shutdown, error): its
        last delta (ERROR for `EndReason.ERROR`, else ABORT), or None if it is not live."""
        reason = FinishReason.ERROR if end is EndReason.ERROR else FinishReason.ABORT
        request = self._scheduler.finish_request(req_id, reason)
        detok = self._detok.pop(req_id, None)
        if request is None:
            return None
        request.end_reason = end
        self._observer.on_request_finished(request, time.monotonic())
        return RequestDelta(
            req_id=req_id,
            text=detok.flush() if detok is not None and reason is not FinishReason.ERROR else "",
            finish_reason=reason,
            usage=usage_of(request),
            weights_version=request.weights_version,
            error=message,
            abort_cause=_ABORT_CAUSES.get(end),
        )

    def finish_all(self, message: str, end: EndReason = EndReason.ERROR) -> list[RequestDelta]:
        """End every live request (the engine failed or stops)."""
        deltas = [self.finish(req_id, end, message) for req_id in list(self._scheduler.requests)]
        return [d for d in deltas if d is not None]

    @staticmethod
    def refused(request: Request, message: str) -> RequestDelta:
        """The one delta of a request admission control refused (it was never queued)."""
        request.end_reason = EndReason.REFUSED
        return RequestDelta(
            req_id=request.req_id,
            finish_reason=FinishReason.ABORT,
            usage=usage_of(request),
            weights_version=request.weights_version,
            error=message,
            abort_cause=AbortCause.OVERLOADED,
        )

    def _to_delta(self, update: TokenUpdate) -> RequestDelta:
        request = update.request
        detok = self._detok[request.req_id]
        text = detok.step(update.new_token_ids)
        reason = update.finish_reason
        if reason is None and detok.stopped:
            reason = FinishReason.STOP
            self._scheduler.finish_request(request.req_id, reason)
        if reason is not None:
            text += detok.flush()
            del self._detok[request.req_id]
            request.end_reason = EndReason.STOP if reason is FinishReason.STOP else EndReason.LENGTH
            self._observer.on_request_finished(request, time.monotonic())
        return RequestDelta(
            req_id=request.req_id,
            new_token_ids=update.new_token_ids,
            text=text,
            finish_reason=reason,
            usage=usage_of(request) if reason is not None else None,
            weights_version=update.weights_version or request.weights_version,
            logprobs=update.logprobs,
        )


def usage_of(request: Request) -> Usage:
    """A request's token counts, for its last delta."""
    return Usage(
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=request.num_output_tokens,
        cached_tokens=max(request.num_cached_tokens, 0),
    )
