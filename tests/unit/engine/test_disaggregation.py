"""Disaggregated prefill between two real AsyncEngines in one process (fp32, default model):
greedy output identical to colocated, only missing blocks travel, the first token arrives
before the KV, failures fall back to local prefill, cancellation frees every block on both
sides, and a resumed request continues exactly where another replica stopped."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence

import pytest

from tests.unit.engine.test_async_engine import chat_ids, collect, make_engine
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.kv_transfer import KVChunkData, KVLayoutError, KVTransferError, PrefillDone, PrefillEvent, PrefillStarted
from tokenfleet.engine.output import Resume
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.kvcache.layout import KVLayout
from tokenfleet.models.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a meticulous assistant for a hardware store. " * 6


@pytest.fixture(scope="module")
def engines(default_model_dir):
    prefill, decode = make_engine(default_model_dir), make_engine(default_model_dir)
    asyncio.run(prefill.start())
    asyncio.run(decode.start())
    yield prefill, decode
    asyncio.run(prefill.shutdown())
    asyncio.run(decode.shutdown())


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def source(prefill: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str, log: list | None = None):
    def open_transfer(held: Sequence[bytes], layout: KVLayout) -> AsyncGenerator[PrefillEvent, None]:
        async def events() -> AsyncGenerator[PrefillEvent, None]:
            async with contextlib.aclosing(prefill.prefill(RequestSpec(prompt, params, request_id, 0), held, layout)) as stream:
                async for event in stream:
                    if log is not None:
                        log.append(event)
                    yield event
        return events()
    return open_transfer


async def disaggregated(prefill, decode, prompt, params, request_id, log=None):
    kv = source(prefill, prompt, params, request_id, log)
    return [out async for out in decode.generate(RequestSpec(prompt, params, request_id, kv_source=kv))]


def tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def text(outputs) -> str:
    return "".join(out.text for out in outputs)


def settle(*engines_: AsyncEngine) -> None:
    for engine in engines_:
        for _ in range(100):
            stats = engine.stats()
            if stats.num_blocks_used == 0 and stats.num_running == 0:
                break
            asyncio.run(asyncio.sleep(0.02))


def check_idle(*engines_: AsyncEngine) -> None:
    settle(*engines_)
    for engine in engines_:
        engine.core.scheduler.block_manager.check_invariants()
        leftover = {rid: r.status for rid, r in engine.core.scheduler.requests.items()}
        assert engine.core.scheduler.block_manager.num_used_blocks == 0, (leftover, engine.core.scheduler.held)
        assert not engine.core.scheduler.held and not engine.core.scheduler.requests


def test_greedy_output_identical_to_colocated_and_decode_computed_no_prompt(engines, tokenizer):
    prefill, decode = engines
    for i, question in enumerate(["What is the capital of France?", "Write a haiku about rain.",
                                  "List three prime numbers."]):
        prompt = chat_ids(tokenizer, question)
        colocated = asyncio.run(collect(prefill, prompt, GREEDY, f"colo-{i}"))
        before = decode.core.stats.num_prompt_tokens_computed
        outputs = asyncio.run(disaggregated(prefill, decode, prompt, GREEDY, f"disagg-{i}"))
        assert tokens(outputs) == tokens(colocated)
        assert text(outputs) == text(colocated)
        assert outputs[-1].num_prompt_tokens == len(prompt) and outputs[-1].num_output_tokens == 10
        assert decode.core.stats.num_prompt_tokens_computed == before  # the decode side prefilled nothing
    check_idle(prefill, decode)


def test_first_token_is_yielded_before_the_kv_arrives(engines, tokenizer):
    prefill, decode = engines
    prompt = chat_ids(tokenizer, SYSTEM + "Say hi.")
    log: list = []

    async def run() -> int:
        kv = source(prefill, prompt, GREEDY, "early", log)
        async with contextlib.aclosing(decode.generate(RequestSpec(prompt, GREEDY, "early", kv_source=kv))) as stream:
            first = await stream.__anext__()
            seen = len(log)
            assert first.new_token_ids
            async for _ in stream:
                pass
        return seen

    seen = asyncio.run(run())
    assert isinstance(log[0], PrefillStarted)
    assert seen < len(log)  # chunks were still to come when the first token reached us
    check_idle(prefill, decode)


def test_second_request_with_a_shared_prefix_transfers_only_missing_blocks(engines, tokenizer):
    prefill, decode = engines
    decode.core.scheduler.block_manager.reset_prefix_cache()
    first = chat_ids(tokenizer, SYSTEM + "What is a hammer?")
    second = chat_ids(tokenizer, SYSTEM + "What is a wrench used for?")
    bs = decode.kv_layout().block_size
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // bs
    log1: list = []
    log2: list = []
    asyncio.run(disaggregated(prefill, decode, first, GREEDY, "share-1", log1))
    received = decode.core.stats.num_kv_blocks_received
    colocated = asyncio.run(collect(prefill, second, GREEDY, "share-colo"))
    outputs = asyncio.run(disaggregated(prefill, decode, second, GREEDY, "share-2", log2))
    started1, started2 = log1[0], log2[0]
    assert started1.first_block == 0 and started1.num_blocks == -(-len(first) // bs)
    assert started2.first_block == shared >= 4
    assert started2.num_blocks == -(-len(second) // bs) - shared
    assert decode.core.stats.num_kv_blocks_received - received == started2.num_blocks
    assert tokens(outputs) == tokens(colocated)
    check_idle(prefill, decode)


def corrupt(kind: str):
    """A KV source that damages a good prefill stream in one way."""
    def wrap(prefill, prompt, params, request_id):
        good = source(prefill, prompt, params, request_id)

        def open_transfer(held, layout):
            async def events():
                async with contextlib.aclosing(good(held, layout)) as stream:
                    async for event in stream:
                        if isinstance(event, KVChunkData) and event.seq == 3:
                            if kind == "short":
                                event = dataclasses.replace(event, k=event.k[:-2])
                            elif kind == "reorder":
                                event = dataclasses.replace(event, layer=event.layer + 1)
                            elif kind == "truncate":
                                return
                        if isinstance(event, PrefillDone) and kind == "bytes":
                            event = PrefillDone(event.num_bytes + 1)
                        if isinstance(event, PrefillStarted) and kind == "skip":
                            event = dataclasses.replace(event, first_block=event.first_block + 1)
                        yield event
            return events()
        return open_transfer
    return wrap


@pytest.mark.parametrize("kind", ["short", "reorder", "truncate", "bytes", "skip"])
def test_damaged_kv_stream_is_rejected_and_the_request_recomputed_here(engines, tokenizer, kind):
    prefill, decode = engines
    prompt = chat_ids(tokenizer, f"Name a colour ({kind}).")
    colocated = asyncio.run(collect(prefill, prompt, GREEDY, f"ok-{kind}"))
    fallbacks = decode.core.stats.num_remote_fallbacks
    kv = corrupt(kind)(prefill, prompt, GREEDY, f"bad-{kind}")

    async def run():
        return [out async for out in decode.generate(RequestSpec(prompt, GREEDY, f"bad-{kind}", kv_source=kv))]

    outputs = asyncio.run(run())
    assert decode.core.stats.num_remote_fallbacks == fallbacks + 1
    assert tokens(outputs) == tokens(colocated)  # recomputed, never installed wrong
    check_idle(prefill, decode)


def test_layout_mismatch_is_refused_by_the_prefill_side(engines, tokenizer):
    prefill, _ = engines
    prompt = chat_ids(tokenizer, "Hello")
    other = dataclasses.replace(prefill.kv_layout(), dtype="bfloat16")

    async def run():
        async for _ in prefill.prefill(RequestSpec(prompt, GREEDY, "mismatch", 0), (), other):
            pass

    with pytest.raises(KVLayoutError, match="dtype"):
        asyncio.run(run())
    with pytest.raises(ValueError, match="held block hashes"):
        asyncio.run(_collect(prefill.prefill(RequestSpec(prompt * 8, GREEDY, "bad-held", 0), [b"x" * 16], prefill.kv_layout())))


def test_prefill_side_releases_held_blocks_after_the_timeout(engines, tokenizer):
    """The decode side takes the first event and then vanishes without closing the stream."""
    prefill, _ = engines
    prompt = chat_ids(tokenizer, SYSTEM + "Abandoned transfer.")
    old = prefill.transfer_timeout
    prefill.core.kv.hold_seconds = 0.2
    try:
        stream = prefill.prefill(RequestSpec(prompt, GREEDY, "abandoned", 0), (), prefill.kv_layout())
        first = asyncio.run(stream.__anext__())
        assert isinstance(first, PrefillStarted)
        assert prefill.core.scheduler.held  # pinned for the transfer
        for _ in range(100):
            if not prefill.core.scheduler.held:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert not prefill.core.scheduler.held
        assert prefill.core.stats.num_transfer_timeouts >= 1
        with pytest.raises(KVTransferError, match="released"):
            asyncio.run(stream.__anext__())  # the stale blocks are never sent
    finally:
        prefill.core.kv.hold_seconds = old
    check_idle(prefill)


def test_cancellation_at_random_phases_frees_every_block_on_both_sides(engines, tokenizer):
    prefill, decode = engines
    prompts = [chat_ids(tokenizer, SYSTEM * (1 + i % 3) + f"Question {i}?") for i in range(12)]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> None:
        events: list = []
        kv = source(prefill, prompt, long, f"cancel-{i}", events)
        stop_after = i % 4  # 0: before the first token, 1: first token, 2: during decode, 3: mid-transfer
        async with contextlib.aclosing(decode.generate(RequestSpec(prompt, long, f"cancel-{i}", kv_source=kv))) as stream:
            n = 0
            async for _ in stream:
                n += 1
                if stop_after == 3 and any(isinstance(e, KVChunkData) for e in events):
                    break
                if n >= stop_after + 1 and stop_after != 3:
                    break

    async def run() -> None:
        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.05)
        tasks[0].cancel()  # cancelled while queued / prefilling
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], (asyncio.CancelledError, type(None))), results[0]
        errors = [r for r in results[1:] if r is not None]
        assert not errors, errors  # stopping a stream early is not an error

    asyncio.run(run())
    check_idle(prefill, decode)


def test_resume_continues_the_same_greedy_text(engines, tokenizer):
    _, decode = engines
    prompt = chat_ids(tokenizer, "Tell me about the moon.")
    params = SamplingParams(max_tokens=16, temperature=0.0)
    whole = asyncio.run(collect(decode, prompt, params, "whole"))
    all_tokens = tokens(whole)
    delivered = all_tokens[:6]
    sent_text = "".join(out.text for out in whole[:6])[:-2]  # pretend two characters were held back
    resumed = asyncio.run(_collect(decode.generate(RequestSpec(prompt, params, "resumed", resume=Resume(tuple(delivered),
                                                               sent_text)))))
    assert tokens(resumed) == all_tokens[6:]
    assert sent_text + text(resumed) == text(whole)
    assert resumed[-1].num_output_tokens == len(all_tokens)
    check_idle(decode)


async def _collect(stream) -> list:
    return [x async for x in stream]


def test_a_stalled_prefill_replica_times_out_and_the_request_is_computed_here(engines, tokenizer):
    prefill, decode = engines
    prompt = chat_ids(tokenizer, "Stalled transfer.")
    colocated = asyncio.run(collect(prefill, prompt, GREEDY, "stall-colo"))
    good = source(prefill, prompt, GREEDY, "stall")

    def stalled(held, layout):
        async def events():
            async with contextlib.aclosing(good(held, layout)) as stream:
                yield await stream.__anext__()  # the first token, then silence
                await asyncio.sleep(3600)
        return events()

    old, decode.transfer_timeout = decode.transfer_timeout, 0.5
    try:
        outputs = asyncio.run(_collect(decode.generate(RequestSpec(prompt, GREEDY, "stall", kv_source=stalled))))
    finally:
        decode.transfer_timeout = old
    assert tokens(outputs) == tokens(colocated)
    check_idle(prefill, decode)


def test_chunks_stay_under_the_message_limit_and_cover_every_block_once():
    from tokenfleet.engine.kv_transfer import plan_chunks

    layout = KVLayout("m|bfloat16|16", "bfloat16", 16, 30, 3, 64)
    plan = plan_chunks(layout, first_block=5, num_blocks=200, max_chunk_bytes=1 << 20)
    assert all(2 * c.num_blocks * layout.block_bytes <= 1 << 20 for c in plan)
    covered = sorted((c.layer, b) for c in plan for b in range(c.first_block, c.first_block + c.num_blocks))
    assert covered == [(layer, b) for layer in range(30) for b in range(5, 205)]
    assert [c.seq for c in plan] == list(range(len(plan)))


def test_grammar_state_survives_the_hand_off(engines, tokenizer):
    """The prefill side samples the first token under the grammar; the decode side replays it into
    its own matcher and continues: the output is the colocated one and validates."""
    import json

    from tokenfleet.engine.grammar import Guided

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "country": {"enum": ["FR", "IT"]}},
              "required": ["city", "country"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0.0, guided=Guided("json_schema", json.dumps(schema)))
    prefill, decode = engines
    prompt = chat_ids(tokenizer, "Where is the Eiffel Tower? Answer as JSON.")
    colocated = asyncio.run(collect(prefill, prompt, params, "g-colo"))
    before = decode.core.stats.num_prompt_tokens_computed
    outputs = asyncio.run(disaggregated(prefill, decode, prompt, params, "g-disagg"))
    assert decode.core.stats.num_prompt_tokens_computed == before  # the KV came from the prefill side
    assert tokens(outputs) == tokens(colocated)
    value = json.loads(text(outputs))
    assert set(value) == {"city", "country"} and value["country"] in ("FR", "IT")
    check_idle(prefill, decode)
