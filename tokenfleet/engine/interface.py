"""The seam a worker service calls. Our engine (``AsyncEngine`` over ``EngineCore``) is one
implementation; a TensorRT-LLM adapter, with its own scheduler and KV cache, is another.
Nothing here assumes our scheduler, block manager or torch.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol, runtime_checkable

from tokenfleet.engine.kv_transfer import PrefillEvent
from tokenfleet.engine.output import RequestOutput
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.engine.stats import EngineStats
from tokenfleet.kvcache.layout import KVLayout


class EngineOverloadedError(RuntimeError):
    """The engine cannot queue more work now (maps to 503 / RESOURCE_EXHAUSTED)."""


class EngineStoppedError(RuntimeError):
    """The engine is draining or stopped and takes no new requests (maps to UNAVAILABLE)."""


class PeerBlocks(Protocol):
    """Whole KV blocks between replicas of one model (peer fetch): an engine whose pool can export and import
    them. Any thread's event loop; the engine does the work on its own thread."""

    async def read_blocks(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Our blocks for a peer: the longest leading run of ``block_hashes`` held here (pool, then second tier)."""
        ...

    async def local_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` held here: what a peer need not send."""
        ...

    async def stage_blocks(self, block_hashes: Sequence[bytes], payloads: Sequence[bytes]) -> None:
        """Blocks a peer sent, restored when the prompt they belong to is admitted (ValueError: another layout)."""

    def count_peer_failure(self) -> None:
        """A fetch from a peer failed (counted in the engine's stats)."""


class AdapterHost(Protocol):
    """An engine that serves LoRA adapters."""

    def adapters(self) -> tuple[str, ...]:
        """The adapters loaded now."""
        ...

    async def load_adapter(self, name: str, path: str) -> tuple[str, ...]:
        """Load a PEFT adapter (ValueError: it cannot be served here); every adapter loaded after it."""
        ...


@runtime_checkable
class Engine(Protocol):
    """Every member a worker service uses. Optional capabilities are attributes set at construction: None where
    the engine lacks them (the TensorRT-LLM adapter has neither peer blocks nor adapters)."""

    error: BaseException | None  # set when the engine failed: it takes no more work and the worker exits
    peer_blocks: PeerBlocks | None
    lora: AdapterHost | None

    async def start(self) -> None:
        """Load and warm up; returns when requests can be served."""

    def generate(self, request: RequestSpec) -> AsyncGenerator[RequestOutput, None]:
        """Stream deltas until one with ``finished``. Closing the iterator early aborts the
        request and frees its resources. Raises ValueError for invalid input (an unknown adapter too),
        EngineOverloadedError when full, EngineStoppedError when draining.

        ``request.resume``: output another replica already delivered (continue after it).
        ``request.kv_source``: take the prompt's first token and KV from a prefill replica.
        ``request.tenant``: who is billed (fair queuing between tenants of one priority).
        ``request.kv_scope``: who may share its cached prefix (tokenfleet.kvcache.salt; "" = everyone)."""
        ...

    def prefill(self, request: RequestSpec, held_block_hashes: Sequence[bytes] = (),
                layout: KVLayout | None = None) -> AsyncGenerator[PrefillEvent, None]:
        """Prefill role: run the prompt to its first token and stream it, then the KV the caller
        lacks (our engine) or one opaque hand-off (a backend with its own transceiver)."""
        ...

    async def device_peaks(self) -> tuple[float, float, str] | None:
        """The device's peak FLOP/s and bytes/s and their source (MFU/MBU's denominators); None: unknown."""
        ...

    def kv_layout(self) -> KVLayout | None:
        """What this engine's KV blocks mean (None: it cannot exchange raw blocks)."""

    def cached_block_hashes(self) -> frozenset[bytes]:
        """Block hashes in the prefix cache now, every tier (routers score replicas with them)."""

    def tier_block_hashes(self) -> frozenset[bytes]:
        """Of those, the ones held only in a slower tier (a hit restores them: routers count them for less)."""
        ...

    def held_block_hashes(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(cached_block_hashes, tier_block_hashes) of one moment."""
        ...

    async def abort(self, request_id: str) -> None:
        """End a request; its stream yields a final output with finish reason ABORT."""

    async def release(self, conversation: str) -> int:
        """End ``conversation``'s retention now (``RequestSpec.retention_s``): its blocks are cached at plain LRU
        priority again. Returns how many blocks it retained (0: unknown, ended, or an engine without retention)."""
        ...

    def stats(self) -> EngineStats:
        """Counters and gauges (running, waiting, KV blocks, prefix hits, step time)."""

    def kernel_checks(self) -> tuple[KernelCheck, ...]:
        """How each compiled kernel did against its reference where it was built, at load (() for an engine whose
        library checks its own kernels)."""

    async def drain(self) -> None:
        """Stop taking new requests and return when in-flight ones have finished."""

    async def shutdown(self) -> None:
        """Abort what is left and release the model."""
