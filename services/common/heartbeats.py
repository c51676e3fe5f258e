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

    One task per stream reads ``source`` into a one-item queue, so a heartbeat never interrupts ``source`` and an item
    costs a queue hand-off, not a task of its own; closing this generator cancels that task (which closes ``source``
    where it waits) and then closes ``source``."""
    items: asyncio.Queue[tuple[bool, T | BaseException | None]] = asyncio.Queue(maxsize=1)

    async def pump() -> None:
        try:
            async for item in source:
                await items.put((True, item))
            await items.put((False, None))
        except Exception as e:  # noqa: BLE001 - raised where the stream is read
            await items.put((False, e))

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                async with asyncio.timeout(interval_s):
                    more, item = await items.get()
            except TimeoutError:
                yield None
                continue
            if more:
                yield item  # type: ignore[misc]
            elif item is None:
                return
            else:
                raise item  # type: ignore[misc]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if hasattr(source, "aclose"):
            await source.aclose()
