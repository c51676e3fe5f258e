"""The usage ledger: one record per request, in SQLite (WAL).

``write`` returns once the record is durable (committed with synchronous=FULL): the gateway
awaits it before it sends a request's final chunk, so a client that saw the end of its
response is billed even if the gateway dies right after. One writer thread owns the
connection and commits whatever has queued up in one transaction (group commit), so the
fsync is shared by concurrent requests and the event loop never blocks on disk.
"""

from __future__ import annotations

import asyncio
import csv
import io
import queue
import sqlite3
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger()
STATUSES = ("ok", "cancelled", "failed", "rejected")
_COLUMNS = ("request_id", "tenant", "key_id", "model", "endpoint", "status", "prompt_tokens", "cached_tokens",
            "completion_tokens", "ttft_ms", "duration_ms", "started_at", "finished_at", "detail", "requested_model")
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL, tenant TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
    endpoint TEXT NOT NULL, status TEXT NOT NULL CHECK (status IN {STATUSES}),
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    ttft_ms REAL, duration_ms REAL NOT NULL, started_at REAL NOT NULL, finished_at REAL NOT NULL, detail TEXT NOT NULL,
    requested_model TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS usage_request ON usage (request_id);
CREATE INDEX IF NOT EXISTS usage_time ON usage (finished_at);
"""


INSERT = f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"  # UsageRecord.row()


@dataclass
class UsageRecord:
    request_id: str
    tenant: str
    model: str
    endpoint: str
    status: str = "ok"
    key_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    duration_ms: float = 0.0
    started_at: float = 0.0  # unix seconds
    finished_at: float = 0.0
    detail: str = ""  # why it was rejected or failed
    # the name the client sent when the gateway served another (a routing alias such as "auto": the model router's
    # decision is ``model``); "" when it is ``model``
    requested_model: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def row(self) -> tuple:
        return tuple(getattr(self, c) for c in _COLUMNS)


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _connect(self.path) as conn:
            conn.executescript(_SCHEMA)
            columns = {row[1] for row in conn.execute("PRAGMA table_info(usage)")}
            if "requested_model" not in columns:  # a ledger written before the model router
                conn.execute("ALTER TABLE usage ADD COLUMN requested_model TEXT NOT NULL DEFAULT ''")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tokenfleet-ledger", daemon=True)
        self._thread.start()
        self.num_commits = 0
        self.failed_at: float | None = None  # time.monotonic() of the last failed commit (a full disk); None after one
        self.last_error = ""  # succeeds

    def failing(self, within: float) -> bool:
        """Whether a commit failed in the last ``within`` seconds, with none succeeding since."""
        return self.failed_at is not None and time.monotonic() - self.failed_at < within

    async def write(self, record: UsageRecord, guard: tuple[str, tuple] | None = None) -> bool:
        """Returns when the record is on disk. ``guard``: a statement (SQL, parameters) run in the same
        transaction first; the record is written only if it changed exactly one row (a batch line's result:
        tokenfleet.batch.store.BatchStore.line_guard), and the return says whether it did."""
        return await asyncio.wrap_future(self.submit(record, guard))

    def submit(self, record: UsageRecord, guard: tuple[str, tuple] | None = None) -> Future:
        done: Future = Future()
        self._queue.put((record, done, guard))
        return done

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        conn = _connect(self.path)
        try:
            while True:
                item = self._queue.get()
                batch = [item]
                while True:  # group commit: everything queued meanwhile goes in this transaction
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = None in batch
                items = [i for i in batch if i is not None]
                if items:
                    self._commit(conn, items)
                if stop:
                    return
        finally:
            conn.close()

    def _commit(self, conn: sqlite3.Connection, items: list[tuple[UsageRecord, Future, tuple[str, tuple] | None]]
                ) -> None:
        written = []
        try:
            with conn:
                for _, _, guard in items:
                    written.append(guard is None or conn.execute(*guard).rowcount == 1)
                conn.executemany(INSERT,
                                 [record.row() for (record, _, _), ok in zip(items, written, strict=True) if ok])
            self.num_commits += 1
            self.failed_at = None
        except sqlite3.Error as e:
            self.failed_at, self.last_error = time.monotonic(), str(e)
            log.error("the usage ledger cannot be written", error=str(e), records=len(items))
            for _, done, _ in items:
                _resolve(done, error=e)
            return
        for (_, done, _), ok in zip(items, written, strict=True):
            _resolve(done, ok)


def _resolve(done: Future, result: bool = False, error: BaseException | None = None) -> None:
    """Tell the writer's caller, unless it stopped waiting: an awaiting task that was cancelled (a client gone
    mid-write) cancels its future through ``asyncio.wrap_future``, and setting a cancelled future raises, which
    would end the writer thread and leave every later write waiting forever. The record is written either way."""
    if done.cancelled():
        return
    try:
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)
    except InvalidStateError:  # cancelled between the check and the set
        pass


def _connect(path: Path) -> sqlite3.Connection:
    # the batch tier writes files and finalizes batches in this database too: wait for its lock, not fail
    conn = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.isolation_level = "DEFERRED"  # `with conn:` opens and commits a transaction
    return conn


def records(path: str | Path, since: float = 0.0) -> list[UsageRecord]:
    with _connect(Path(path)) as conn:
        rows = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM usage WHERE finished_at >= ? ORDER BY id",
                            (since,)).fetchall()
    return [UsageRecord(**dict(zip(_COLUMNS, row))) for row in rows]


REPORT_COLUMNS = ("day", "tenant", "model", "requests", "ok", "rejected", "cancelled", "failed", "prompt_tokens",
                  "cached_tokens", "completion_tokens")


def report(path: str | Path, since: float = 0.0, tenant: str | None = None, pricing: Any = None) -> list[dict]:
    """Per tenant, model and UTC day: request counts by status and token sums; with ``pricing``
    (tenancy.pricing.Pricing) their cost in US dollars too (``usd``)."""
    sql = """SELECT date(finished_at, 'unixepoch') AS day, tenant, model, count(*),
                    sum(status = 'ok'), sum(status = 'rejected'), sum(status = 'cancelled'), sum(status = 'failed'),
                    sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens)
             FROM usage WHERE finished_at >= ? AND (? IS NULL OR tenant = ?)
             GROUP BY day, tenant, model ORDER BY day, tenant, model"""
    with _connect(Path(path)) as conn:
        rows = [dict(zip(REPORT_COLUMNS, row)) for row in conn.execute(sql, (since, tenant, tenant)).fetchall()]
    if pricing is not None:  # the cost is linear in the token sums: the sum's cost is the sum of the costs
        for r in rows:
            r["usd"] = round(pricing.cost(r["model"], r["prompt_tokens"] or 0, r["cached_tokens"] or 0,
                                          r["completion_tokens"] or 0), 6)
    return rows


def format_report(rows: Sequence[dict], fmt: str = "table") -> str:
    columns = REPORT_COLUMNS + (("usd",) if rows and "usd" in rows[0] else ())
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, columns)
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines) + "\n"

