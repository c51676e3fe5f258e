"""Heartbeats in a worker's Generate stream: a silent stretch yields heartbeats without disturbing the stream, and
closing the stream (a cancelled call) closes the engine stream where it waits."""

from __future__ import annotations

import asyncio

from tokenfleet.services.common.heartbeats import with_heartbeats


def test_a_silent_stretch_yields_heartbeats_and_the_items_arrive_whole_and_in_order():
    async def source():  # type: ignore[no-untyped-def]
        yield 1
        await asyncio.sleep(0.35)  # silent for about three heartbeat intervals
        yield 2
        yield 3

    async def collect() -> list[int | None]:
        return [item async for item in with_heartbeats(source(), 0.1)]

    seen = asyncio.run(collect())
    assert [item for item in seen if item is not None] == [1, 2, 3]
    assert seen[0] == 1 and seen[-2:] == [2, 3]
    assert 2 <= seen.count(None) <= 4, seen


def test_no_heartbeat_when_items_keep_coming():
    async def source():  # type: ignore[no-untyped-def]
        for i in range(5):
            await asyncio.sleep(0.01)
            yield i

    async def collect() -> list[int | None]:
        return [item async for item in with_heartbeats(source(), 5.0)]

    assert asyncio.run(collect()) == [0, 1, 2, 3, 4]


def test_closing_during_a_silence_closes_the_source_where_it_waits_and_errors_pass_through():
    closed: list[str] = []

    async def source():  # type: ignore[no-untyped-def]
        try:
            yield 1
            await asyncio.sleep(60)
            yield 2
        finally:
            closed.append("closed")  # where the engine stream aborts its request

    async def run() -> list[int | None]:
        got: list[int | None] = []
        stream = with_heartbeats(source(), 0.05)
        async for item in stream:
            got.append(item)
            if item is None:
                break
        await stream.aclose()
        return got

    assert asyncio.run(run()) == [1, None]
    assert closed == ["closed"]

    async def failing():  # type: ignore[no-untyped-def]
        yield 1
        raise ValueError("the engine failed")

    async def collect() -> list[int | None]:
        return [item async for item in with_heartbeats(failing(), 5.0)]

    try:
        asyncio.run(collect())
    except ValueError as e:
        assert str(e) == "the engine failed"
    else:
        raise AssertionError("the source's error was lost")
