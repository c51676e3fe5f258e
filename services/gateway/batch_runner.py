"""The batch tier's executor: each gateway runs the batches it holds the lease of, line by line, through its own
pipeline at the batch tier's priority and only on spare capacity.

- Claims: every ``poll`` seconds the runner takes the active batches whose lease lapsed (at start, also the ones an
  earlier life of this gateway held: a gateway killed and restarted resumes its batches at once), and renews the
  leases it holds; a batch whose lease it lost is left to its new owner.
- Lines run as the batch tenant's requests with tier ``batch`` (the engine schedules them after interactive ones)
  and ``spare_only`` placement (the router places one only on a replica with nothing waiting and fewer than its
  ``--batch-slots`` running; otherwise the line waits and is tried again). At most ``concurrency`` lines run at
  once on this gateway, shared by its batches in turn.
- A line's result and its ledger record land in one transaction, only while the line is pending and the batch is
  this gateway's (``BatchStore.line_guard``): exactly one output line and one charge per line, whatever died when.
- A request the server refuses for now (no spare capacity, the tenant's rate limit, no replica) is tried again,
  not failed; a server error is tried ``MAX_ATTEMPTS`` times; a client error (bad body, unknown model, context
  too long) fails the line with its status and OpenAI error body, as the endpoint would have answered.
- The completion window: lines not finished when it passes go to the error file (``batch_expired``), the batch
  ends ``expired``. Cancel: the lines running are stopped, the batch ends ``cancelled`` with what finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
from collections import deque

import structlog
from tokenfleet.services.gateway.dispatch import NO_SPARE_CAPACITY
from tokenfleet.services.gateway.openai_encoder import OpenAIEncoder
from tokenfleet.services.gateway.pipeline import Call, Gateway, Prepared, request_trace, trace_request, validate_body

from tokenfleet.api.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from tokenfleet.batch.formats import line_id
from tokenfleet.batch.store import ACTIVE, BatchStore
from tokenfleet.telemetry.metrics import BatchMetrics, RequestTimer
from tokenfleet.tenancy.admission import ANONYMOUS, Caller
from tokenfleet.tenancy.ledger import Ledger, UsageRecord

log = structlog.get_logger()
MAX_ATTEMPTS = 3  # a line failing with a server error is tried this many times
SPARE_BACKOFF_S = 0.25  # no spare capacity: the next line is tried after this (load reports refresh about as often)


@dataclasses.dataclass
class _Line:
    batch_id: str
    index: int
    custom_id: str
    body: str
    attempts: int
    prepared: Prepared | None = None


class _Retry(Exception):
    def __init__(self, delay: float, counts: bool):
        self.delay, self.counts = delay, counts


class BatchRunner:
    def __init__(self, gateway: Gateway, store: BatchStore, ledger: Ledger, gateway_id: str, concurrency: int = 8,
                 lease_seconds: float = 30.0, poll_seconds: float = 0.5):
        if concurrency < 1:
            raise ValueError("the batch tier's concurrency must be >= 1")
        self.gateway, self.store, self.ledger = gateway, store, ledger
        self.gateway_id = gateway_id
        self.owner = f"{gateway_id}/{secrets.token_hex(4)}"  # this life of this gateway
        self.concurrency, self.lease_seconds, self.poll_seconds = concurrency, lease_seconds, poll_seconds
        self.in_flight = 0
        self.backoff_until = 0.0
        self.slot_freed = asyncio.Event()  # a line ended: a driver waiting for a slot looks again
        self.drivers: dict[str, asyncio.Task] = {}
        self.stopping = False
        self.task: asyncio.Task | None = None
        self.metrics = BatchMetrics(gateway.metrics.registry)

    def start(self) -> asyncio.Task:
        self.task = asyncio.create_task(self.run())
        return self.task

    async def run(self) -> None:
        """Claim, renew and drive batches until ``stop``."""
        reclaim: str | None = f"{self.gateway_id}/"
        last_renew = last_sweep = 0.0
        while not self.stopping:
            if not self.gateway.models.ready:  # a starting gateway: lines would find no model (404) yet
                await asyncio.sleep(self.poll_seconds)
                continue
            try:
                now = time.monotonic()
                if now - last_renew >= self.lease_seconds / 3:
                    await self._renew()
                    last_renew = now
                claimed = await asyncio.to_thread(self.store.claim, self.owner, self.lease_seconds, reclaim)
                reclaim = None
                if self.stopping:  # stop() began meanwhile: these are not ours to run any more
                    await asyncio.to_thread(self.store.renew, self.owner, claimed, -self.lease_seconds)
                    break
                for batch_id in claimed:
                    if batch_id not in self.drivers:
                        log.info("batch claimed", batch=batch_id)
                        self.drivers[batch_id] = asyncio.create_task(self._drive(batch_id))
                if now - last_sweep >= 60:
                    await asyncio.to_thread(self.store.sweep_expired_files)
                    last_sweep = now
                self._reap()
            except Exception as e:  # the database busy past its timeout, a disk error: try again next poll
                log.error("batch runner poll failed", error=repr(e))
            await asyncio.sleep(self.poll_seconds)

    async def _renew(self) -> None:
        if not self.drivers:
            return
        kept = await asyncio.to_thread(self.store.renew, self.owner, list(self.drivers), self.lease_seconds)
        for batch_id in set(self.drivers) - kept:  # taken over, or finished: stop here
            task = self.drivers.pop(batch_id)
            if not task.done():
                log.warning("batch lease lost", batch=batch_id)
                task.cancel()

    def _reap(self) -> None:
        for batch_id in [b for b, task in self.drivers.items() if task.done()]:
            task = self.drivers.pop(batch_id)
            if not task.cancelled() and task.exception() is not None:
                log.error("batch driver failed", batch=batch_id, error=repr(task.exception()))
        self.metrics.owned.set(len(self.drivers))

    async def stop(self, grace: float) -> None:
        """Start no more lines, let the running ones finish for up to ``grace`` seconds (the leases kept
        meanwhile), then give the leases back: another gateway takes the batches at once."""
        self.stopping = True
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)  # no claim after this
        deadline = time.monotonic() + grace
        last_renew = time.monotonic()
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            if time.monotonic() - last_renew >= self.lease_seconds / 3:
                with contextlib.suppress(Exception):
                    await self._renew()
                last_renew = time.monotonic()
        drivers = dict(self.drivers)
        for task in drivers.values():
            task.cancel()
        await asyncio.gather(*drivers.values(), return_exceptions=True)
        if drivers:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.renew, self.owner, list(drivers), -self.lease_seconds)

    async def _drive(self, batch_id: str) -> None:
        tenant_name, key_id, endpoint = await asyncio.to_thread(self.store.owner_info, batch_id)
        queue = deque(_Line(batch_id, *row) for row in await asyncio.to_thread(self.store.pending, batch_id))
        running: dict[asyncio.Task, _Line] = {}
        try:
            while True:
                status, expires_at, _ = await asyncio.to_thread(self.store.status, batch_id)
                if status not in ACTIVE:  # finished elsewhere (a lease this gateway lost): nothing to do
                    return
                final = ("cancelled" if status == "cancelling" else "expired" if time.time() >= expires_at else
                         "completed" if not queue and not running else None)
                if final is not None:
                    await self._stop_lines(running)
                    if await asyncio.to_thread(self.store.finish, self.owner, batch_id, final):
                        log.info("batch finished", batch=batch_id, status=final)
                    return
                while (queue and not self.stopping and self.in_flight < self.concurrency
                       and time.monotonic() >= self.backoff_until):
                    line = queue.popleft()
                    self.in_flight += 1
                    self.metrics.running.inc()
                    running[asyncio.create_task(self._line(line, tenant_name, key_id, endpoint))] = line
                self.slot_freed.clear()
                waits: list[asyncio.Future] = [*running, asyncio.ensure_future(self.slot_freed.wait())]
                timeout = self.poll_seconds
                if queue and self.backoff_until > time.monotonic():
                    timeout = min(timeout, self.backoff_until - time.monotonic())
                done, _ = await asyncio.wait(waits, timeout=max(0.01, timeout), return_when=asyncio.FIRST_COMPLETED)
                waits[-1].cancel()
                for task in [t for t in done if t in running]:
                    line = running.pop(task)
                    self._ended()
                    error = None if task.cancelled() else task.exception()
                    if task.cancelled() or isinstance(error, _Retry):
                        if isinstance(error, _Retry):
                            self.backoff_until = max(self.backoff_until, time.monotonic() + error.delay)
                            if error.counts:
                                line.attempts += 1
                                await asyncio.to_thread(self.store.count_attempt, batch_id, line.index)
                        queue.appendleft(line)
                    elif error is not None:
                        log.error("batch line failed unexpectedly", batch=batch_id, line=line.index, error=repr(error))
                        line.attempts += 1
                        queue.append(line)
        finally:
            await self._stop_lines(running)

    def _ended(self) -> None:
        self.in_flight -= 1
        self.metrics.running.dec()
        self.slot_freed.set()

    async def _stop_lines(self, running: dict[asyncio.Task, _Line]) -> None:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for _ in running:
            self._ended()
        running.clear()

    def _caller(self, tenant_name: str, key_id: str) -> Caller:
        directory = self.gateway.admission.directory
        if directory is None:
            tenant = ANONYMOUS
        else:
            found = directory.tenants.get(tenant_name)
            if found is None:
                raise APIError(403, f"tenant {tenant_name!r} no longer exists", code="tenant_not_found")
            tenant = found
        return Caller(dataclasses.replace(tenant, tier="batch"), key_id)  # the batch tier's priority

    async def _line(self, line: _Line, tenant_name: str, key_id: str, endpoint: str) -> None:
        """Run one line and land its result with its ledger record; ``_Retry`` to put it back."""
        chat = endpoint == "/v1/chat/completions"
        rid = line_id(line.batch_id, line.index)
        model = ""
        call: Call | None = None
        try:
            raw = json.loads(line.body)
            model = str(raw.get("model", ""))
            caller = self._caller(tenant_name, key_id)
            operation = "chat" if chat else "text_completion"
            call = Call(rid, f"batch:{endpoint}", caller, batch_line=True, trace=request_trace(
                operation, rid, "internal", {"tokenfleet.batch_id": line.batch_id}))
            if line.prepared is None:  # kept while the line waits for spare capacity: tokenized once
                body = validate_body(ChatCompletionRequest if chat else CompletionRequest, raw)
                line.prepared = await self.gateway.prepare(body, call)
            prepared = line.prepared
            trace_request(call.trace, operation, caller.tenant, prepared)
            run = await self.gateway.open(call, prepared)
            encoder = OpenAIEncoder.of(prepared)
            events = self.gateway.events(run, RequestTimer(self.gateway.metrics))
            whole = await (encoder.chat_body(events) if chat else encoder.completion_body(events))
            record = run.ticket.record if run.ticket is not None else None
            if record is None:
                raise APIError(500, "the line finished without its usage", "server_error")
            state, code, response = "done", 200, whole
        except (APIError, Exception) as caught:
            e = caught if isinstance(caught, APIError) else APIError(500, f"{type(caught).__name__}: {caught}",
                                                                     "server_error")
            if not isinstance(caught, APIError):
                log.warning("batch line error", batch=line.batch_id, line=line.index, error=repr(caught))
            if call is not None:
                call.trace.end(e)  # a no-op once the pipeline ended it
            retry = self._retry(e, line)
            if retry is not None:
                raise retry from e
            # what an admitted attempt used (its ticket's record), else a refusal before admission
            record = call.ticket.record if call is not None and call.ticket is not None else None
            if record is None:
                now = time.time()
                record = UsageRecord(rid, tenant_name, model, f"batch:{endpoint}",
                                     "rejected" if e.status < 500 else "failed", key_id, started_at=now,
                                     finished_at=now)
            record.detail = f"HTTP {e.status}: {e.message}"
            state, code, response = "failed", e.status, e.body()
        record.request_id, record.endpoint = rid, f"batch:{endpoint}"
        guard = BatchStore.line_guard(self.owner, line.batch_id, line.index, state, code, response, None, rid)
        # shielded: a line stopped now (cancel, expiry, shutdown) still lands, or not, as one transaction
        landed = await asyncio.shield(self.ledger.write(record, guard))
        self.metrics.lines.labels("superseded" if not landed else "ok" if state == "done" else f"http_{code}").inc()

    def _retry(self, e: APIError, line: _Line) -> _Retry | None:
        """Whether to put the line back: yes while the fleet is busy (no spare capacity, no replica, overloaded)
        or the tenant is over its rate (it frees up); a server error up to MAX_ATTEMPTS; never a client's error, nor
        a line larger than the tenant's budget could ever admit (a 429 with no Retry-After)."""
        if e.code == NO_SPARE_CAPACITY:
            self.metrics.retries.labels("no_spare_capacity").inc()
            return _Retry(SPARE_BACKOFF_S, counts=False)
        after = e.headers.get("retry-after")
        if (e.status == 429 and after) or e.code in ("overloaded", "no_replica", "budget_unavailable"):
            self.metrics.retries.labels(e.code or "rate_limited").inc()
            return _Retry(float(after) if after and after.replace(".", "", 1).isdigit() else 1.0, counts=False)
        if e.status >= 500 and line.attempts + 1 < MAX_ATTEMPTS:
            self.metrics.retries.labels("unavailable" if e.status == 503 else "server_error").inc()
            return _Retry(1.0, counts=True)
        return None
