"""Placing a request on a worker and keeping its stream whole: Pick from the router, Generate on
the replica, place again when a replica refuses or fails before responding, and resume on another
replica when one is lost mid-stream."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from tokenfleet.services.common.convert import request_to_proto

from tokenfleet.api.openai_schema import APIError
from tokenfleet.engine.output import Resume
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.security.plane import Channels
from tokenfleet.telemetry.metrics import GatewayMetrics
from tokenfleet.telemetry.request_id import metadata as request_id_metadata
from tokenfleet.telemetry.tracing import Trace
from tokenfleet.tenancy.tenants import Tenant
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

log = structlog.get_logger()
PICK_TIMEOUT_S = 10.0
RELEASE_TIMEOUT_S = 3.0  # Release is best effort: a worker that cannot answer by then keeps the blocks until they expire
MAX_PLACEMENTS = 3  # a request tries at most this many replicas before its first token
RESUME_PICK_WAIT_S = 3.0  # a stream being resumed waits this long for the fleet to show a replica
# A new request that no router can place yet (a router restarting, the fleet's only worker restarting) waits this long
# (within its deadline) for one to; the client gets 503 with Retry-After after that.
OUTAGE_WAIT_S = 5.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
# Toward routers and workers: HTTP/2 keepalive pings, for idle connections. They do not fail the streams of a stopped
# (SIGSTOP) or silently partitioned worker (measured with grpcio 1.85.3: a server-streaming call was still open after
# 60 s of pings every 2 s), so workers are asked for heartbeats instead (Dispatcher.stall_timeout).
WORKER_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# A request whose client stated no deadline (a batch line): a worker that has not produced its first response after
# this many times its tier's TTFT objective (at least FIRST_RESPONSE_MIN_S) is given up on for that request (placed
# again), whatever the reason it is silent. With a deadline, the worker has until then; a worker refuses at once what
# it predicts would miss it (or its tier's objective, when the operator set one).
FIRST_RESPONSE_DEADLINE_FACTOR = 2.0
DEFAULT_STALL_TIMEOUT_S = 10.0
FIRST_RESPONSE_MIN_S = 60.0
# How a stream looks when its replica died mid-way (connection reset, RST_STREAM, server gone).
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED)
# Batch lines' first-response deadline (above); early rejection uses only objectives an operator sets.
DEFAULT_TTFT_OBJECTIVES = {"interactive": 30.0, "batch": 300.0}


@dataclass
class Placement:
    """Where a request ran: the replica of its latest placement (the response's replica header), its worker's
    address (where a conversation's retained blocks are released), and the prompt tokens the router expected that
    replica to hold (PickResponse.cached_prompt_tokens; what it found is the usage's cached_prompt_tokens)."""

    replica: str | None = None
    address: str | None = None
    expected_cached_tokens: int | None = None


NO_SPARE_CAPACITY = "no_spare_capacity"  # a batch line's Pick found the fleet busy: the runner tries it later


@dataclass
class Job:
    """One request as the dispatcher sees it: the request (``RequestSpec``) and how to place it."""

    model_ref: str  # what the router is asked for (name@version)
    request: RequestSpec
    tenant: Tenant  # its tier bounds the wait for the first token
    placement: Placement = field(default_factory=Placement)
    trace: Trace = field(default_factory=Trace)  # the request's span: router and worker calls are its children
    spare_only: bool = False  # a batch line: placed only where the fleet has spare capacity (PickRequest.spare_only)
    deadline: float | None = None  # time.monotonic() when the client stops waiting for the first response

    @property
    def request_id(self) -> str:
        return self.request.id

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    def __post_init__(self) -> None:
        if self.request.limit is None:
            raise ValueError("a dispatched request carries its output limit (the gateway's edge sets it)")

    @property
    def limit(self) -> int:
        """Output tokens it may produce per sample (the edge's limit)."""
        assert self.request.limit is not None
        return self.request.limit

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The client's own request id, for the next hop's logs."""
        return request_id_metadata(self.request.client_request_id) if self.request.client_request_id else ()


@dataclass
class _Sample:
    """One sample's output passed on to the client (n > 1: one per index)."""

    delivered: list[int] = field(default_factory=list)  # output tokens passed on
    text: str = ""  # and their text
    finished: bool = False  # its final passed on


@dataclass
class _Progress:
    """What a stream has done across placements."""

    failed: list[str] = field(default_factory=list)  # replicas left: refused, failed before responding, or lost
    lost: list[str] = field(default_factory=list)  # of those, lost mid-stream: a resume avoids only these
    samples: dict[int, _Sample] = field(default_factory=dict)  # by index
    resumes: int = 0
    last_error: grpc.aio.AioRpcError | None = None

    def sample(self, index: int) -> _Sample:
        return self.samples.setdefault(index, _Sample())

    @property
    def delivered(self) -> list[int]:
        """Sample 0's tokens passed on (n = 1: the stream's)."""
        return self.sample(0).delivered

    @property
    def started(self) -> bool:
        """Some output passed on: placing it again is a resume."""
        return any(s.delivered for s in self.samples.values())

    def note(self, response: engine_pb2.GenerateResponse) -> None:
        if response.HasField("chunk"):
            sample = self.sample(response.chunk.index)
            sample.delivered.extend(response.chunk.token_ids)
            sample.text += response.chunk.text
        elif response.HasField("final"):
            self.sample(response.final.index).finished = True

    def all_tokens_delivered(self, n: int, limit: int) -> bool:
        """Every unfinished sample has its every token passed on: only finals are missing."""
        return all(self.sample(i).finished or len(self.sample(i).delivered) >= limit for i in range(n))


@dataclass
class Dispatcher:
    routers: Sequence[str]  # tried in turn: a Pick a router cannot answer goes to the next
    metrics: GatewayMetrics
    channels: Channels  # to the router and the workers, over the internal plane
    max_resumes: int = 2  # a stream whose replica dies is continued elsewhere at most this many times
    # Early rejection: a worker refuses a request it predicts would wait longer than its tier's objective (only those
    # an operator set: by default, only past the client's deadline).
    ttft_objectives: dict[str, float] = field(default_factory=dict)
    # A stream whose worker has sent nothing, not even a heartbeat, for this long is given up on there (stopped, hung,
    # or cut off without a reset) and placed again or resumed elsewhere; workers heartbeat every quarter of it. Held
    # only to replicas that have shown they heartbeat (a worker that predates heartbeats is never cut). 0: off.
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    _turn: Iterator[int] = field(default_factory=itertools.count)
    _heartbeating: set[str] = field(default_factory=set)  # replica ids seen sending heartbeats

    async def pick(self, job: Job, exclude: Sequence[str] = (), colocated: bool = False, resuming: bool = False
                   ) -> router_pb2.PickResponse:
        """A placement from a router; it hashes the prompt to find replicas holding its prefix. A router
        that is unreachable or too slow (UNAVAILABLE, DEADLINE_EXCEEDED) is followed by the next one;
        the routers take turns as the first asked."""
        spec = job.request
        request = router_pb2.PickRequest(
            model=job.model_ref, request_id=job.request_id, num_prompt_tokens=spec.num_prompt_tokens,
            prompt_token_ids=spec.prompt_token_ids, exclude_replica_ids=list(exclude),
            colocated=colocated or bool(spec.adapter), cache_scope=spec.kv_scope,  # the scope the worker hashes with
            adapter=spec.adapter, spare_only=job.spare_only and not resuming,  # a started line finishes anyway
            conversation=spec.conversation)
        start = self._first_router(spec.conversation)
        error: grpc.aio.AioRpcError | None = None
        for address in [*self.routers[start:], *self.routers[:start]]:
            stub = router_pb2_grpc.RouterServiceStub(self.channels.get(address, "router"))
            span = job.trace.child("router.pick", "client", {"rpc.system": "grpc", "server.address": address,
                                                             "tokenfleet.excluded": list(exclude)})
            try:
                picked = await stub.Pick(request, metadata=job.metadata() + span.metadata(), timeout=PICK_TIMEOUT_S)
                span.set(**{"tokenfleet.replica": picked.replica_id,
                            "tokenfleet.prefill_replica": picked.prefill_replica_id or None,
                            "tokenfleet.prefix_blocks": picked.prefix_blocks or None})
                span.end()
            except grpc.aio.AioRpcError as e:
                span.end(f"{e.code().name}: {e.details()}")
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    raise APIError(404, f"The model `{job.model_ref}` has no replica.", code="model_not_found",
                                   param="model") from e
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and job.spare_only:
                    raise APIError(503, "no spare capacity for batch work now", "server_error",
                                   code=NO_SPARE_CAPACITY) from e
                error = e
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue
                break
            job.placement.replica, job.placement.address = picked.replica_id, picked.address
            job.placement.expected_cached_tokens = picked.cached_prompt_tokens
            job.trace.set(**{"tokenfleet.prefix.expected_tokens": picked.cached_prompt_tokens})
            return picked
        assert error is not None
        log.warning("no router placed the request", code=error.code().name, details=error.details())
        raise APIError(503, "no replica available", "server_error", code="no_replica")

    def _first_router(self, conversation: str) -> int:
        """The router asked first: the conversation's own (a stable hash, the same from every gateway), since each
        router remembers only the conversations it placed; without one, the routers take turns."""
        if conversation:
            return zlib.crc32(conversation.encode()) % len(self.routers)
        return next(self._turn) % len(self.routers)

    async def release(self, address: str, conversation: str) -> int:
        """Ask the worker at ``address`` to stop retaining ``conversation``'s blocks (they go back to plain LRU);
        the number of blocks it had retained. Best effort: a worker that is unreachable, too slow (past
        RELEASE_TIMEOUT_S) or does not implement Release gives 0, logged, never an error, since the blocks expire
        on their own at the end of their retention."""
        if not conversation:
            return 0
        stub = engine_pb2_grpc.EngineServiceStub(self.channels.get(address, "worker"))
        try:
            response = await stub.Release(engine_pb2.ReleaseRequest(conversation=conversation),
                                          timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("release not done; the blocks expire with their retention", address=address,
                     code=e.code().name, details=e.details())
            return 0
        return response.blocks

    async def _place(self, job: Job, progress: _Progress) -> router_pb2.PickResponse:
        """A placement avoiding the replicas this request left; when resuming a stream whose replica
        was lost, a fleet with no replica right now (a lease renewing, a worker restarting) is given
        up to RESUME_PICK_WAIT_S to show one, and a new request that no router could place up to OUTAGE_WAIT_S
        (a router restarting). Every replica refused: the refusal is the error."""
        resuming = progress.started
        wait = RESUME_PICK_WAIT_S if resuming else OUTAGE_WAIT_S if progress.last_error is None and not job.spare_only \
            else 0.0
        deadline = time.monotonic() + wait
        if job.deadline is not None:
            deadline = min(deadline, job.deadline)
        while True:
            try:
                return await self.pick(job, progress.lost if resuming else progress.failed, colocated=resuming,
                                       resuming=resuming)
            except APIError as e:
                if e.code == "no_replica" and time.monotonic() < deadline:
                    await asyncio.sleep(0.25)
                    continue
                last = progress.last_error
                if e.code == "no_replica" and last is not None and last.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise status_error(last) from e
                raise

    def _request(self, job: Job, picked: router_pb2.PickResponse, progress: _Progress) -> engine_pb2.GenerateRequest:
        spec = job.request
        if progress.started:
            spec = dataclasses.replace(spec, resume=Resume(tuple(progress.delivered), progress.sample(0).text))
        request = request_to_proto(spec)
        if self.stall_timeout > 0:
            request.heartbeat_ms = max(1, int(1000 * self.stall_timeout / 4))
        if progress.started:
            log.warning("resuming the stream on another replica", replica=picked.replica_id, lost=progress.failed,
                        tokens_delivered=len(progress.delivered), resume=progress.resumes)
        else:
            objective = self.first_token_budget(job)
            request.ttft_objective_ms = max(1, int(1000 * objective)) if objective is not None else 0
            if picked.prefill_address:
                request.prefill.replica_id = picked.prefill_replica_id
                request.prefill.address = picked.prefill_address
            if picked.prefix_address:  # with a prefill replica: that replica's source
                request.prefix_source.replica_id = picked.prefix_replica_id
                request.prefix_source.address = picked.prefix_address
                request.prefix_source.num_blocks = picked.prefix_blocks
        return request

    async def generate(self, job: Job, progress: _Progress | None = None
                       ) -> AsyncGenerator[engine_pb2.GenerateResponse, None]:
        """The worker's response stream, kept whole across replica failures.

        A replica that fails before its first response (gone, draining, full) is excluded and
        the request placed again, up to MAX_PLACEMENTS times. A replica lost mid-stream is
        excluded too and the request continues on another one, which re-prefills the prompt
        plus the tokens already streamed (``resume``) and streams only what follows, at most
        ``max_resumes`` times; after that the stream ends with an error. With n > 1 each
        unfinished sample continues as a request of its own (``_resume_samples``)."""
        progress = progress if progress is not None else _Progress()
        while True:
            if job.params.n > 1 and progress.started:
                async for response in self._resume_samples(job, progress):
                    yield response
                return
            picked = await self._place(job, progress)
            stub = engine_pb2_grpc.EngineServiceStub(self.channels.get(picked.address, "worker"))
            span = job.trace.child("worker.generate", "client", {
                "rpc.system": "grpc", "server.address": picked.address, "tokenfleet.replica": picked.replica_id,
                "tokenfleet.resumed_tokens": len(progress.delivered) or None})
            call = stub.Generate(self._request(job, picked, progress), metadata=job.metadata() + span.metadata())
            responded = finished = False
            finals = 0
            failure: BaseException | None = None
            try:
                async for response in self._watched(call, job, picked.replica_id):
                    if response.HasField("error"):
                        log.error("worker reported an error", replica=picked.replica_id, error=response.error.message)
                        raise APIError(500, "The server had an error while processing your request.", "server_error")
                    responded = True
                    progress.note(response)
                    if response.HasField("final"):
                        finals += 1
                        job.trace.set(**{"tokenfleet.prefix.found_tokens": response.final.usage.cached_prompt_tokens})
                    finished = finals >= job.params.n  # n > 1: every sample's final
                    yield response
                if not finished:  # e.g. a worker that predates n > 1 and sent one final
                    raise APIError(503, f"the worker's stream ended with {finals} of {job.params.n} results",
                                   "server_error", code="incomplete")
                return
            except grpc.aio.AioRpcError as e:
                # Our own cancel (client gone) surfaces as CancelledError/GeneratorExit, never here.
                if finished:  # the result arrived; only the call's end was lost
                    return
                failure = e
                self._after_failure(job, picked.replica_id, progress, e, responded)
            except BaseException as e:
                failure = e
                raise
            finally:
                call.cancel()  # no-op when finished; aborts the request when the client went away
                span.end(None if finished else failure or "the stream ended early")

    def first_token_budget(self, job: Job) -> float | None:
        """Seconds the request may wait for its first token (the worker refuses it at once when it predicts a longer
        wait): the least of its tier's objective, when an operator set one, and what is left of its client's deadline.
        None: no bound."""
        bounds = [self.ttft_objectives[job.tenant.tier]] if job.tenant.tier in self.ttft_objectives else []
        if job.deadline is not None:
            bounds.append(max(0.001, job.deadline - time.monotonic()))
        return min(bounds) if bounds else None

    async def _watched(self, call: grpc.aio.UnaryStreamCall, job: Job, replica: str
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The call's responses, heartbeats taken out. The call is cancelled and fails with DEADLINE_EXCEEDED when the
        first response has not come by the client's deadline (without one, a batch line: after
        FIRST_RESPONSE_DEADLINE_FACTOR x the tier's TTFT objective, at least FIRST_RESPONSE_MIN_S), and with
        UNAVAILABLE when a replica that heartbeats has sent nothing for ``stall_timeout``."""
        responses = call.__aiter__()
        if job.deadline is not None:
            first_by = job.deadline
        else:
            objective = self.ttft_objectives.get(job.tenant.tier, DEFAULT_TTFT_OBJECTIVES.get(job.tenant.tier, 0))
            first_by = time.monotonic() + max(FIRST_RESPONSE_MIN_S, FIRST_RESPONSE_DEADLINE_FACTOR * objective)
        first = True
        while True:
            held = self.stall_timeout > 0 and replica in self._heartbeating
            bounds = ([first_by - time.monotonic()] if first else []) + ([self.stall_timeout] if held else [])
            try:
                async with asyncio.timeout(max(0.001, min(bounds)) if bounds else None):
                    response = await anext(responses)
            except StopAsyncIteration:
                return
            except TimeoutError:
                call.cancel()
                if first and time.monotonic() >= first_by:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                               grpc.aio.Metadata(), "no first response by the request's deadline"
                                               ) from None
                self.metrics.stalls.inc()
                log.warning("replica silent, not even heartbeats; giving up on it for this request", replica=replica,
                            silent_s=self.stall_timeout, request_id=job.request_id)
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           f"no message from the replica for {self.stall_timeout:g} s (stopped, hung "
                                           "or unreachable)") from None
            if response.HasField("alive"):
                self._heartbeating.add(replica)
                continue
            first = False
            yield response

    def _after_failure(self, job: Job, replica: str, progress: _Progress, e: grpc.aio.AioRpcError,
                       responded: bool) -> None:
        """A replica's call failed: record it and return to place the request again, or raise."""
        lost = responded and e.code() in LOST
        context = {"replica": replica, "code": e.code().name, "details": e.details()}
        if not responded and e.code() in RETRYABLE and len(progress.failed) + 1 < MAX_PLACEMENTS:
            log.warning("replica failed before responding; placing again", **context)
        elif lost and progress.resumes < self.max_resumes and not progress.all_tokens_delivered(job.params.n, job.limit):
            progress.resumes += 1
            self.metrics.resumes.labels("ok").inc()
            log.warning("replica lost mid-stream; continuing on another", **context,
                        tokens_delivered=len(progress.delivered), resume=progress.resumes,
                        excluded=[*progress.failed, replica])
        elif lost:
            log.warning("replica lost mid-stream; not resuming", **context, tokens_delivered=len(progress.delivered),
                        resumes=progress.resumes, max_resumes=self.max_resumes)
            if progress.all_tokens_delivered(job.params.n, job.limit):  # every token delivered, only the final lost
                raise APIError(503, f"the request's replica was lost after its last token: {e.details()}",
                               "server_error", code="replica_lost") from e
            self.metrics.resumes.labels("exhausted").inc()
            raise APIError(503, f"the request's replica was lost mid-stream {progress.resumes + 1} time(s); "
                           f"gave up after {progress.resumes} resume(s): {e.details()}", "server_error",
                           code="replica_lost") from e
        else:
            raise status_error(e) from e
        progress.failed.append(replica)
        if lost:
            progress.lost.append(replica)
        progress.last_error = e


    async def _resume_samples(self, job: Job, progress: _Progress) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """n > 1 after a replica was lost: each unfinished sample continues as a request of its own (n = 1, the seed a
        seeded request's sample has, its own output resumed), their responses merged under the sample's index. Each
        of them is resumed again if its replica is lost, from the resumes the group has left."""
        queue: asyncio.Queue[engine_pb2.GenerateResponse | BaseException | None] = asyncio.Queue()

        async def run(index: int) -> None:
            params = dataclasses.replace(job.params, n=1, seed=None if job.params.seed is None
                                         else (job.params.seed + index) % 2**64)
            sample = progress.sample(index)
            own = _Progress(list(progress.failed), list(progress.lost), {0: _Sample(sample.delivered, sample.text)},
                            progress.resumes, progress.last_error)
            alone = dataclasses.replace(job.request, sampling_params=params, request_id=f"{job.request_id}-{index}")
            try:
                async for response in self.generate(dataclasses.replace(job, request=alone), own):
                    getattr(response, response.WhichOneof("kind")).index = index
                    await queue.put(response)
            except BaseException as e:  # noqa: BLE001 - handed to the merged stream
                await queue.put(e)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(run(i)) for i in range(job.params.n) if not progress.sample(i).finished]
        try:
            for _ in range(len(tasks)):
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def status_error(e: grpc.aio.AioRpcError) -> APIError:
    """A worker's status as the client's error. A refusal of the request (INVALID_ARGUMENT) or for load
    (RESOURCE_EXHAUSTED) carries the worker's words; everything else is generic, its details in the
    gateway's log only (they name replicas, addresses, internal errors)."""
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details() or "invalid request")
    log.warning("worker call failed", code=code.name, details=e.details())
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the worker's reason (queue, predicted wait) helps the client
        return APIError(503, f"overloaded: {e.details()}", "server_error", code="overloaded",
                        headers={"retry-after": "2"})
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return APIError(503, "no replica could serve the request", "server_error", code="overloaded",
                        headers={"retry-after": "2"})
    return APIError(500, "The server had an error while processing your request.", "server_error")
