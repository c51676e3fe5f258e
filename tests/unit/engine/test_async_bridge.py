"""AsyncEngine: streaming, cancellation frees blocks, concurrency, errors, lifecycle (real model, fp32)."""

from __future__ import annotations

import asyncio

import pytest

from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.builder import build_engine_core
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.interface import Engine, EngineOverloadedError, EngineStoppedError
from tokenfleet.engine.request import FinishReason
from tokenfleet.engine.sampling_params import SamplingParams


def make_engine(model_dir, **options) -> AsyncEngine:
    config = EngineConfig(model=str(model_dir), dtype="float32", num_threads=1, num_blocks=256, **options)
    return AsyncEngine(lambda: build_engine_core(config))


def chat_ids(engine: AsyncEngine, text: str) -> list[int]:
    tok = engine.core.tokenizer
    return tok.encode(render_chat(tok, [{"role": "user", "content": text}]))


async def collect(engine, prompt, params, request_id):
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    return outs


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("engine did not become idle")


def test_async_engine_end_to_end(default_model_dir):
    asyncio.run(_scenario(default_model_dir))


async def _scenario(model_dir) -> None:
    engine = make_engine(model_dir)
    assert isinstance(engine, Engine)
    await engine.start()
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        prompts = [chat_ids(engine, q) for q in ("What is the sun?", "Name a fruit.", "Say hello.")]

        # Streaming: deltas concatenate to the whole answer; only the last one is final.
        alone = [await collect(engine, p, greedy, f"alone-{i}") for i, p in enumerate(prompts)]
        for outs in alone:
            assert outs[-1].finished and outs[-1].finish_reason is not None
            assert not any(o.finished for o in outs[:-1])

        # Concurrency: the same requests at once give the same tokens.
        together = await asyncio.gather(*(collect(engine, p, greedy, f"both-{i}") for i, p in enumerate(prompts)))
        tokens = lambda outs: [t for o in outs for t in o.new_token_ids]  # noqa: E731
        assert [tokens(o) for o in together] == [tokens(o) for o in alone]
        assert ["".join(x.text for x in o) for o in together] == ["".join(x.text for x in o) for o in alone]

        # Cancellation: closing the stream aborts the request and frees its blocks.
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = engine.generate(prompts[0], long, "cancel-me")
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()
        await wait_idle(engine)
        bm = engine.core.scheduler.block_manager
        assert bm.num_used_blocks == 0
        assert engine.stats().num_aborted >= 1

        # abort(): the stream ends with an ABORT output.
        stream = engine.generate(prompts[1], long, "abort-me")
        first = await stream.__anext__()
        assert not first.finished
        await engine.abort("abort-me")
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT

        # Bad input surfaces as ValueError before any output.
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, [], greedy, "bad-1")
        with pytest.raises(ValueError, match="context"):
            await collect(engine, [5] * 9000, greedy, "bad-2")
        await wait_idle(engine)
        bm.check_invariants()
        assert bm.num_used_blocks == 0
    finally:
        await engine.shutdown()
    with pytest.raises(EngineStoppedError):
        await collect(engine, [1, 2, 3], SamplingParams(max_tokens=1), "after-stop")


def test_full_waiting_queue_is_reported_as_overloaded(default_model_dir):
    async def scenario() -> None:
        engine = make_engine(default_model_dir, max_num_waiting=0)
        await engine.start()
        try:
            with pytest.raises(EngineOverloadedError, match="full"):
                await collect(engine, [1, 2, 3], SamplingParams(max_tokens=2), "x")
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_drain_waits_for_in_flight_requests(default_model_dir):
    async def scenario() -> None:
        engine = make_engine(default_model_dir)
        await engine.start()
        try:
            task = asyncio.create_task(collect(engine, [10, 11, 12], SamplingParams(max_tokens=8, ignore_eos=True), "d"))
            await asyncio.sleep(0.05)
            await engine.drain()
            outs = await task
            assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 8
            with pytest.raises(EngineStoppedError):
                await collect(engine, [1, 2], SamplingParams(max_tokens=1), "late")
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
