"""The scheduler's waiting queue, in one of two orders: arrival (FCFS) or tier queue deadline.

`FcfsQueue` is a deque: new requests at the back, preempted ones back at the front.
`TierQueue` keeps requests sorted by `sitsd.engine.tiers.queue_key` (arrival time plus the
tier's maximum queue wait), so a preempted request, which keeps its arrival time, goes back to
the place it had. Which request to admit is the scheduler's business; these only keep order.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterator

from sitsd.engine.request import Request


class FcfsQueue:
    """Arrival order; preempted requests return to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)


class TierQueue:
    """Sorted by a key computed once per request (ties: insertion order)."""

    def __init__(self, key: Callable[[Request], float]) -> None:
        self._key = key
        self._entries: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()

    def push(self, request: Request) -> None:
        bisect.insort(self._entries, (self._key(request), next(self._seq), request))

    def push_preempted(self, request: Request) -> None:
        self.push(request)  # the key comes from the arrival time: the same place as before

    def peek(self) -> Request:
        return self._entries[0][2]

    def remove(self, request: Request) -> None:
        for i, (_, _, queued) in enumerate(self._entries):
            if queued is request:
                del self._entries[i]
                return
        raise ValueError(f"request {request.req_id!r} is not waiting")

    def __iter__(self) -> Iterator[Request]:
        return iter([request for _, _, request in self._entries])

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)
