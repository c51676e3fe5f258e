"""The seam a worker service calls. Our engine (``AsyncEngine`` over ``EngineCore``) is one
implementation; a TensorRT-LLM adapter, with its own scheduler and KV cache, is another.
Nothing here assumes our scheduler, block manager or torch.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol, runtime_checkable

from tokenfleet.engine.kv_transfer import KVSource, PrefillEvent
from tokenfleet.engine.output import RequestOutput, Resume
from tokenfleet.engine.request import Priority
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.stats import EngineStats
from tokenfleet.kvcache.layout import KVLayout


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
        resume: Resume | None = None,
        kv_source: KVSource | None = None,
        tenant: str = "",
        cache_scope: str = "",
        adapter: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream deltas until one with ``finished``. Closing the iterator early aborts the
        request and frees its resources. Raises ValueError for invalid input,
        EngineOverloadedError when full, EngineStoppedError when draining.

        ``resume``: output another replica already delivered (continue after it).
        ``kv_source``: take the prompt's first token and KV from a prefill replica.
        ``tenant``: who is billed (fair queuing between tenants of one priority).
        ``cache_scope``: who may share its cached prefix (tokenfleet.kvcache.salt; "" = everyone).
        ``adapter``: a LoRA adapter loaded on this engine ("" = the base model); ValueError if unknown."""

    def prefill(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = Priority.INTERACTIVE,
        held_block_hashes: Sequence[bytes] = (),
        layout: KVLayout | None = None,
        cache_scope: str = "",
    ) -> AsyncGenerator[PrefillEvent, None]:
        """Prefill role: run the prompt to its first token and stream it, then the KV the caller
        lacks (our engine) or one opaque hand-off (a backend with its own transceiver)."""

    def kv_layout(self) -> KVLayout | None:
        """What this engine's KV blocks mean (None: it cannot exchange raw blocks)."""

    def cached_block_hashes(self) -> frozenset[bytes]:
        """Block hashes in the prefix cache now, every tier (routers score replicas with them)."""

    def tier_block_hashes(self) -> frozenset[bytes]:
        """Of those, the ones held only in a slower tier (a hit restores them: routers count them for less)."""

    async def abort(self, request_id: str) -> None:
        """End a request; its stream yields a final output with finish reason ABORT."""

    def stats(self) -> EngineStats:
        """Counters and gauges (running, waiting, KV blocks, prefix hits, step time)."""

    def kernel_checks(self) -> tuple[KernelCheck, ...]:
        """How each compiled kernel did against its reference where it was built, at load (() for an engine whose
        library checks its own kernels)."""

    async def drain(self) -> None:
        """Stop taking new requests and return when in-flight ones have finished."""

    async def shutdown(self) -> None:
        """Abort what is left and release the model."""
