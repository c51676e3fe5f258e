"""Request preparation off the event loop: validating sampling parameters and grammars, rendering
the chat template and tokenizing run in a few threads, never on the loop that streams every other
request's tokens. The queue is bounded: past ``max_pending`` requests waiting or running, a request
is refused at once (503, Retry-After) rather than queued behind them.

The threads share the GIL with the loop, so a long render still takes CPU from it, but in the
interpreter's switch intervals (milliseconds) instead of one block for the whole render.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokenfleet.api.openai_schema import APIError

T = TypeVar("T")
DEFAULT_THREADS = 2
DEFAULT_MAX_PENDING = 64


class Preparer:
    def __init__(self, threads: int = DEFAULT_THREADS, max_pending: int = DEFAULT_MAX_PENDING):
        self.max_pending = max_pending
        self.pending = 0
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="prepare")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self.pending >= self.max_pending:
            raise APIError(503, f"the gateway is busy: {self.pending} requests are being prepared", "server_error",
                           code="overloaded", headers={"retry-after": "1"})
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
