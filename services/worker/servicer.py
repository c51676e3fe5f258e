"""The engine worker servicer: Generate / Prefill / Abort / Release / Load / Drain over any ``Engine``.

Shared by the decode and prefill services (role decides what placement sends it). A Generate
that names a prefill replica pulls the prompt's first token and KV from that replica's
Prefill stream (``RemotePrefill``), if that replica is one the fleet registered (``sources``;
PERMISSION_DENIED otherwise); any failure during the transfer falls back to prefilling here.
A Generate that names a prefix source (a peer replica of the same model holding more of the
prompt's leading blocks, e.g. after a spill or a restart) first pulls the blocks this worker
lacks from that peer's FetchBlocks stream, then computes the rest; a peer that fails or is slower
than ``PEER_FETCH_TIMEOUT_S`` costs nothing but the recompute.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
from tokenfleet.services.common import convert
from tokenfleet.services.common.errors import map_errors
from tokenfleet.services.common.heartbeats import with_heartbeats
from tokenfleet.services.worker.sources import PrefillSources

from tokenfleet.engine.interface import Engine, EngineOverloadedError, EngineStoppedError
from tokenfleet.engine.kv_transfer import MAX_CHUNK_BYTES, KVLayoutError, KVTransferError, PrefillEvent
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.layout import KVLayout
from tokenfleet.kvcache.salt import chain_salt
from tokenfleet.security.plane import Channels, Plane
from tokenfleet.telemetry import tracing
from tokenfleet.telemetry.latency import RecentLatencies
from tokenfleet.telemetry.request_id import from_metadata
from tokenfleet.telemetry.request_id import metadata as request_id_metadata
from tokenfleet.telemetry.tracing import Trace
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

log = structlog.get_logger()
ALIVE = engine_pb2.GenerateResponse(alive=engine_pb2.Alive())
DEFAULT_LOAD_INTERVAL_MS = 500
PEER_FETCH_TIMEOUT_S = 5.0
PEER_FETCH_BATCH = 16  # blocks read per engine-thread call while serving a peer


Hook = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


class EngineWorker(engine_pb2_grpc.EngineServiceServicer):
    """``on_draining`` runs when a drain begins (mark the replica draining in etcd);
    ``on_drained`` when a Drain RPC has finished every stream (the process then exits)."""

    def __init__(self, engine: Engine, role: str, plane: Plane, sources: PrefillSources,
                 on_draining: Hook = _nothing, on_drained: Hook = _nothing):
        self.engine = engine
        self.sources = sources
        self.role = role
        self.peaks = (0.0, 0.0)  # the device's peak FLOP/s and bytes/s (telemetry.utilization), set at start
        self.on_draining = on_draining
        self.on_drained = on_drained
        self.draining = False
        self.reports_closed = False  # set at shutdown: Load streams end, so the server stops without waiting
        self.last_fetch = time.monotonic()  # when a peer last fetched blocks (the drain's handoff waits on it)
        self.fetching = 0
        self.in_flight: set[str] = set()
        self.latencies = RecentLatencies()
        self.num_early_rejections = 0
        self.fail_fraction = 0.0  # chaos testing (--fail-fraction): this share of Generate calls fails
        self.channels = Channels(plane, KV_CHANNEL_OPTIONS)  # prefill replicas this worker pulls KV from
        # A registered adapter's PEFT folder by its ref (main wires the registry in): requests that name a registry
        # adapter this worker has not loaded load it first (once, however many arrive together).
        self.adapter_source: Callable[[str], Awaitable[str]] | None = None
        self._adapter_loads: dict[str, asyncio.Task] = {}

    async def close(self) -> None:
        await self.channels.close()

    def _check_objective(self, request: engine_pb2.GenerateRequest) -> None:
        """Early rejection: say no now when the request would wait past its TTFT objective."""
        if not request.ttft_objective_ms or request.HasField("prefill"):
            return
        wait = self.engine.stats().predicted_wait(len(request.prompt_token_ids))
        if wait * 1000 > request.ttft_objective_ms:
            self.num_early_rejections += 1
            raise EngineOverloadedError(f"predicted wait {wait:.1f} s for the first token exceeds the objective "
                                        f"{request.ttft_objective_ms / 1000:.1f} s")

    def _admit(self, request_id: str) -> str:
        """A stream's request id (the caller's or a new one), now counted in flight until it ends."""
        if self.draining:
            raise EngineStoppedError("worker is draining")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.in_flight:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self.in_flight.add(request_id)
        return request_id

    @map_errors
    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        # bad input: INVALID_ARGUMENT before anything else
        spec = convert.request_from_proto(request, request.request_id,
                                          client_request_id=from_metadata(context.invocation_metadata()) or "")
        if self.fail_fraction and random.random() < self.fail_fraction:
            raise RuntimeError("injected failure (--fail-fraction: a chaos test of rollouts and retries)")
        self._check_objective(request)
        span = tracing.current()  # this call's server span (map_errors), when the request is traced
        kv_source = None
        if request.HasField("prefill") and request.prefill.address and not request.adapter:
            await self.sources.check(request.prefill.replica_id, request.prefill.address)
            kv_source = RemotePrefill(self.channels.get(request.prefill.address, "worker"), request, context, span)
        request_id = self._admit(request.request_id)
        spec = dataclasses.replace(spec, request_id=request_id, kv_source=kv_source)
        start, first, last, count = time.monotonic(), None, None, 0
        final: Any = None
        outputs: AsyncIterator[Any] = self._outputs(request, spec)
        if request.heartbeat_ms:
            outputs = with_heartbeats(outputs, request.heartbeat_ms / 1000)
        try:
            if request.heartbeat_ms:
                yield ALIVE  # accepted: from here on the caller may hold this stream to its heartbeats
            # aclosing: a cancelled call closes the engine stream now, which aborts the request.
            async with contextlib.aclosing(outputs) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    if out is None:  # silent for heartbeat_ms
                        yield ALIVE
                        continue
                    if out.new_token_ids:
                        last = time.monotonic()
                        if first is None:
                            span.add_event("first_token")
                        first = first or last
                        count += len(out.new_token_ids)
                    final = out if out.finished else final
                    for message in convert.responses(out):
                        yield message
        finally:
            self.in_flight.discard(request_id)
            self.latencies.record(start, first, last, count)
            trace_generate(span, self.role, request, final, first - start if first else None)
            log.info("generate finished", **spec.log_fields(), completion_tokens=count,
                     ttft_ms=round(1000 * (first - start), 1) if first else None,
                     duration_ms=round(1000 * (time.monotonic() - start), 1))

    async def _outputs(self, request: engine_pb2.GenerateRequest, spec: RequestSpec) -> AsyncGenerator[Any, None]:
        """The engine's outputs for a Generate, after what must come first (the adapter, a peer's blocks)."""
        await self._ensure_adapter(spec.adapter)
        if spec.kv_source is None and not spec.adapter and request.HasField("prefix_source") \
                and request.prefix_source.address:
            await self._fetch_from_peer(request, spec.id)
        stream = self.engine.generate(spec)
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                yield out

    @map_errors
    async def Prefill(
        self, request: engine_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.PrefillResponse]:
        # bad input: INVALID_ARGUMENT before anything else
        spec = convert.request_from_proto(request, request.request_id,
                                          client_request_id=from_metadata(context.invocation_metadata()) or "")
        layout = convert.layout_from_proto(request.layout) if request.HasField("layout") else None
        request_id = self._admit(request.request_id)
        span = tracing.current()
        span.set_attribute("tokenfleet.prompt_tokens", len(request.prompt_token_ids))
        span.set_attribute("tokenfleet.held_blocks", len(request.held_block_hashes))
        try:
            if request.HasField("prefix_source") and request.prefix_source.address:
                await self._fetch_from_peer(request, request_id)  # e.g. the replies the decode replica generated
            stream = self.engine.prefill(dataclasses.replace(spec, request_id=request_id),
                                         list(request.held_block_hashes), layout)
            # A cancelled call (the decode side went away) closes the stream: the held blocks are freed.
            async with contextlib.aclosing(stream) as events:
                sent = 0
                async for event in events:
                    message = convert.prefill_response(event)
                    if sent == 0:
                        span.add_event("prefill_computed")  # the first message: the first token, KV follows
                    sent += 1
                    yield message
                span.set_attribute("tokenfleet.kv_messages_sent", sent)
        finally:
            self.in_flight.discard(request_id)

    async def _fetch_from_peer(self, request: engine_pb2.GenerateRequest | engine_pb2.PrefillRequest,
                               request_id: str) -> None:
        """Stage the prompt's leading blocks a registered peer holds and this worker does not. Never raises:
        whatever is not fetched is computed here."""
        source, layout, peers = request.prefix_source, self.engine.kv_layout(), self.engine.peer_blocks
        if layout is None or peers is None:
            return
        try:
            await self.sources.check_peer(source.replica_id, source.address)
            prompt = list(request.prompt_token_ids)
            scope = convert.cache_scope(request.cache_scope)
            hashes = hash_blocks(prompt, layout.block_size, chain_salt(layout.hash_salt, scope))
            wanted = hashes[: min(source.num_blocks, (len(prompt) - 1) // layout.block_size)]
            held = await peers.local_prefix_blocks(wanted)
            if held >= len(wanted):
                return
            stub = engine_pb2_grpc.EngineServiceStub(self.channels.get(source.address, "worker"))
            call = stub.FetchBlocks(engine_pb2.FetchBlocksRequest(block_hashes=wanted[held:], request_id=request_id,
                                                                  layout=convert.layout_to_proto(layout)),
                                    timeout=PEER_FETCH_TIMEOUT_S)
            got, payloads = [], []
            async for block in call:
                got.append(block.block_hash)
                payloads.append(block.data)
            if got != wanted[held: held + len(got)]:
                raise KVTransferError("the peer sent blocks out of order")
            await peers.stage_blocks(got, payloads)
            log.info("prefix fetched from peer", engine_request_id=request_id, peer=source.replica_id, blocks=len(got),
                     held_here=held)
        except (grpc.aio.AioRpcError, KVTransferError, PermissionError, ValueError) as e:
            peers.count_peer_failure()
            log.warning("peer fetch failed; computing the prefix here", engine_request_id=request_id,
                        peer=source.replica_id, error=str(e)[:300])

    @map_errors
    async def FetchBlocks(self, request: engine_pb2.FetchBlocksRequest, context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[engine_pb2.FetchBlocksResponse]:
        mine, peers = self.engine.kv_layout(), self.engine.peer_blocks
        if mine is None or peers is None:
            raise KVLayoutError("this worker cannot send whole KV blocks")
        problem = mine.mismatch(convert.layout_from_proto(request.layout))
        if problem is not None:
            raise KVLayoutError(problem)
        hashes = list(request.block_hashes)
        self.fetching += 1
        try:
            for i in range(0, len(hashes), PEER_FETCH_BATCH):
                batch = hashes[i: i + PEER_FETCH_BATCH]
                payloads = await peers.read_blocks(batch)
                for block_hash, data in zip(batch, payloads):
                    yield engine_pb2.FetchBlocksResponse(block_hash=block_hash, data=data)
                if len(payloads) < len(batch):
                    return
        finally:
            self.fetching -= 1
            self.last_fetch = time.monotonic()

    @map_errors
    async def Abort(self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        await self.engine.abort(request.request_id)
        return engine_pb2.AbortResponse()

    @map_errors
    async def Release(self, request: engine_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.ReleaseResponse:
        if not request.conversation:
            raise ValueError("Release needs the conversation whose retained blocks to release")
        return engine_pb2.ReleaseResponse(blocks=await self.engine.release(request.conversation))

    @map_errors
    async def LoadAdapter(self, request: engine_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
                          ) -> engine_pb2.LoadAdapterResponse:
        if not request.name or not request.path:
            raise ValueError("LoadAdapter needs the adapter's name and its PEFT folder's path")
        return engine_pb2.LoadAdapterResponse(adapters=await self._load_adapter(request.name, request.path))

    async def _load_adapter(self, name: str, path: str) -> tuple[str, ...]:
        if self.engine.lora is None:
            raise ValueError("this worker's engine does not serve LoRA adapters")
        names = await self.engine.lora.load_adapter(name, path)
        log.info("adapter loaded", adapter=name, path=path)
        return names

    def adapters(self) -> tuple[str, ...]:
        return self.engine.lora.adapters() if self.engine.lora is not None else ()

    async def _ensure_adapter(self, name: str) -> None:
        """A registered adapter (``name@version``) this worker lacks is loaded from the registry first."""
        if not name or "@" not in name or self.adapter_source is None or name in self.adapters():
            return  # a plain name must have been loaded (--lora, LoadAdapter): the engine refuses it otherwise
        task = self._adapter_loads.get(name)
        if task is None:
            source = self.adapter_source
            task = self._adapter_loads[name] = asyncio.ensure_future(self._load_registered(name, source))
            task.add_done_callback(lambda _: self._adapter_loads.pop(name, None))
        await asyncio.shield(task)

    async def _load_registered(self, name: str, source: Callable[[str], Awaitable[str]]) -> None:
        await self._load_adapter(name, await source(name))

    @map_errors
    async def Load(
        self, request: engine_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.LoadReport]:
        interval = (request.interval_ms or DEFAULT_LOAD_INTERVAL_MS) / 1000
        sent: frozenset[bytes] | None = None
        sent_tiered: frozenset[bytes] | None = None
        while not self.reports_closed:
            report = self.report()
            hashes, tiered = self.engine.held_block_hashes()  # one moment's pair
            if sent is None or sent_tiered is None:
                report.hashes_reset = True
                report.added_block_hashes.extend(hashes)
                report.added_tier_block_hashes.extend(tiered)
            else:
                if hashes is not sent:
                    report.added_block_hashes.extend(hashes - sent)
                    report.removed_block_hashes.extend(sent - hashes)
                if tiered is not sent_tiered:
                    report.added_tier_block_hashes.extend(tiered - sent_tiered)
                    report.removed_tier_block_hashes.extend(sent_tiered - tiered)
            sent, sent_tiered = hashes, tiered
            yield report
            await asyncio.sleep(interval)

    @map_errors
    async def Drain(self, request: engine_pb2.DrainRequest, context: grpc.aio.ServicerContext) -> engine_pb2.DrainResponse:
        num = await self.drain()
        await self.on_drained()
        return engine_pb2.DrainResponse(num_drained=num)

    async def drain(self) -> int:
        """Refuse new requests and wait for open streams to finish. Returns how many were open."""
        if not self.draining:
            self.draining = True
            await self.on_draining()
        num = len(self.in_flight)
        log.info("drain started", in_flight=num)
        await self.engine.drain()
        while self.in_flight:
            await asyncio.sleep(0.02)
        return num

    async def hand_off(self, idle_seconds: float, deadline: float) -> None:
        """After a drain: keep sending blocks to peers (routers now place this replica's conversations
        elsewhere and name it as their prefix source) until no peer has fetched for ``idle_seconds`` or
        ``deadline`` (monotonic) passes, so a drained replica's cache moves instead of being recomputed."""
        self.last_fetch = max(self.last_fetch, time.monotonic())
        while time.monotonic() < deadline and (self.fetching or time.monotonic() - self.last_fetch < idle_seconds):
            await asyncio.sleep(0.05)

    def report(self) -> engine_pb2.LoadReport:
        stats = self.engine.stats()
        layout = self.engine.kv_layout()
        state = engine_pb2.WORKER_STATE_DRAINING if self.draining else engine_pb2.WORKER_STATE_SERVING
        return engine_pb2.LoadReport(
            state=state,
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_blocks_used=stats.num_blocks_used,
            num_blocks_free=stats.num_blocks_free,
            num_in_flight=len(self.in_flight),
            num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
            num_preemptions=stats.num_preemptions,
            num_aborted=stats.num_aborted,
            num_steps=stats.num_steps,
            ttft_ms_recent=self.latencies.ttft_ms,
            tpot_ms_recent=self.latencies.tpot_ms,
            step_ms_mean=1000 * stats.mean_step_seconds,
            layout=convert.layout_to_proto(layout) if layout is not None else None,
            adapters=self.adapters(),
            num_prompt_tokens_computed=stats.num_prompt_tokens_computed,
            num_kv_blocks_sent=stats.num_kv_blocks_sent,
            num_kv_blocks_received=stats.num_kv_blocks_received,
            num_remote_prefills=stats.num_remote_prefills,
            num_kv_bytes_received=stats.num_kv_bytes_received,
            num_forks=stats.num_forks,
            num_fork_shared_blocks=stats.num_fork_shared_blocks,
            num_block_copies=stats.num_block_copies,
            num_queued_prompt_tokens=stats.num_queued_prompt_tokens,
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            num_tier_hit_blocks=stats.tier_hit_blocks,
            num_tier_stored_blocks=stats.tier_stored_blocks,
            num_tier_dropped_blocks=stats.tier_dropped_blocks,
            num_tier_corrupt_blocks=stats.tier_corrupt_blocks,
            tier_bytes_used=stats.tier_bytes_used,
            tier_bytes_written=stats.tier_bytes_written,
            tier_bytes_read=stats.tier_bytes_read,
            tier_restore_seconds=stats.tier_restore_seconds,
            num_peer_blocks_received=stats.num_peer_blocks_received,
            num_peer_blocks_served=stats.num_peer_blocks_served,
            num_peer_fetch_failures=stats.num_peer_fetch_failures,
            num_spec_proposed_tokens=stats.num_spec_proposed_tokens,
            num_spec_accepted_tokens=stats.num_spec_accepted_tokens,
            num_spec_verifications=stats.num_spec_verifications,
            num_spec_steps=stats.num_spec_steps,
            spec_step_seconds=stats.spec_step_seconds,
            num_plain_decode_steps=stats.num_plain_decode_steps,
            plain_decode_step_seconds=stats.plain_decode_step_seconds,
            busy_seconds=stats.total_step_seconds,
            model_flops=stats.model_flops,
            model_bytes=stats.model_bytes,
            peak_flops=self.peaks[0],
            peak_bytes_per_s=self.peaks[1],
            kernel_checks=[convert.kernel_check_to_proto(c) for c in self.engine.kernel_checks()],
            num_retention_releases=stats.num_retention_releases,
            num_retention_expiries=stats.num_retention_expiries,
            num_retained_evicted_blocks=stats.num_retained_evicted,
            num_retained_demoted_blocks=stats.num_retained_demoted,
            num_prefetched_blocks=stats.num_prefetched_blocks,
            num_prefetch_hit_blocks=stats.num_prefetch_hits,
            num_retained_blocks=stats.num_retained_blocks,
            retained_bytes_per_tenant=stats.retained_bytes_per_tenant,
        )


# The KV stream's own limit: a chunk is at most MAX_CHUNK_BYTES of K and V plus a few header bytes.
KV_MAX_MESSAGE_BYTES = 2 * MAX_CHUNK_BYTES
KV_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", KV_MAX_MESSAGE_BYTES)]
def trace_generate(span: Any, role: str, request: engine_pb2.GenerateRequest, final: Any, ttft: float | None) -> None:
    """A Generate call's span attributes: usage (GenAI conventions), queue wait, cache hits, preemptions."""
    if not span.is_recording():
        return
    tracing.set_attributes(span, {
        "tokenfleet.role": role, "tokenfleet.tenant": request.tenant or None,
        "tokenfleet.remote_prefill": request.HasField("prefill") and bool(request.prefill.address),
        "tokenfleet.resumed_tokens": len(request.resume.output_token_ids) or None,
        "tokenfleet.ttft_s": ttft,
        "gen_ai.usage.input_tokens": final.num_prompt_tokens if final else len(request.prompt_token_ids),
        "gen_ai.usage.output_tokens": final.num_output_tokens if final else None,
        "gen_ai.response.finish_reasons": [final.finish_reason.value] if final and final.finish_reason else None,
        "tokenfleet.cached_tokens": final.num_cached_tokens if final else None,
        "tokenfleet.preemptions": final.num_preemptions if final else None,
        "tokenfleet.queue_wait_s": final.queued_seconds if final else None})


# Generate / Prefill requests: prompt token ids (at most 5 bytes each), sampling parameters and a grammar.
MAX_MESSAGE_BYTES = 8 << 20


class RemotePrefill:
    """A KV source over gRPC: calls the prefill replica's Prefill for one Generate request."""

    def __init__(self, channel: grpc.aio.Channel, request: engine_pb2.GenerateRequest,
                 context: grpc.aio.ServicerContext, parent_span: Any = None):
        self.stub = engine_pb2_grpc.EngineServiceStub(channel)
        self.request = request
        self.replica = request.prefill.replica_id or request.prefill.address
        self.metadata = request_id_metadata(request.request_id) if request.request_id else ()
        self.parent_span = parent_span  # the Generate call's span: the transfer is its child, whichever task pulls it

    async def __call__(self, held_block_hashes: Sequence[bytes], layout: KVLayout) -> AsyncGenerator[PrefillEvent, None]:
        r = self.request
        span = Trace.start("kv.transfer", "client", {"rpc.system": "grpc", "tokenfleet.prefill_replica": self.replica,
                                                     "tokenfleet.held_blocks": len(held_block_hashes)},
                           parent=self.parent_span) if self.parent_span is not None else Trace()
        call = self.stub.Prefill(convert.prefill_request(r, held_block_hashes, layout),
                                 metadata=self.metadata + span.metadata())
        messages = size = 0
        error: BaseException | None = None
        try:
            async for message in call:
                if messages == 0:
                    span.event("first_token")  # the prefill replica's first message: its first token
                messages += 1
                size += message.ByteSize()
                yield convert.prefill_event(message)
        except grpc.aio.AioRpcError as e:
            error = e
            raise KVTransferError(f"prefill replica {self.replica}: {e.code().name}: {e.details()}") from e
        finally:
            call.cancel()  # no-op when finished; frees the prefill side's held blocks when we stop early
            span.set(**{"tokenfleet.kv_messages": messages, "tokenfleet.kv_bytes": size})
            span.end(error)
