"""Disaggregated prefill/decode on one engine: the KV connector of an ``EngineCore``.

Decode side: reserve blocks for a prompt prefilled on another replica (``add_remote``), write the KV
chunks it receives into them (``import_kv``), take the prefill replica's first token, then run the
request like any other (``activate_remote``), or compute the prompt here after all
(``fallback_to_local``). Prefill side: a finished prefill keeps its blocks (``hold``) until the
decode side pulled them (``release_held``) or the transfer ran out of time (``expire_held``).

Everything here runs on the engine thread, like the core's own methods (``export_held`` excepted);
the streaming of chunks between replicas is ``kv_streams``' (event loop) and the worker service's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from tokenfleet.engine.block_manager import NULL_BLOCK
from tokenfleet.engine.kv_transfer import KVTransferError
from tokenfleet.engine.output import RequestOutput, TokenLogprobs
from tokenfleet.engine.request import Request
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.runner import ExecuteResult, ModelInfo, ModelRunner
from tokenfleet.engine.scheduler import Scheduler
from tokenfleet.engine.stats import EngineStats
from tokenfleet.kvcache.layout import KVLayout, layer_groups


class ConnectorCore(Protocol):
    """What the connector uses of its engine core (``EngineCore``): public members only."""

    scheduler: Scheduler
    runner: ModelRunner
    model: ModelInfo
    stats: EngineStats

    def kv_layout(self) -> KVLayout: ...

    def new_request(self, spec: RequestSpec) -> Request: ...

    def track(self, request: Request, resumed_text: str | None = None) -> None: ...

    def offload_evicted(self) -> None: ...

    def output_of(self, request_id: str, result: ExecuteResult, finished: dict[str, Request]) -> RequestOutput: ...


class KVConnector:
    def __init__(self, core: ConnectorCore):
        self.core = core
        self._held_until: dict[str, float] = {}  # prefill side: request id -> when its held blocks go
        self.hold_seconds = 30.0  # how long a finished prefill keeps its blocks for the transfer
        self._groups: list[int] | None = None

    # ---- decode side: a prompt prefilled elsewhere ------------------------------------------
    def add_remote(self, spec: RequestSpec) -> int | None:
        """Reserve blocks for a prompt prefilled elsewhere. Returns the leading prompt blocks
        already cached here (not to be sent), or None when the blocks are not free now."""
        core = self.core
        request = core.new_request(spec)
        held = core.scheduler.add_remote(request)
        core.offload_evicted()  # the transfer is about to write the reserved blocks
        if held is not None:
            core.track(request)
            core.stats.num_remote_prefills += 1
        return held

    def remote_block_ids(self, request_id: str, layer: int = 0) -> list[int]:
        """The reserved table of ``layer``'s KV group."""
        tables = self.core.scheduler.block_manager.block_tables(request_id)
        return tables[self._layer_groups()[layer]] if tables else []

    def _layer_groups(self) -> list[int]:
        if self._groups is None:
            layout = self.core.kv_layout()
            self._groups = layer_groups(layout.layer_windows, layout.num_layers)
        return self._groups

    def remote_first_token(self, request_id: str, token_id: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        """The first token sampled by the prefill replica, as this request's first output."""
        core = self.core
        if not 0 <= token_id < core.model.vocab_size:
            raise ValueError(f"first token {token_id} out of range [0, {core.model.vocab_size})")
        guide = core.scheduler.remote_request(request_id).guide
        if guide is not None and not guide.consume_token(token_id):
            raise ValueError(f"first token {token_id} does not match the request's grammar")
        finished = core.scheduler.append_remote_token(request_id, token_id)
        result = ExecuteResult({request_id: token_id}, {request_id: logprobs} if logprobs is not None else {})
        return core.output_of(request_id, result, {request_id: finished} if finished is not None else {})

    def import_kv(self, request_id: str, layer: int, first_block: int, k: bytes, v: bytes, num_blocks: int) -> None:
        """Write one received chunk into the request's reserved blocks (engine thread only)."""
        core = self.core
        core.scheduler.remote_request(request_id)  # KeyError unless awaiting a remote prefill
        table = self.remote_block_ids(request_id, layer)
        block_ids = table[first_block : first_block + num_blocks]
        if len(block_ids) != num_blocks:
            raise ValueError(f"chunk blocks {first_block}+{num_blocks} outside the {len(table)} reserved")
        if self.core.model.layer_windows and NULL_BLOCK in block_ids:
            raise ValueError(f"chunk blocks {first_block}+{num_blocks} of layer {layer} lie before its window")
        core.runner.import_kv(layer, block_ids, k, v)
        core.stats.num_kv_bytes_received += len(k) + len(v)
        if layer == 0:
            core.stats.num_kv_blocks_received += num_blocks

    def activate_remote(self, request_id: str) -> None:
        self.core.scheduler.activate_remote(request_id, time.monotonic())

    def fallback_to_local(self, request_id: str) -> None:
        core = self.core
        core.scheduler.fallback_to_local(request_id)
        core.stats.num_remote_fallbacks += 1

    # ---- prefill side: a finished prefill's blocks, held for the transfer ---------------------
    def hold(self, request_id: str) -> None:
        """A prefill finished with its blocks held: they wait ``hold_seconds`` for the decode side."""
        self._held_until[request_id] = time.monotonic() + self.hold_seconds

    def held_block_ids(self, request_id: str) -> list[int] | None:
        tables = self.held_block_tables(request_id)
        return tables[0] if tables is not None else None

    def held_block_tables(self, request_id: str) -> list[list[int]] | None:
        """One table per KV group (tokenfleet.kvcache.layout.layer_groups maps layers to them)."""
        scheduler = self.core.scheduler
        return scheduler.block_manager.block_tables(request_id) if request_id in scheduler.held else None

    def export_held(self, request_id: str, layer: int, block_ids: Sequence[int]) -> tuple[bytes, bytes]:
        """K and V of some held blocks of one layer. The one call allowed off the engine thread: held
        blocks are pinned, so no step writes them while they are read; KVTransferError if they were
        released meanwhile (hold timeout), since the bytes read may then be another request's."""
        k, v = self.core.runner.export_kv(layer, list(block_ids))
        if self.held_block_ids(request_id) is None:
            raise KVTransferError("the prefill's blocks were released during the transfer (timeout)")
        return k, v

    def count_sent(self, num_blocks: int) -> None:
        self.core.stats.num_kv_blocks_sent += num_blocks

    def release_held(self, request_id: str) -> bool:
        self._held_until.pop(request_id, None)
        return self.core.scheduler.release_held(request_id)

    def expire_held(self, now: float | None = None) -> list[str]:
        """Release held blocks whose transfer ran out of time (the decode side vanished)."""
        core = self.core
        now = time.monotonic() if now is None else now
        expired = [rid for rid, until in self._held_until.items() if until <= now]
        for request_id in expired:
            self.release_held(request_id)
        core.stats.num_transfer_timeouts += len(expired)
        return expired
