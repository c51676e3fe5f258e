"""The seam a worker service calls. Our engine (``AsyncEngine`` over ``EngineCore``) is one
implementation; a TensorRT-LLM adapter, with its own scheduler and KV cache, is another.
Nothing here assumes our scheduler, block manager or torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from tokenfleet.engine.output import RequestOutput
from tokenfleet.engine.request import Priority
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.stats import EngineStats


class EngineOverloadedError(RuntimeError):
    """The engine cannot queue more work now (maps to 503 / RESOURCE_EXHAUSTED)."""


class EngineStoppedError(RuntimeError):
    """The engine is draining or stopped and takes no new requests (maps to UNAVAILABLE)."""


@runtime_checkable
class Engine(Protocol):
    async def start(self) -> None:
        """Load and warm up; returns when requests can be served."""

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = Priority.INTERACTIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas until one with ``finished``. Closing the iterator early aborts the
        request and frees its resources. Raises ValueError for invalid input,
        EngineOverloadedError when full, EngineStoppedError when draining."""

    async def abort(self, request_id: str) -> None:
        """End a request; its stream yields a final output with finish reason ABORT."""

    def stats(self) -> EngineStats:
        """Counters and gauges (running, waiting, KV blocks, prefix hits, step time)."""

    async def drain(self) -> None:
        """Stop taking new requests and return when in-flight ones have finished."""

    async def shutdown(self) -> None:
        """Abort what is left and release the model."""
