"""Request preparation off the event loop: validating sampling parameters and grammars, rendering
the chat template and tokenizing run in a few threads, never on the loop that streams every other
request's tokens.

A burst waits its turn rather than being refused: preparation takes milliseconds a request, and the
engine, not this pool, is what is scarce. A request waits until its deadline (the client's timeout);
only a queue longer than ``max_queued`` requests, a size the fleet's workers could hold waiting
(each worker's ``--max-num-waiting``), is refused at once (503 with Retry-After).

The threads share the GIL with the loop, so a long render still takes CPU from it, but in the
interpreter's switch intervals (milliseconds) instead of one block for the whole render.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokenfleet.api.openai_schema import APIError

T = TypeVar("T")
DEFAULT_THREADS = 2
DEFAULT_MAX_QUEUED = 4096


class Preparer:
    def __init__(self, threads: int = DEFAULT_THREADS, max_queued: int = DEFAULT_MAX_QUEUED):
        self.max_queued = max_queued
        self.pending = 0  # waiting or running
        self._slots = asyncio.Semaphore(threads)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="prepare")

    async def run(self, fn: Callable[..., T], *args: object, deadline: float | None = None) -> T:
        """``fn(*args)`` in a preparation thread. ``deadline`` (time.monotonic()): a request still waiting for a
        thread then is refused (503, Retry-After): its client has stopped waiting."""
        if self.pending >= self.max_queued:
            raise APIError(503, f"the gateway is busy: {self.pending} requests are waiting to be prepared",
                           "server_error", code="overloaded", headers={"retry-after": "1"})
        self.pending += 1
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(self._slots.acquire(), timeout)
            except TimeoutError:
                raise APIError(503, "the gateway could not prepare the request before its deadline", "server_error",
                               code="overloaded", headers={"retry-after": "1"}) from None
            try:
                return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
            finally:
                self._slots.release()
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
