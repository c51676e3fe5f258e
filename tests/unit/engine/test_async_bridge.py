"""AsyncEngine drain (the rest of the async bridge is covered in test_async_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from tokenfleet.api.chat_template import render_chat
from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.interface import EngineStoppedError
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams


def make_engine(model_dir, **options) -> AsyncEngine:
    config = EngineConfig(model=str(model_dir), dtype="float32", num_threads=1, num_blocks=256, **options)
    return AsyncEngine(lambda: build_engine_core(config))


def chat_ids(engine: AsyncEngine, text: str) -> list[int]:
    tok = engine.core.tokenizer
    return tok.encode(render_chat(tok, [{"role": "user", "content": text}]))


async def collect(engine, prompt, params, request_id):
    outs = [out async for out in engine.generate(RequestSpec(prompt, params, request_id))]
    return outs


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("engine did not become idle")


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
