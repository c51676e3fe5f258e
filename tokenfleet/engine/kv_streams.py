"""The async half of the KV connector (``kv_connector.py`` is the engine-thread half): the decode
side's pull of a prompt's first token and KV from a prefill replica (``pull``), and the prefill
side's stream of a prompt's blocks to a decode replica (``serve_prefill``). Both drive the engine
thread through an ``EngineLoop`` (``AsyncEngine`` is one; ``AsyncEngine.generate`` and
``AsyncEngine.prefill`` call them); any transfer failure on the decode side falls back to computing
the prompt there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

import structlog

from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.kv_transfer import (
    ChunkSpec,
    KVChunkData,
    KVLayoutError,
    KVReceiver,
    KVSource,
    KVTransferError,
    PrefillDone,
    PrefillEvent,
    PrefillStarted,
    plan_chunks,
)
from tokenfleet.engine.output import RequestOutput
from tokenfleet.engine.request import RequestStatus
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.layout import KVLayout, layer_groups
from tokenfleet.kvcache.salt import chain_salt

T = TypeVar("T")


class EngineLoop(Protocol):
    """All the KV streams use of an engine running on its own thread, seen from the event loop."""

    transfer_timeout: float  # seconds a whole transfer may take, on either side

    def kv_layout(self) -> KVLayout: ...

    def generate(self, request: RequestSpec) -> AsyncIterator[RequestOutput]: ...

    async def call(self, fn: Callable[[EngineCore], T],
                   abandoned: Callable[[EngineCore, Any], None] | None = None) -> T:
        """``fn(core)`` on the engine thread; its result (or ValueError/KeyError) comes back here."""
        ...

    def post(self, fn: Callable[[EngineCore], object]) -> None:
        """``fn(core)`` on the engine thread; nobody waits for it."""

    def deliver(self, out: RequestOutput) -> None:
        """Engine thread only: hand ``out`` to its request's consumer, as a step's outputs are."""

    def read_held(self, request_id: str, layer: int, block_ids: Sequence[int]) -> tuple[bytes, bytes]:
        """Any thread: K and V of a finished prefill's held blocks (``KVConnector.export_held``)."""
        ...


log = structlog.get_logger()


async def pull(engine: EngineLoop, request: RequestSpec, held: int, kv_source: KVSource,
               outputs: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Decode side of a transfer: yields the first token's output as soon as it arrives, installs
    the KV, and joins the request to the batch; on any transfer failure computes it here."""
    layout = engine.kv_layout()
    request_id, prompt = request.id, list(request.prompt_token_ids)
    hashes = hash_blocks(prompt, layout.block_size, chain_salt(layout.hash_salt, request.kv_scope))[:held]
    receiver = KVReceiver(layout, -(-len(prompt) // layout.block_size), held, len(prompt))
    deadline = asyncio.get_running_loop().time() + engine.transfer_timeout
    try:
        async with contextlib.aclosing(kv_source(hashes, layout)) as events:
            while True:  # a deadline per read, never across a yield (it would cancel our consumer)
                left = deadline - asyncio.get_running_loop().time()
                try:
                    event = await asyncio.wait_for(anext(events), timeout=max(left, 0.001))
                except StopAsyncIteration:
                    break
                if isinstance(event, PrefillStarted):
                    receiver.start(event.first_block, event.num_blocks, event.num_chunks)
                    if not await engine.call(functools.partial(_first_token, engine, request_id=request_id,
                                                              event=event)):
                        return  # the request ended meanwhile (aborted): its final output is queued
                    out = await outputs.get()
                    yield out
                    if out.finished:
                        return
                elif isinstance(event, KVChunkData):
                    spec = receiver.accept(event.seq, event.layer, event.first_block, event.num_blocks,
                                           event.k, event.v)
                    await engine.call(functools.partial(_install, request_id=request_id, spec=spec,
                                                       k=event.k, v=event.v))
                elif isinstance(event, PrefillDone):
                    receiver.finish(event.num_bytes)
                    break
                else:
                    raise KVTransferError(f"this engine cannot install {type(event).__name__}")
        if not receiver.complete:
            raise KVTransferError("truncated KV stream: ended before its trailer")
        await engine.call(lambda core: _if_remote(core, request_id, lambda: core.kv.activate_remote(request_id)))
    except (KVTransferError, TimeoutError) as e:
        reason = str(e) or f"no complete transfer within {engine.transfer_timeout:.0f} s"
        log.warning("KV transfer failed; prefilling locally", engine_request_id=request_id, error=reason)
        await engine.call(lambda core: _if_remote(core, request_id, lambda: core.kv.fallback_to_local(request_id)))

def _first_token(engine: EngineLoop, core: EngineCore, request_id: str, event: PrefillStarted) -> bool:
    if not _is_remote(core, request_id):
        return False
    engine.deliver(core.kv.remote_first_token(request_id, event.token_id, event.logprobs))
    return True


async def serve_prefill(engine: EngineLoop, request: RequestSpec, held_block_hashes: Sequence[bytes] = (),
                        layout: KVLayout | None = None) -> AsyncGenerator[PrefillEvent, None]:
    """Prefill side: compute the prompt to its first token, then stream the blocks the caller
    does not hold, layer by layer. The blocks stay pinned until this iterator closes (or the
    engine's hold timeout). KVLayoutError when ``layout`` differs from ours, ValueError for
    bad input or held hashes that are not this prompt's."""
    mine = engine.kv_layout()
    problem = mine.mismatch(layout) if layout is not None else None
    if problem is not None:
        raise KVLayoutError(problem)
    prompt, request_id, sampling_params = list(request.prompt_token_ids), request.id, request.sampling_params
    hashes = hash_blocks(prompt, mine.block_size, chain_salt(mine.hash_salt, request.kv_scope))
    if list(held_block_hashes) != hashes[: len(held_block_hashes)]:
        raise ValueError("held block hashes are not this prompt's leading blocks")
    params = dataclasses.replace(sampling_params, max_tokens=1, min_tokens=min(sampling_params.min_tokens, 1), n=1,
                                 prompt_logprobs=None,
                                 stop=())
    # the prompt's first token only, its blocks held for the transfer (the rest of the request is the decode side's)
    first_token = dataclasses.replace(request, sampling_params=params, hold_kv=True, resume=None, kv_source=None)
    first = None
    try:
        async for out in engine.generate(first_token):
            first = first or (out if out.new_token_ids else None)
        if first is None:
            raise KVTransferError("the prefill produced no token (aborted)")
        tables = await engine.call(lambda core: core.kv.held_block_tables(request_id))
        if tables is None:
            raise KVTransferError("the prefill's blocks were released before the transfer")
        held, num_prompt_blocks = len(held_block_hashes), -(-len(prompt) // mine.block_size)
        plan = plan_chunks(mine, held, num_prompt_blocks - held, num_tokens=len(prompt))
        group_of = layer_groups(mine.layer_windows, mine.num_layers)
        yield PrefillStarted(first.new_token_ids[0], first.logprobs[0] if first.logprobs else None,
                             first.num_cached_tokens, held, num_prompt_blocks - held, len(plan))
        num_bytes = 0
        for spec in plan:
            block_ids = tables[group_of[spec.layer]][spec.first_block : spec.first_block + spec.num_blocks]
            k, v = await asyncio.to_thread(engine.read_held, request_id, spec.layer, block_ids)
            num_bytes += len(k) + len(v)
            yield KVChunkData(spec.seq, spec.layer, spec.first_block, spec.num_blocks, k, v)
        engine.post(lambda core: core.kv.count_sent(num_prompt_blocks - held))
        yield PrefillDone(num_bytes)
    finally:
        engine.post(lambda core: core.kv.release_held(request_id))


def _is_remote(core: EngineCore, request_id: str) -> bool:
    request = core.scheduler.requests.get(request_id)
    return request is not None and request.status is RequestStatus.REMOTE_PREFILL


def _if_remote(core: EngineCore, request_id: str, fn: Callable[[], None]) -> bool:
    """Run ``fn`` if the request still awaits its KV (an abort may have ended it meanwhile)."""
    if not _is_remote(core, request_id):
        return False
    fn()
    return True


def _install(core: EngineCore, request_id: str, spec: ChunkSpec, k: bytes, v: bytes) -> bool:
    return _if_remote(core, request_id, lambda: core.kv.import_kv(request_id, spec.layer, spec.first_block, k, v,
                                                                spec.num_blocks))
