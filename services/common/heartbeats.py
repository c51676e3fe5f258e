"""Heartbeats in a stream that can fall silent for long (queued, preempted, a long engine step).

Keepalive pings at the HTTP/2 layer do not fail a call whose peer is stopped (SIGSTOP) or silently
partitioned (measured with grpcio 1.85.3: still open after 60 s of 2 s pings), so a caller cannot
tell a hung replica from a slow one. A worker asked for heartbeats (``GenerateRequest.heartbeat_ms``)
sends one whenever its stream has been silent for the interval; the caller gives up on a stream that
has been silent for several intervals (the gateway's ``--stall-timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def with_heartbeats(source: AsyncIterator[T], interval_s: float) -> AsyncGenerator[T | None, None]:
    """``source``'s items, and None whenever it has produced nothing for ``interval_s``.

    The next item is awaited in a task of its own, so a heartbeat never interrupts ``source``;
    closing this generator cancels that task (which closes ``source`` where it waits) and then
    closes ``source``."""
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))  # type: ignore[arg-type]
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
        if hasattr(source, "aclose"):
            await source.aclose()

