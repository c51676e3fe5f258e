"""Async bridge: the synchronous EngineCore runs in its own thread; each request's deltas reach
its caller through one ``asyncio.Queue`` filled with ``loop.call_soon_threadsafe``. No torch
call ever runs on the event loop.

Disaggregation (the KV connector: ``kv_connector.py`` on the engine thread, ``kv_streams.py`` on
the event loop; the wire format in ``kv_transfer.py``): ``prefill`` runs a prompt to its first
token, keeps the blocks and streams them out; ``generate(kv_source=...)`` reserves blocks,
pulls the first token and KV from a prefill replica, installs them and decodes. Any transfer
failure falls back to computing the prompt here; cancellation at any point frees everything.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from tokenfleet import envs
from tokenfleet.engine import kv_streams
from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.interface import AdapterHost, EngineOverloadedError, EngineStoppedError, PeerBlocks
from tokenfleet.engine.kv_transfer import PrefillEvent
from tokenfleet.engine.output import RequestOutput
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import QueueFullError
from tokenfleet.engine.stats import EngineStats
from tokenfleet.kvcache.layout import KVLayout


@dataclass
class _Add:
    request: RequestSpec
    sink: Callable[[RequestOutput], None]
    done: Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(core)`` on the engine thread; ``abandoned(core, result)`` runs if the caller gave up."""

    fn: Callable[[EngineCore], Any]
    done: Future
    abandoned: Callable[[EngineCore, Any], None] | None = None


T = TypeVar("T")
_STOP = object()
log = structlog.get_logger()
DEFAULT_TRANSFER_TIMEOUT = 30.0
HASHES_REFRESH_S = 0.05  # the reported hash sets lag the engine by at most this (plus one idle wait)


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
        # the prefix cache's block hashes (pool and second tier) and those only in the tier, as of the last step
        self._held: tuple[frozenset[bytes], frozenset[bytes]] = (frozenset(), frozenset())
        self._hashes_built = float("-inf")
        self._hashes_cost = 0.0  # seconds the last rebuild of the reported hash sets took
        self._hash_version: tuple[int, int] = (-1, -1)
        self._check_invariants = envs.check_invariants()
        self._core: EngineCore | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._adapter_names: tuple[str, ...] = ()
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stats = EngineStats()
        self.error: BaseException | None = None  # set when the engine loop died; the engine is unhealthy
        # Capabilities (Engine), known once the core is built: this engine itself where its core has the part.
        self.peer_blocks: PeerBlocks | None = None
        self.lora: AdapterHost | None = None

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
        return self._stats

    def kv_layout(self) -> KVLayout:
        return self.core.kv_layout()

    def kernel_checks(self) -> tuple[KernelCheck, ...]:
        return self.core.model.kernel_checks

    async def device_peaks(self) -> tuple[float, float, str] | None:
        costs = self.core.costs  # a known card's figures, else measured now (~0.1 s)
        # on the engine thread: a measurement on an executor thread would leave a second OpenMP pool in the process,
        # which slows every later step (backends.torch.device.in_passing_thread says how)
        return await self.call(lambda core: costs.peaks()) if costs is not None else None

    def cached_block_hashes(self) -> frozenset[bytes]:
        return self._held[0]

    def tier_block_hashes(self) -> frozenset[bytes]:
        return self._held[1]

    def held_block_hashes(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(cached_block_hashes, tier_block_hashes) of one moment."""
        return self._held

    # ---- peer fetch: whole blocks between replicas of one model (engine.kv_tier) ------------------
    async def read_blocks(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Our blocks for a peer: the longest leading run of ``block_hashes`` held here."""
        return await self.call(lambda core: core.read_blocks(block_hashes))

    async def local_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        return await self.call(lambda core: core.local_prefix_blocks(block_hashes))

    async def stage_blocks(self, block_hashes: Sequence[bytes], payloads: Sequence[bytes]) -> None:
        await self.call(lambda core: core.stage_blocks(block_hashes, payloads))

    def count_peer_failure(self) -> None:
        self.post(lambda core: setattr(core.stats, "num_peer_fetch_failures", core.stats.num_peer_fetch_failures + 1))

    async def forget_prefill_rate(self) -> None:
        """EngineStats.forget_prefill_rate on the engine thread; stats() shows it once this returns."""
        def forget(core: EngineCore) -> None:
            core.stats.forget_prefill_rate()
            self._snapshot(core)
        await self.call(forget)

    def _snapshot(self, core: EngineCore, busy: bool = False) -> None:
        self._stats = core.snapshot()
        bm, tier = core.scheduler.block_manager, core.tier
        version = (bm.hash_version, tier.version if tier is not None else 0)
        now = time.monotonic()
        # While busy, rebuilt at most every HASHES_REFRESH_S and at most ~5% of the engine's time: the sets
        # are as large as the pool and the tier (10^5-10^6 hashes on a GPU node: ~40-100 ms to build),
        # evictions change them nearly every step, and routers read them every 200 ms. Idle: at once.
        wait = max(HASHES_REFRESH_S, 20 * self._hashes_cost)
        if version != self._hash_version and (not busy or now - self._hashes_built >= wait):
            held = bm.cached_hash_view()
            hashes = frozenset(itertools.chain(held, tier.hashes()) if tier is not None else held)
            tiered = frozenset(tier.hashes() - held) if tier is not None else frozenset()
            self._held = (hashes, tiered)  # one assignment: the event loop never reads a torn pair
            self._hash_version = version
            self._hashes_built = time.monotonic()
            self._hashes_cost = self._hashes_built - now

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineStoppedError("engine not started")
        return self._core

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request: RequestSpec) -> AsyncGenerator[RequestOutput, None]:
        """``Engine.generate``. A request with ``kv_source`` reserves blocks and pulls the prompt's first token and
        KV from a prefill replica (falling back to a local prefill when the blocks are not free or the transfer
        fails); one with an adapter never does (a prefill replica would compute the base model's KV)."""
        if not self._accepting:
            raise EngineStoppedError("engine is not accepting requests (starting, draining or stopped)")
        if request.request_id is None:
            raise ValueError("a request needs an id here")
        request_id, params = request.request_id, request.sampling_params
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        await self._prepare_grammar(params)
        held = None
        kv_source = request.kv_source if not request.adapter else None
        if kv_source is not None and request.resume is None and params.n == 1 and params.prompt_logprobs is None:
            held = await self.call(lambda core: self._add_remote(core, request, sink),
                                   abandoned=lambda core, held: _forget(core.abort(request_id)))
        if held is None:
            done: Future = Future()
            self._commands.put(_Add(request, sink, done))
            try:
                await asyncio.wrap_future(done)  # re-raises ValueError / EngineOverloadedError
            except asyncio.CancelledError:
                self._commands.put(_Abort(request_id))  # the add may have happened before the cancel
                raise
        finished = False
        running = params.n  # samples not finished yet
        try:
            if held is not None and kv_source is not None:
                async for out in kv_streams.pull(self, request, held, kv_source, outputs):
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

    async def release(self, conversation: str) -> int:
        """``Engine.release``: on the engine thread (``EngineCore.release``)."""
        return await self.call(lambda core: core.release(conversation))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def _prepare_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar into the cache on a worker thread, so that adding the
        request on the engine thread is a cheap copy (GrammarError, a ValueError, if it does not compile)."""
        if params.guided is not None:
            await asyncio.to_thread(self.core.guides.prepare, params.guided)

    # ---- disaggregation ------------------------------------------------------------------------
    def _add_remote(self, core: EngineCore, request: RequestSpec, sink: Callable[[RequestOutput], None]) -> int | None:
        held = core.kv.add_remote(request)  # ValueError: bad input
        if held is not None:
            self._sinks[request.id] = sink
        return held

    def prefill(self, request: RequestSpec, held_block_hashes: Sequence[bytes] = (), layout: KVLayout | None = None
                ) -> AsyncGenerator[PrefillEvent, None]:
        """``Engine.prefill``: ``kv_streams.serve_prefill`` over this engine."""
        return kv_streams.serve_prefill(self, request, held_block_hashes, layout)

    # ---- the engine thread, for the KV streams (kv_streams.EngineLoop) ------------------------
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters loaded on this engine (as of the last load)."""
        return self._adapter_names

    async def load_adapter(self, name: str, path: str) -> tuple[str, ...]:
        """Load a PEFT LoRA adapter on the engine thread, between steps (ValueError: it cannot be served here).
        Returns every adapter loaded now."""
        def load(core: EngineCore) -> tuple[str, ...]:
            runner = core.adapters
            if runner is None:
                raise ValueError("this engine does not serve LoRA adapters")
            try:
                runner.load_adapter(name, path)
            except OSError as e:  # a missing or unreadable folder is the caller's mistake
                raise ValueError(f"cannot read the LoRA adapter at {path!r}: {e}") from e
            return core.adapter_names()

        self._adapter_names = await self.call(load)
        return self._adapter_names

    def post(self, fn: Callable[[EngineCore], object]) -> None:
        """Run ``fn(core)`` on the engine thread; nobody waits for it."""
        self._commands.put(_Call(fn, Future()))

    async def call(self, fn: Callable[[EngineCore], T],
                   abandoned: Callable[[EngineCore, Any], None] | None = None) -> T:
        """Run ``fn(core)`` on the engine thread and return its result here (ValueError, KeyError and
        overload are raised here); ``abandoned(core, result)`` runs there if the caller gave up."""
        done: Future = Future()
        self._commands.put(_Call(fn, done, abandoned))
        try:
            return await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The engine thread may have finished ``fn`` just before the cancel: its result was then dropped on
            # its way here (the wrapper was cancelled first), and the engine thread did not call ``abandoned``
            # (its result was taken). Left alone, e.g., a remote prefill's reserved blocks would never be freed.
            if abandoned is not None and done.done() and not done.cancelled() and done.exception() is None:
                result = done.result()
                self._commands.put(_Call(lambda core: abandoned(core, result), Future(), None))
            raise

    def read_held(self, request_id: str, layer: int, block_ids: Sequence[int]) -> tuple[bytes, bytes]:
        return self.core.kv.export_held(request_id, layer, block_ids)

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self, ready: Future) -> None:
        try:
            self._core = self._core_factory()
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            ready.set_exception(e)
            return
        core = self._core
        core.kv.hold_seconds = self.transfer_timeout
        self._adapter_names = core.adapter_names()
        self.peer_blocks = self if core.staged is not None else None
        self.lora = self if core.adapters is not None else None
        self._snapshot(core)  # a restarted worker's second tier is reported from its first Load report
        ready.set_result(None)
        more = False  # a prefetch batch was full: come back without waiting for work
        while True:
            block = not core.has_unfinished() and not more
            if not self._drain_commands(core, block):
                try:
                    core.close()  # keeps the pool's blocks in a persistent second tier
                except Exception as e:  # noqa: BLE001 - losing a cache must not fail the shutdown
                    log.warning("engine_close_failed", error=repr(e))
                return
            core.kv.expire_held()
            try:
                more = core.tend(time.monotonic())
            except Exception as e:  # noqa: BLE001 - like a step's failure: fail every stream, never hang them
                self._fail_all(core, e)
                return
            if core.has_unfinished():
                try:
                    outputs = core.step()
                    if self._check_invariants:
                        core.scheduler.block_manager.check_invariants()
                except Exception as e:  # noqa: BLE001 - fail every stream, never hang them
                    self._fail_all(core, e)
                    return
                for out in outputs:
                    self.deliver(out)
            self._snapshot(core, busy=core.has_unfinished())

    def _fail_all(self, core: EngineCore, error: Exception) -> None:
        self.error = error
        self._accepting = False
        for request_id in list(self._sinks):
            for out in core.abort_group(request_id):
                out.error = f"engine failure: {type(error).__name__}: {error}"
                self.deliver(out)

    def _drain_commands(self, core: EngineCore, block: bool) -> bool:
        """Apply queued commands; wait for one if ``block``. False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                # idle for a while, or nothing queued: the loop's housekeeping runs (held blocks' deadlines,
                # retention and prefetch, the snapshot), then it waits again
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
                    self.deliver(out)

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
            core.add_request(command.request)
        except QueueFullError as e:
            _resolve(command.done, error=EngineOverloadedError(str(e)))
        except ValueError as e:
            _resolve(command.done, error=e)
        else:
            if _resolve(command.done):
                for member in core.group(command.request.id):  # n > 1: every sample's output to one sink
                    self._sinks[member] = command.sink
            else:  # the caller was cancelled while waiting for admission
                core.abort(command.request.id)

    def deliver(self, out: RequestOutput) -> None:
        """Engine thread: hand ``out`` to its request's consumer (its event loop's queue)."""
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


def _forget(_: object) -> None:
    return None
