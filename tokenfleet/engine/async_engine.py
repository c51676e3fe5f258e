"""Async bridge: the synchronous EngineCore runs in its own thread; each request's deltas reach
its caller through one ``asyncio.Queue`` filled with ``loop.call_soon_threadsafe``. No torch
call ever runs on the event loop.

Disaggregation (see tokenfleet.engine.kv_transfer): ``prefill`` runs a prompt to its first
token, keeps the blocks and streams them out; ``generate(kv_source=...)`` reserves blocks,
pulls the first token and KV from a prefill replica, installs them and decodes. Any transfer
failure falls back to computing the prompt here; cancellation at any point frees everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import structlog

from tokenfleet import envs
from tokenfleet.engine.block_hash import hash_blocks
from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.interface import EngineOverloadedError, EngineStoppedError
from tokenfleet.engine.kv_transfer import (
    ChunkSpec,
    KVChunkData,
    KVLayout,
    KVLayoutError,
    KVReceiver,
    KVSource,
    KVTransferError,
    PrefillDone,
    PrefillEvent,
    PrefillStarted,
    plan_chunks,
)
from tokenfleet.engine.output import RequestOutput, Resume
from tokenfleet.engine.request import Priority, RequestStatus
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import QueueFullError
from tokenfleet.engine.stats import EngineStats


@dataclass
class _Add:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    request_id: str
    priority: int
    sink: Callable[[RequestOutput], None]
    done: Future
    resume: Resume | None = None
    hold_kv: bool = False
    tenant: str = ""


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(core)`` on the engine thread; ``abandoned(core, result)`` runs if the caller gave up."""

    fn: Callable[[EngineCore], Any]
    done: Future
    abandoned: Callable[[EngineCore, Any], None] | None = None


_STOP = object()
log = structlog.get_logger()
DEFAULT_TRANSFER_TIMEOUT = 30.0


def _resolve(future: Future, error: Exception | None = None, result: Any = None) -> bool:
    """Complete the caller's future; False if the caller already gave up (cancelled it)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        return False
    return True


class AsyncEngine:
    """``Engine`` implementation over our EngineCore. ``core_factory`` runs on the engine thread."""

    def __init__(self, core_factory: Callable[[], EngineCore], transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT):
        self._core_factory = core_factory
        self.transfer_timeout = transfer_timeout  # both sides: a KV transfer that takes longer is abandoned
        self._kv_blocks_sent = 0
        self._hashes: frozenset[bytes] = frozenset()  # the prefix cache's block hashes, as of the last step
        self._hash_version = -1
        self._check_invariants = envs.check_invariants()
        self._core: EngineCore | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stats = EngineStats()
        self.error: BaseException | None = None  # set when the engine loop died; the engine is unhealthy

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="tokenfleet-engine", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(ready)
        self._accepting = True

    async def drain(self) -> None:
        self._accepting = False
        while self._sinks and self._thread is not None and self._thread.is_alive():
            await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        self._accepting = False
        if self._thread is None:
            return
        for request_id in list(self._sinks):
            self._commands.put(_Abort(request_id))
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._stats, num_kv_blocks_sent=self._kv_blocks_sent)

    def kv_layout(self) -> KVLayout:
        return self.core.kv_layout()

    def cached_block_hashes(self) -> frozenset[bytes]:
        return self._hashes

    def _snapshot(self, core: EngineCore) -> None:
        self._stats = core.snapshot()
        bm = core.scheduler.block_manager
        if bm.hash_version != self._hash_version:
            self._hashes, self._hash_version = frozenset(bm.cached_hashes()), bm.hash_version

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineStoppedError("engine not started")
        return self._core

    # ---- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = Priority.INTERACTIVE,
        resume: Resume | None = None,
        kv_source: KVSource | None = None,
        hold_kv: bool = False,
        tenant: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        """``resume``: continue after output another replica delivered. ``kv_source``: pull the
        prompt's first token and KV from a prefill replica (falls back to local prefill when the
        blocks are not free or the transfer fails). ``hold_kv``: keep the blocks when done (prefill)."""
        if not self._accepting:
            raise EngineStoppedError("engine is not accepting requests (starting, draining or stopped)")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        prompt = list(prompt_token_ids)
        await self._prepare_grammar(sampling_params)
        held = None
        if kv_source is not None and resume is None and sampling_params.n == 1 and sampling_params.prompt_logprobs is None:
            held = await self._call(lambda core: self._add_remote(core, prompt, sampling_params, request_id,
                                                                  int(priority), sink, tenant),
                                    abandoned=lambda core, held: _forget(core.abort(request_id)))
        if held is None:
            done: Future = Future()
            self._commands.put(_Add(prompt, sampling_params, request_id, int(priority), sink, done, resume, hold_kv,
                                    tenant))
            try:
                await asyncio.wrap_future(done)  # re-raises ValueError / EngineOverloadedError
            except asyncio.CancelledError:
                self._commands.put(_Abort(request_id))  # the add may have happened before the cancel
                raise
        finished = False
        running = sampling_params.n  # samples not finished yet
        try:
            if held is not None and kv_source is not None:
                async for out in self._pull(request_id, prompt, held, kv_source, outputs):
                    finished = out.finished
                    yield out
            while not finished:
                out = await outputs.get()
                running -= out.finished
                finished = running == 0
                if out.error is not None:
                    raise RuntimeError(out.error)
                yield out
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def _prepare_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar into the cache on a worker thread, so that adding the
        request on the engine thread is a cheap copy (GrammarError, a ValueError, if it does not compile)."""
        if params.guided is not None:
            await asyncio.to_thread(self.core.guides.prepare, params.guided)

    # ---- disaggregation ------------------------------------------------------------------------
    def _add_remote(self, core: EngineCore, prompt: list[int], params: SamplingParams, request_id: str,
                    priority: int, sink: Callable[[RequestOutput], None], tenant: str = "") -> int | None:
        held = core.kv.add_remote(prompt, params, request_id, priority, tenant)  # ValueError for bad input
        if held is not None:
            self._sinks[request_id] = sink
        return held

    async def _pull(self, request_id: str, prompt: list[int], held: int, kv_source: KVSource,
                    outputs: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Decode side of a transfer: yields the first token's output as soon as it arrives, installs
        the KV, and joins the request to the batch; on any transfer failure computes it here."""
        layout = self.kv_layout()
        hashes = hash_blocks(prompt, layout.block_size, layout.hash_salt)[:held]
        receiver = KVReceiver(layout, -(-len(prompt) // layout.block_size), held)
        deadline = asyncio.get_running_loop().time() + self.transfer_timeout
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
                        if not await self._call(functools.partial(self._first_token, request_id=request_id,
                                                                  event=event)):
                            return  # the request ended meanwhile (aborted): its final output is queued
                        out = await outputs.get()
                        yield out
                        if out.finished:
                            return
                    elif isinstance(event, KVChunkData):
                        spec = receiver.accept(event.seq, event.layer, event.first_block, event.num_blocks,
                                               event.k, event.v)
                        await self._call(functools.partial(_install, request_id=request_id, spec=spec,
                                                           k=event.k, v=event.v))
                    elif isinstance(event, PrefillDone):
                        receiver.finish(event.num_bytes)
                        break
                    else:
                        raise KVTransferError(f"this engine cannot install {type(event).__name__}")
            if not receiver.complete:
                raise KVTransferError("truncated KV stream: ended before its trailer")
            await self._call(lambda core: _if_remote(core, request_id, lambda: core.kv.activate_remote(request_id)))
        except (KVTransferError, TimeoutError) as e:
            reason = str(e) or f"no complete transfer within {self.transfer_timeout:.0f} s"
            log.warning("KV transfer failed; prefilling locally", engine_request_id=request_id, error=reason)
            await self._call(lambda core: _if_remote(core, request_id, lambda: core.kv.fallback_to_local(request_id)))

    def _first_token(self, core: EngineCore, request_id: str, event: PrefillStarted) -> bool:
        if not _is_remote(core, request_id):
            return False
        self._deliver(core.kv.remote_first_token(request_id, event.token_id, event.logprobs))
        return True

    async def prefill(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = Priority.INTERACTIVE,
        held_block_hashes: Sequence[bytes] = (),
        layout: KVLayout | None = None,
    ) -> AsyncGenerator[PrefillEvent, None]:
        """Prefill side: compute the prompt to its first token, then stream the blocks the caller
        does not hold, layer by layer. The blocks stay pinned until this iterator closes (or the
        engine's hold timeout). KVLayoutError when ``layout`` differs from ours, ValueError for
        bad input or held hashes that are not this prompt's."""
        mine = self.kv_layout()
        problem = mine.mismatch(layout) if layout is not None else None
        if problem is not None:
            raise KVLayoutError(problem)
        prompt = list(prompt_token_ids)
        hashes = hash_blocks(prompt, mine.block_size, mine.hash_salt)
        if list(held_block_hashes) != hashes[: len(held_block_hashes)]:
            raise ValueError("held block hashes are not this prompt's leading blocks")
        params = dataclasses.replace(sampling_params, max_tokens=1, min_tokens=min(sampling_params.min_tokens, 1), n=1,
                                     prompt_logprobs=None,
                                     stop=())
        first = None
        try:
            async for out in self.generate(prompt, params, request_id, priority, hold_kv=True):
                first = first or (out if out.new_token_ids else None)
            if first is None:
                raise KVTransferError("the prefill produced no token (aborted)")
            table = await self._call(lambda core: core.kv.held_block_ids(request_id))
            if table is None:
                raise KVTransferError("the prefill's blocks were released before the transfer")
            held, num_prompt_blocks = len(held_block_hashes), -(-len(prompt) // mine.block_size)
            plan = plan_chunks(mine, held, num_prompt_blocks - held)
            yield PrefillStarted(first.new_token_ids[0], first.logprobs[0] if first.logprobs else None,
                                 first.num_cached_tokens, held, num_prompt_blocks - held, len(plan))
            num_bytes = 0
            for spec in plan:
                block_ids = table[spec.first_block : spec.first_block + spec.num_blocks]
                k, v = await asyncio.to_thread(self.core.runner.export_kv, spec.layer, block_ids)
                if self.core.kv.held_block_ids(request_id) is None:  # released while reading: the bytes may be stale
                    raise KVTransferError("the prefill's blocks were released during the transfer (timeout)")
                num_bytes += len(k) + len(v)
                yield KVChunkData(spec.seq, spec.layer, spec.first_block, spec.num_blocks, k, v)
            self._kv_blocks_sent += num_prompt_blocks - held
            yield PrefillDone(num_bytes)
        finally:
            self._commands.put(_Call(lambda core: core.kv.release_held(request_id), Future()))

    async def _call(self, fn: Callable[[EngineCore], Any],
                    abandoned: Callable[[EngineCore, Any], None] | None = None) -> Any:
        done: Future = Future()
        self._commands.put(_Call(fn, done, abandoned))
        return await asyncio.wrap_future(done)

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self, ready: Future) -> None:
        try:
            self._core = self._core_factory()
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            ready.set_exception(e)
            return
        core = self._core
        core.kv.hold_seconds = self.transfer_timeout
        ready.set_result(None)
        while True:
            block = not core.has_unfinished()
            if not self._drain_commands(core, block):
                break
            core.kv.expire_held()
            if core.has_unfinished():
                try:
                    outputs = core.step()
                    if self._check_invariants:
                        core.scheduler.block_manager.check_invariants()
                except Exception as e:  # noqa: BLE001 - fail every stream, never hang them
                    self._fail_all(core, e)
                    return
                for out in outputs:
                    self._deliver(out)
            self._snapshot(core)

    def _fail_all(self, core: EngineCore, error: Exception) -> None:
        self.error = error
        self._accepting = False
        for request_id in list(self._sinks):
            for out in core.abort_group(request_id):
                out.error = f"engine failure: {type(error).__name__}: {error}"
                self._deliver(out)

    def _drain_commands(self, core: EngineCore, block: bool) -> bool:
        """Apply queued commands; wait for one if ``block``. False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block:
                    core.kv.expire_held()
                    self._snapshot(core)
                    continue
                return True
            block = False
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(core, command)
            elif isinstance(command, _Call):
                self._run_call(core, command)
            elif isinstance(command, _Abort):
                for out in core.abort_group(command.request_id):
                    self._deliver(out)

    def _run_call(self, core: EngineCore, command: _Call) -> None:
        try:
            result = command.fn(core)
        except (ValueError, KeyError) as e:
            _resolve(command.done, error=e)
            return
        except QueueFullError as e:
            _resolve(command.done, error=EngineOverloadedError(str(e)))
            return
        if not _resolve(command.done, result=result) and command.abandoned is not None:
            command.abandoned(core, result)

    def _add(self, core: EngineCore, command: _Add) -> None:
        try:
            core.add_request(command.prompt_token_ids, command.sampling_params, command.request_id, command.priority,
                             resume=command.resume, hold_kv=command.hold_kv, tenant=command.tenant)
        except QueueFullError as e:
            _resolve(command.done, error=EngineOverloadedError(str(e)))
        except ValueError as e:
            _resolve(command.done, error=e)
        else:
            if _resolve(command.done):
                for member in core.group(command.request_id):  # n > 1: every sample's output to one sink
                    self._sinks[member] = command.sink
            else:  # the caller was cancelled while waiting for admission
                core.abort(command.request_id)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if out.finished:
            self._sinks.pop(out.request_id, None)
        if sink is not None:
            try:
                sink(out)
            except RuntimeError as e:  # the caller's event loop is gone: nobody will read this request
                log.warning("request's consumer is gone; aborting it", engine_request_id=out.request_id, error=str(e))
                self._sinks.pop(out.request_id, None)
                self._commands.put(_Abort(out.request_id))


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


def _forget(_: object) -> None:
    return None
