"""Async bridge: the synchronous EngineCore runs in its own thread; each request's deltas reach
its caller through one ``asyncio.Queue`` filled with ``loop.call_soon_threadsafe``. No torch
call ever runs on the event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.interface import EngineOverloadedError, EngineStoppedError
from tokenfleet.engine.output import RequestOutput
from tokenfleet.engine.request import Priority
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


@dataclass
class _Abort:
    request_id: str


_STOP = object()


def _resolve(future: Future, error: Exception | None = None) -> bool:
    """Complete the caller's admission future; False if the caller already gave up (cancelled it)."""
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except InvalidStateError:
        return False
    return True


class AsyncEngine:
    """``Engine`` implementation over our EngineCore. ``core_factory`` runs on the engine thread."""

    def __init__(self, core_factory: Callable[[], EngineCore]):
        self._core_factory = core_factory
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
        return self._stats

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
    ) -> AsyncIterator[RequestOutput]:
        if not self._accepting:
            raise EngineStoppedError("engine is not accepting requests (starting, draining or stopped)")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        done: Future = Future()
        self._commands.put(_Add(list(prompt_token_ids), sampling_params, request_id, int(priority), sink, done))
        try:
            await asyncio.wrap_future(done)  # re-raises ValueError / EngineOverloadedError
        except asyncio.CancelledError:
            self._commands.put(_Abort(request_id))  # the add may have happened before the cancel
            raise
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                if out.error is not None:
                    raise RuntimeError(out.error)
                yield out
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self, ready: Future) -> None:
        try:
            self._core = self._core_factory()
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            ready.set_exception(e)
            return
        ready.set_result(None)
        core = self._core
        while True:
            block = not core.has_unfinished()
            if not self._drain_commands(core, block):
                break
            if core.has_unfinished():
                try:
                    outputs = core.step()
                except Exception as e:  # noqa: BLE001 - fail every stream, never hang them
                    self._fail_all(core, e)
                    return
                for out in outputs:
                    self._deliver(out)
            self._stats = core.snapshot()

    def _fail_all(self, core: EngineCore, error: Exception) -> None:
        self.error = error
        self._accepting = False
        for request_id in list(self._sinks):
            out = core.abort(request_id)
            if out is not None:
                out.error = f"engine failure: {type(error).__name__}: {error}"
                self._deliver(out)

    def _drain_commands(self, core: EngineCore, block: bool) -> bool:
        """Apply queued commands; wait for one if ``block``. False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block:
                    self._stats = core.snapshot()
                    continue
                return True
            block = False
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(core, command)
            elif isinstance(command, _Abort):
                out = core.abort(command.request_id)
                if out is not None:
                    self._deliver(out)

    def _add(self, core: EngineCore, command: _Add) -> None:
        try:
            core.add_request(command.prompt_token_ids, command.sampling_params, command.request_id, command.priority)
        except QueueFullError as e:
            _resolve(command.done, error=EngineOverloadedError(str(e)))
        except ValueError as e:
            _resolve(command.done, error=e)
        else:
            if _resolve(command.done):
                self._sinks[command.request_id] = command.sink
            else:  # the caller was cancelled while waiting for admission
                core.abort(command.request_id)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if out.finished:
            self._sinks.pop(out.request_id, None)
        if sink is not None:
            sink(out)
