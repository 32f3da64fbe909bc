"""Blocking staging work (hashing, loading, checking, copying) on a thread of its own.

Never on the event loop (every stream's tokens go out on it) and never on the engine thread
(it runs the steps). How fast the work may go is the caller's (`sitsd.weights.progress.Pacer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar, cast

import torch

T = TypeVar("T")


async def run_off_engine(fn: Callable[[], T], name: str = "sitsd-stager") -> T:
    """Run `fn` on a new daemon thread and await its result.

    Not the default executor: `asyncio.run` joins its threads at exit, so a shutdown would wait
    for a long staging copy. The thread uses one torch thread (OpenMP keeps a team per calling
    thread; a second full team would fight the engine's for every core). Pacing the work is
    the caller's (`progress.Pacer`).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: object, exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is None:
            done.set_result(cast(T, result))
        else:
            done.set_exception(exc)

    def body() -> None:
        torch.set_num_threads(1)  # this thread's OpenMP team only
        result: object = None
        exc: BaseException | None = None
        try:
            result = fn()
        except BaseException as error:
            exc = error
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=body, name=name, daemon=True).start()
    return await done
