"""AsyncEngine over the real default model (fp32, 1 thread): streaming, cancellation, concurrency,
errors, overload and lifecycle.

The engine thread does not depend on any event loop (each ``generate`` call captures its own), so one
engine started with ``asyncio.run`` serves every test's own ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tokenfleet.api.chat_template import render_chat
from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.interface import Engine, EngineOverloadedError, EngineStoppedError
from tokenfleet.engine.output import RequestOutput
from tokenfleet.engine.request import FinishReason
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
MODEL_CONTEXT = 8192  # SmolLM2's max_position_embeddings


def make_engine(model_dir, **options) -> AsyncEngine:
    options = {"dtype": "float32", "num_threads": 1, "num_blocks": 256, **options}
    config = EngineConfig(model=str(model_dir), **options)
    return AsyncEngine(lambda: build_engine_core(config))


@pytest.fixture(scope="module")
def engine(default_model_dir):
    engine = make_engine(default_model_dir)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    from tokenfleet.llm import LLM

    return LLM(str(default_model_dir), dtype="float32", num_threads=1, num_blocks=256)


def chat_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": text}]))


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(RequestSpec(prompt, params, request_id))]


def token_ids(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


async def until(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Bounded poll (a hang guard, not a timing assertion)."""
    for _ in range(int(limit_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"gave up waiting: {what}")


async def wait_idle(engine: AsyncEngine) -> None:
    def idle() -> bool:
        stats = engine.stats()
        return stats.num_running == 0 and stats.num_waiting == 0

    await until(idle, "engine idle")


def assert_clean(engine: AsyncEngine) -> None:
    """Nothing queued or running, no KV block held (cached prefix blocks count as free)."""
    scheduler = engine.core.scheduler
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert not scheduler.has_unfinished()
    bm = scheduler.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks


# ---- streaming ------------------------------------------------------------------------------------


def test_async_engine_satisfies_the_engine_protocol(engine):
    assert isinstance(engine, Engine)


@pytest.mark.parametrize("question", ["What is the capital of France?", "Write a haiku about the sea."])
def test_greedy_stream_equals_offline_run(engine, tokenizer, llm, question):
    prompt = chat_ids(tokenizer, question)
    outs = asyncio.run(collect(engine, prompt, GREEDY, f"stream-{question}"))
    [offline] = llm.generate(prompt, GREEDY)

    assert token_ids(outs) == offline.token_ids
    assert text(outs) == offline.text
    assert offline.text.strip()
    final = outs[-1]
    assert final.finished and final.finish_reason is offline.finish_reason
    assert final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert not any(o.finished for o in outs[:-1])
    assert all(len(o.new_token_ids) == 1 for o in outs)  # one delta per decoded token
    assert final.num_output_tokens == len(offline.token_ids)
    assert all(o.request_id == f"stream-{question}" and o.num_prompt_tokens == len(prompt) for o in outs)


def test_a_forgotten_prefill_rate_is_unknown_in_the_next_stats(engine, tokenizer):
    """The worker's warm-up forgets its own prefill's rate (a cold start's: kernels compiling), so early
    rejection cannot judge real prompts by it; stats() must show that as soon as the call returns."""
    asyncio.run(collect(engine, chat_ids(tokenizer, "Hello there. " * 60), GREEDY, "rate-1"))  # >= 128 tokens
    assert engine.stats().prefill_tokens_per_s > 0
    asyncio.run(engine.forget_prefill_rate())
    assert engine.stats().prefill_tokens_per_s == 0.0
    assert engine.stats().predicted_wait(1000) == 0.0


def test_device_peaks_are_measured_on_the_engine_thread(engine, monkeypatch):
    """Torch work off the engine thread leaves an OpenMP pool on that thread, which slows every later step
    (backends.torch.device.in_passing_thread): the peaks' measurement runs where the steps do."""
    import threading

    costs = engine.core.costs
    assert costs is not None
    seen: list[str] = []
    real = costs.peaks

    def peaks():  # type: ignore[no-untyped-def]
        seen.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(costs, "peaks", peaks)
    flops, read, _ = asyncio.run(engine.device_peaks())
    assert flops > 0 and read > 0
    assert seen == ["tokenfleet-engine"]


def test_length_limit_is_reported(engine, tokenizer):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = asyncio.run(collect(engine, chat_ids(tokenizer, "Count to ten."), params, "len-4"))
    assert len(token_ids(outs)) == 4
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH


# ---- cancellation ------------------------------------------------------------------------------------


def test_closing_the_stream_aborts_the_request_and_frees_its_blocks(engine, tokenizer):
    async def scenario() -> None:
        aborted_before = engine.stats().num_aborted
        stream = engine.generate(RequestSpec(chat_ids(tokenizer, "Tell me a long story."), LONG, "close-me"))
        deltas = [await stream.__anext__() for _ in range(3)]
        assert not any(d.finished for d in deltas)
        await stream.aclose()
        await wait_idle(engine)
        await until(lambda: engine.stats().num_aborted == aborted_before + 1, "abort counted")
        assert "close-me" not in engine.core.scheduler.requests
        assert engine.stats().num_blocks_used == 0
        assert_clean(engine)

    asyncio.run(scenario())


def test_cancelling_the_consumer_task_aborts_the_request(engine, tokenizer):
    """A client that goes away (its task is cancelled while it awaits the next delta)."""

    async def scenario() -> None:
        got: list[RequestOutput] = []

        async def consume() -> None:
            async for out in engine.generate(RequestSpec(chat_ids(tokenizer, "Describe the moon."), LONG, "cancel-me")):
                got.append(out)

        task = asyncio.create_task(consume())
        await until(lambda: len(got) >= 2, "two deltas")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)
        assert "cancel-me" not in engine.core.scheduler.requests
        assert len(token_ids(got)) < LONG.max_tokens
        assert_clean(engine)

    asyncio.run(scenario())


def test_abort_ends_the_stream_with_abort(engine, tokenizer):
    async def scenario() -> None:
        stream = engine.generate(RequestSpec(chat_ids(tokenizer, "List every prime number."), LONG, "abort-me"))
        first = await stream.__anext__()
        assert not first.finished
        await engine.abort("abort-me")
        rest = [out async for out in stream]
        assert rest and rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT
        assert not any(o.finished for o in rest[:-1])
        assert 1 <= rest[-1].num_output_tokens < LONG.max_tokens
        await engine.abort("abort-me")  # already gone: harmless
        await engine.abort("never-existed")
        await wait_idle(engine)
        assert_clean(engine)
        # The engine still serves.
        outs = await collect(engine, [10, 11, 12], SamplingParams(max_tokens=2, ignore_eos=True), "after-abort")
        assert len(token_ids(outs)) == 2

    asyncio.run(scenario())


def test_cancelling_during_admission_neither_kills_the_engine_nor_leaks_the_request(default_model_dir):
    async def scenario() -> None:
        engine = make_engine(default_model_dir)
        await engine.start()
        try:
            running = engine.generate(RequestSpec([10, 11, 12, 13], SamplingParams(max_tokens=8, ignore_eos=True), "running"))
            await running.__anext__()  # the engine is now busy stepping "running"
            late = engine.generate(RequestSpec([20, 21, 22], LONG, "late"))
            admission = asyncio.ensure_future(late.__anext__())
            await asyncio.sleep(0)  # "late" has queued its add and awaits admission
            admission.cancel()
            with pytest.raises(asyncio.CancelledError):
                await admission

            rest = asyncio.ensure_future(_drain(running))
            thread = engine._thread
            await until(lambda: rest.done() or thread is None or not thread.is_alive(), "running to end")
            assert thread is not None and thread.is_alive(), "the engine thread died"
            outs = await rest
            assert outs[-1].finish_reason is FinishReason.LENGTH
            # The cancelled caller's request must not be left generating (it had 200 tokens to go):
            # only "running" may finish naturally.
            await wait_idle(engine)
            assert "late" not in engine.core.scheduler.requests
            stats = engine.stats()
            assert stats.num_finished == 1 and stats.num_generated_tokens == 8
            assert_clean(engine)
        finally:
            await engine.shutdown()  # asyncio.run then cancels whatever still waits on a dead engine

    asyncio.run(scenario())


async def _drain(stream) -> list[RequestOutput]:
    return [out async for out in stream]


# ---- concurrency -----------------------------------------------------------------------------------


def test_concurrent_requests_match_sequential_ones(engine, tokenizer):
    questions = ["What is the sun?", "Name a fruit.", "Say hello.", "Why is the sky blue? Answer briefly."]
    prompts = [chat_ids(tokenizer, q) for q in questions]
    params = SamplingParams(max_tokens=10, temperature=0.0)

    async def scenario():
        alone = [await collect(engine, p, params, f"seq-{i}") for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(engine, p, params, f"par-{i}") for i, p in enumerate(prompts)))
        return alone, together

    alone, together = asyncio.run(scenario())
    assert [token_ids(o) for o in together] == [token_ids(o) for o in alone]
    assert [text(o) for o in together] == [text(o) for o in alone]
    assert [o[-1].finish_reason for o in together] == [o[-1].finish_reason for o in alone]
    for i, outs in enumerate(together):
        assert all(o.request_id == f"par-{i}" for o in outs)  # no cross-talk between streams
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    asyncio.run(wait_idle(engine))
    assert_clean(engine)


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        pytest.param([], "empty", id="empty"),
        pytest.param([5] * MODEL_CONTEXT, "context", id="fills-the-context"),
        pytest.param([5] * (MODEL_CONTEXT + 808), "context", id="longer-than-context"),
        pytest.param([1, 2, 49152], "range", id="token-id-out-of-vocab"),
        pytest.param([1, -1], "range", id="negative-token-id"),
    ],
)
def test_bad_prompt_raises_value_error_before_any_output(engine, prompt, match):
    got: list[RequestOutput] = []

    async def scenario() -> None:
        async for out in engine.generate(RequestSpec(prompt, GREEDY, f"bad-{len(prompt)}-{match}")):
            got.append(out)

    with pytest.raises(ValueError, match=match):
        asyncio.run(scenario())
    assert got == []
    assert not engine.core.scheduler.has_unfinished()


def test_duplicate_in_flight_request_id_is_rejected_and_the_original_continues(engine, tokenizer):
    async def scenario() -> None:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        first = engine.generate(RequestSpec(chat_ids(tokenizer, "Hi"), params, "dup"))
        head = await first.__anext__()
        with pytest.raises(ValueError, match="duplicate"):
            await collect(engine, [1, 2, 3], params, "dup")
        tail = [out async for out in first]
        assert len(token_ids([head, *tail])) == 6
        assert tail[-1].finish_reason is FinishReason.LENGTH
        await wait_idle(engine)
        assert_clean(engine)

    asyncio.run(scenario())


# ---- overload and lifecycle ------------------------------------------------------------------------


def test_full_waiting_queue_raises_overloaded(default_model_dir):
    async def scenario() -> None:
        engine = make_engine(default_model_dir, max_num_running=1, max_num_waiting=1)
        await engine.start()
        try:
            running = engine.generate(RequestSpec([10, 11, 12], LONG, "running"))
            assert not (await running.__anext__()).finished  # occupies the only running slot

            queued = asyncio.create_task(collect(engine, [20, 21, 22], LONG, "queued"))
            await until(lambda: engine.stats().num_waiting == 1, "second request queued")

            for i in range(3):  # the waiting queue (1) is full: every further request is refused
                with pytest.raises(EngineOverloadedError):
                    await collect(engine, [30 + i, 31], SamplingParams(max_tokens=2), f"flood-{i}")
            assert engine.stats().num_waiting == 1 and engine.stats().num_running == 1

            await engine.abort("queued")  # a waiting request can be aborted too
            queued_outs = await queued
            assert queued_outs[-1].finish_reason is FinishReason.ABORT
            assert token_ids(queued_outs) == []

            # Room again: a new request is accepted (and waits for the running one).
            accepted = asyncio.create_task(collect(engine, [40, 41], SamplingParams(max_tokens=2), "accepted"))
            await until(lambda: engine.stats().num_waiting == 1, "third request queued")
            await running.aclose()
            outs = await accepted
            assert outs[-1].finished and outs[-1].finish_reason is not FinishReason.ABORT
            await wait_idle(engine)
            assert_clean(engine)
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_shutdown_aborts_open_streams_and_refuses_new_requests(default_model_dir):
    async def scenario() -> None:
        engine = make_engine(default_model_dir)
        with pytest.raises(EngineStoppedError):  # not started yet
            await collect(engine, [1, 2, 3], SamplingParams(max_tokens=1), "too-early")
        await engine.start()
        stream = engine.generate(RequestSpec([10, 11, 12], LONG, "open"))
        assert not (await stream.__anext__()).finished
        await engine.shutdown()
        rest = [out async for out in stream]
        assert rest and rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT

        with pytest.raises(EngineStoppedError):
            await collect(engine, [1, 2, 3], SamplingParams(max_tokens=1), "after-stop")
        await engine.shutdown()  # idempotent
        with pytest.raises(EngineStoppedError):
            await collect(engine, [1, 2, 3], SamplingParams(max_tokens=1), "after-second-stop")

    asyncio.run(scenario())


def test_a_cancel_that_races_a_remote_reservation_frees_its_blocks(engine, tokenizer):
    """The engine thread reserves a remote prefill's blocks and resolves the call, but the caller is cancelled
    before the event loop hands it the result (a loaded machine): the reservation must still be released. (A CI
    run once left a decode worker's blocks reserved forever this way.)"""
    import time

    async def scenario() -> None:
        stream = engine.generate(RequestSpec(chat_ids(tokenizer, "Hello there."), GREEDY, "raced", kv_source=object()))  # type: ignore[arg-type]
        task = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0)  # the task submits the reservation to the engine thread and waits for it
        time.sleep(0.5)  # the loop is busy: the engine thread reserves and resolves, the result waits on the loop
        assert "raced" in engine.core.scheduler.requests
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: "raced" not in engine.core.scheduler.requests, "the reservation released")
        assert_clean(engine)

    asyncio.run(scenario())
