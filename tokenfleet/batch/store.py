"""The batch tier's durable state: files, batches and their lines, in the usage ledger's SQLite database.

One database holds the ledger and the batch tables, so a line's result and its ledger charge commit in one
transaction (``line_guard``): a line is charged exactly once, whichever gateway ran it and however often it was
started (a gateway killed mid-line leaves the line pending; the next owner runs it again and only one result
lands). Gateways that open the same database file see the same files and batches.

Ownership: a gateway runs a batch while it holds the batch's lease (``claim``/``renew``); a result is written only
while the lease is its own (the guard checks ``owner``), so a gateway that lost its lease (paused, partitioned)
cannot land a result after another took over. A restarted gateway (same gateway id) takes its own batches back at
once; another gateway takes them when their lease lapses.

Storage only: the formats (OpenAI's file and list objects, the line checks, ids, limits) are in formats.py; the
HTTP routes (services/gateway/batch_api.py) and the executor (services/gateway/batch_runner.py) use both.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tokenfleet.batch.formats import (
    ENDPOINTS,
    BatchError,
    Limits,
    file_object,
    line_id,
    new_id,
    page,
    parse_lines,
    window_seconds,
)
from tokenfleet.tenancy.ledger import INSERT, UsageRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, content BLOB
);
CREATE INDEX IF NOT EXISTS batch_files_tenant ON batch_files (tenant, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT, total INTEGER NOT NULL,
    output_expires_seconds INTEGER, owner TEXT, lease_until REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_at);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'done', 'failed')),
    status_code INTEGER, response TEXT, error TEXT, request_id TEXT, attempts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
);
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a runner still has work to do
TERMINAL = ("completed", "failed", "expired", "cancelled")


class _Again(Exception):
    """A line landed while a batch's files were built: build them again."""


class _NotOurs(Exception):
    """The batch was taken over while its files were built."""


def _locked(method: Callable) -> Callable:
    @functools.wraps(method)
    def run(self: BatchStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class BatchStore:
    """The batch tables of the ledger's database. Every method opens a short transaction of its own; concurrent
    gateways (processes) serialize on SQLite's write lock, and threads of one process (callers use
    ``asyncio.to_thread``: an upload or a finalization is too big for the event loop) on the store's lock."""

    def __init__(self, path: str | Path, limits: Limits | None = None, clock: Any = time.time):
        self.path = Path(path)
        self.limits = limits or Limits()
        self.clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(SCHEMA)
        self._lock = threading.RLock()

    @_locked
    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: the write lock from the start, so a read-then-write cannot be
        overtaken by another gateway)."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _now(self) -> int:
        return int(self.clock())

    # ---- files ----------------------------------------------------------------------------------------
    @_locked
    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes,
                 expires_after: int | None = None) -> dict[str, Any]:
        if purpose != "batch":
            raise BatchError(400, f"purpose must be 'batch' (the only purpose this server stores), got {purpose!r}",
                             None, "purpose")
        if len(content) > self.limits.max_file_bytes:
            raise BatchError(413, f"the file is {len(content)} bytes; at most {self.limits.max_file_bytes} are "
                             "accepted", "file_too_large", "file")
        if purpose == "batch" and not filename.endswith(".jsonl"):
            raise BatchError(400, "a batch input file must be JSONL (a .jsonl filename)", "invalid_file_format",
                             "file")
        now = self._now()
        file_id = new_id("file-")
        with self._tx() as conn:
            (held,) = conn.execute("SELECT coalesce(sum(bytes), 0) FROM batch_files WHERE tenant = ? AND "
                                   "(expires_at IS NULL OR expires_at > ?)", (tenant, now)).fetchone()
            if held + len(content) > self.limits.max_tenant_bytes:
                raise BatchError(413, f"the tenant's files hold {held} bytes; this one would pass its quota of "
                                 f"{self.limits.max_tenant_bytes} (delete files it no longer needs)",
                                 "storage_quota_exceeded", "file")
            conn.execute("INSERT INTO batch_files VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (file_id, tenant, purpose, filename, len(content), now,
                          now + (expires_after or self.limits.default_input_expiry), content))
        return self.file(tenant, file_id)

    @_locked
    def file(self, tenant: str, file_id: str) -> dict[str, Any]:
        row = self._conn.execute("SELECT id, purpose, filename, bytes, created_at, expires_at FROM batch_files "
                                 "WHERE id = ? AND tenant = ? AND (expires_at IS NULL OR expires_at > ?)",
                                 (file_id, tenant, self._now())).fetchone()
        if row is None:
            raise BatchError(404, f"No such File object: {file_id}", "file_not_found", "file_id")
        return file_object(row)

    @_locked
    def file_content(self, tenant: str, file_id: str) -> bytes:
        self.file(tenant, file_id)  # 404 unless it is the tenant's and not expired
        (content,) = self._conn.execute("SELECT content FROM batch_files WHERE id = ?", (file_id,)).fetchone()
        return bytes(content)

    @_locked
    def files(self, tenant: str, purpose: str | None = None, limit: int = 10000, after: str | None = None,
              order: str = "desc") -> dict[str, Any]:
        if order not in ("asc", "desc"):
            raise BatchError(400, "order must be 'asc' or 'desc'", None, "order")
        rows = self._conn.execute(
            "SELECT id, purpose, filename, bytes, created_at, expires_at FROM batch_files WHERE tenant = ? AND "
            "(? IS NULL OR purpose = ?) AND (expires_at IS NULL OR expires_at > ?) "
            f"ORDER BY created_at {order}, rowid {order}", (tenant, purpose, purpose, self._now())).fetchall()
        return page([file_object(r) for r in rows], limit, after)

    @_locked
    def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        self.file(tenant, file_id)
        with self._tx() as conn:
            conn.execute("DELETE FROM batch_files WHERE id = ? AND tenant = ?", (file_id, tenant))
        return {"id": file_id, "object": "file", "deleted": True}

    @_locked
    def sweep_expired_files(self) -> int:
        """Drop expired files' content (they already read as gone); the number dropped."""
        with self._tx() as conn:
            return conn.execute("DELETE FROM batch_files WHERE expires_at IS NOT NULL AND expires_at <= ?",
                                (self._now(),)).rowcount

    # ---- batches --------------------------------------------------------------------------------------
    @_locked
    def create(self, tenant: str, key_id: str, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None = None, output_expires_after: int | None = None) -> dict[str, Any]:
        """A new batch over the tenant's input file. Its lines are checked now: a file with bad lines gives a
        batch in status ``failed`` with the errors (as OpenAI's validation does); a tenant whose unfinished lines
        would pass its quota is refused (429)."""
        if endpoint not in ENDPOINTS:
            raise BatchError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                             None, "endpoint")
        try:
            window = window_seconds(completion_window)
        except ValueError as e:
            raise BatchError(400, str(e), None, "completion_window") from e
        if window > self.limits.max_window_seconds:
            raise BatchError(400, f"completion_window is at most {self.limits.max_window_seconds} s",
                             None, "completion_window")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
            raise BatchError(400, "metadata is at most 16 string pairs (keys <= 64, values <= 512 characters)",
                             None, "metadata")
        info = self.file(tenant, input_file_id)
        if info["purpose"] != "batch":
            raise BatchError(400, f"file {input_file_id} has purpose {info['purpose']!r}, not 'batch'",
                             None, "input_file_id")
        lines, errors = parse_lines(self.file_content(tenant, input_file_id), endpoint, self.limits.max_lines)
        now = self._now()
        batch_id = new_id("batch_")
        with self._tx() as conn:
            if not errors:
                (queued,) = conn.execute(
                    "SELECT count(*) FROM batch_lines l JOIN batches b ON b.id = l.batch_id WHERE b.tenant = ? AND "
                    f"b.status IN {ACTIVE} AND l.state = 'pending'", (tenant,)).fetchone()
                if queued + len(lines) > self.limits.max_queued_lines:
                    raise BatchError(429, f"the tenant has {queued} batch requests unfinished; this batch's "
                                     f"{len(lines)} would pass its quota of {self.limits.max_queued_lines}",
                                     "batch_quota_exceeded")
            status = "failed" if errors else "validating"
            conn.execute("INSERT INTO batches (id, tenant, key_id, endpoint, input_file_id, completion_window, status, "
                         "created_at, expires_at, failed_at, errors, metadata, total, output_expires_seconds) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (batch_id, tenant, key_id, endpoint, input_file_id, completion_window, status, now,
                          now + window, now if errors else None, json.dumps(errors) if errors else None,
                          json.dumps(metadata) if metadata else None, 0 if errors else len(lines),
                          output_expires_after))
            if not errors:
                conn.executemany("INSERT INTO batch_lines (batch_id, idx, custom_id, body) VALUES (?, ?, ?, ?)",
                                 [(batch_id, i, custom_id, body) for i, (custom_id, body) in enumerate(lines)])
        return self.batch(tenant, batch_id)

    @_locked
    def batch(self, tenant: str | None, batch_id: str) -> dict[str, Any]:
        """The batch as OpenAI's Batch object (``tenant`` None: whoever owns it, for the runner)."""
        row = self._conn.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ? AND (? IS NULL OR tenant = ?)",
                                 (batch_id, tenant, tenant)).fetchone()
        if row is None:
            raise BatchError(404, f"No such Batch object: {batch_id}", "batch_not_found", "batch_id")
        return self._batch_object(row)

    @_locked
    def batches(self, tenant: str, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        rows = self._conn.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE tenant = ? "
                                  "ORDER BY created_at DESC, rowid DESC", (tenant,)).fetchall()
        return page([self._batch_object(r) for r in rows], limit, after)

    @_locked
    def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """Ask to cancel: ``cancelling`` now (its runner stops starting lines, aborts the ones running, and
        writes what finished), ``cancelled`` once that is done. A finished batch is refused (409)."""
        with self._tx() as conn:
            row = conn.execute("SELECT status FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant)).fetchone()
            if row is None:
                raise BatchError(404, f"No such Batch object: {batch_id}", "batch_not_found", "batch_id")
            if row[0] in TERMINAL:
                raise BatchError(409, f"Cannot cancel a batch with status '{row[0]}'.")
            conn.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND status IN "
                         "('validating', 'in_progress')", (self._now(), batch_id))
        return self.batch(tenant, batch_id)

    def _batch_object(self, row: tuple) -> dict[str, Any]:
        b = dict(zip(_BATCH_FIELDS, row))
        counts = dict(self._conn.execute("SELECT state, count(*) FROM batch_lines WHERE batch_id = ? GROUP BY state",
                                         (b["id"],)).fetchall())
        expired = b["status"] == "expired"  # its unfinished lines failed with batch_expired
        return {"id": b["id"], "object": "batch", "endpoint": b["endpoint"],
                "errors": {"object": "list", "data": json.loads(b["errors"])} if b["errors"] else None,
                "input_file_id": b["input_file_id"], "completion_window": b["completion_window"],
                "status": b["status"], "output_file_id": b["output_file_id"], "error_file_id": b["error_file_id"],
                "created_at": b["created_at"], "in_progress_at": b["in_progress_at"], "expires_at": b["expires_at"],
                "finalizing_at": b["finalizing_at"], "completed_at": b["completed_at"], "failed_at": b["failed_at"],
                "expired_at": b["expired_at"], "cancelling_at": b["cancelling_at"], "cancelled_at": b["cancelled_at"],
                "request_counts": {"total": b["total"], "completed": counts.get("done", 0),
                                   "failed": counts.get("failed", 0) + (counts.get("pending", 0) if expired else 0)},
                "metadata": json.loads(b["metadata"]) if b["metadata"] else None}

    # ---- the runner's side ----------------------------------------------------------------------------
    @_locked
    def claim(self, owner: str, lease_seconds: float, reclaim_prefix: str | None = None) -> list[str]:
        """Take every active batch whose lease has lapsed (or whose owner starts with ``reclaim_prefix``: this
        gateway's earlier life), oldest first; their ids. A claimed ``validating`` batch is now in progress."""
        now = self.clock()
        if not self._conn.execute(f"SELECT 1 FROM batches WHERE status IN {ACTIVE} AND (owner IS NULL OR lease_until < ? "
                                  "OR ? IS NOT NULL) LIMIT 1", (now, reclaim_prefix)).fetchone():
            return []  # the usual answer, read without taking the write lock the ledger needs
        with self._tx() as conn:
            ids = [r[0] for r in conn.execute(
                f"SELECT id FROM batches WHERE status IN {ACTIVE} AND (owner IS NULL OR lease_until < ? OR "
                "(? IS NOT NULL AND owner != ? AND substr(owner, 1, length(?)) = ?)) ORDER BY created_at, rowid",
                (now, reclaim_prefix, owner, reclaim_prefix or "", reclaim_prefix or "")).fetchall()]
            for batch_id in ids:
                conn.execute("UPDATE batches SET owner = ?, lease_until = ? WHERE id = ?",
                             (owner, now + lease_seconds, batch_id))
                conn.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE id = ? AND "
                             "status = 'validating'", (int(now), batch_id))
        return ids

    @_locked
    def renew(self, owner: str, batch_ids: list[str], lease_seconds: float) -> set[str]:
        """Extend the leases still ours; the ids kept (a batch missing from it was taken over or finished)."""
        kept = set()
        with self._tx() as conn:
            for batch_id in batch_ids:
                if conn.execute(f"UPDATE batches SET lease_until = ? WHERE id = ? AND owner = ? AND status IN {ACTIVE}",
                                (self.clock() + lease_seconds, batch_id, owner)).rowcount:
                    kept.add(batch_id)
        return kept

    @_locked
    def status(self, batch_id: str) -> tuple[str, int, str]:
        """(status, expires_at, tenant) of a batch."""
        row = self._conn.execute("SELECT status, expires_at, tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise BatchError(404, f"No such Batch object: {batch_id}", "batch_not_found")
        return row

    @_locked
    def owner_info(self, batch_id: str) -> tuple[str, str, str]:
        """(tenant, key_id, endpoint) of a batch."""
        return self._conn.execute("SELECT tenant, key_id, endpoint FROM batches WHERE id = ?", (batch_id,)).fetchone()

    @_locked
    def pending(self, batch_id: str) -> list[tuple[int, str, str, int]]:
        """The lines still to run: (index, custom_id, body, attempts so far), in file order."""
        return self._conn.execute("SELECT idx, custom_id, body, attempts FROM batch_lines WHERE batch_id = ? AND "
                                  "state = 'pending' ORDER BY idx", (batch_id,)).fetchall()

    @_locked
    def count_attempt(self, batch_id: str, index: int) -> None:
        with self._tx() as conn:
            conn.execute("UPDATE batch_lines SET attempts = attempts + 1 WHERE batch_id = ? AND idx = ?",
                         (batch_id, index))

    @staticmethod
    def line_guard(owner: str, batch_id: str, index: int, state: str, status_code: int | None,
                   response: dict[str, Any] | None, error: dict[str, Any] | None, request_id: str
                   ) -> tuple[str, tuple]:
        """The statement that lands one line's result: it changes a row only while the line is pending and the
        batch is ``owner``'s, so run in the transaction of the line's ledger record it makes that record land
        exactly once (Ledger.write(record, guard=...))."""
        return ("UPDATE batch_lines SET state = ?, status_code = ?, response = ?, error = ?, request_id = ? "
                "WHERE batch_id = ? AND idx = ? AND state = 'pending' AND "
                "EXISTS (SELECT 1 FROM batches WHERE id = ? AND owner = ?)",
                (state, status_code, json.dumps(response) if response is not None else None,
                 json.dumps(error) if error is not None else None, request_id, batch_id, index, batch_id, owner))

    @_locked
    def finish(self, owner: str, batch_id: str, final: str) -> bool:
        """Write the output and error files and end the batch in ``final`` (completed, expired or cancelled);
        False when the batch is no longer ours. Expired: the lines not run go to the error file as batch_expired;
        cancelled: they are left out. Either way each line not run gets a zero-token ``cancelled`` ledger record,
        so every line has exactly one. The files are built outside the write lock (the ledger shares it); the
        final transaction checks that no line landed meanwhile, and takes the batch from its owner, so none can."""
        if final not in ("completed", "expired", "cancelled"):
            raise ValueError(f"not a final status: {final}")
        with self._tx() as conn:
            row = conn.execute("SELECT tenant, key_id, endpoint, output_expires_seconds FROM batches WHERE id = ? AND "
                               f"owner = ? AND status IN {ACTIVE}", (batch_id, owner)).fetchone()
            if row is None:
                return False
            if final != "cancelled":
                conn.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ?",
                             (self._now(), batch_id))
        tenant, key_id, endpoint, output_expiry = row
        for _ in range(10):  # again if a line landed while the files were built (a shielded write, late)
            now = self._now()
            files, unrun = self._outputs(batch_id, final)
            expires = now + (output_expiry or self.limits.default_output_expiry)
            try:
                with self._tx() as conn:
                    (pending,) = conn.execute("SELECT count(*) FROM batch_lines WHERE batch_id = ? AND "
                                              "state = 'pending'", (batch_id,)).fetchone()
                    if pending != len(unrun):
                        raise _Again
                    ids: list[str | None] = []
                    for kind, content in files:
                        ids.append(None if content is None else new_id("file-"))
                        if content is not None:
                            conn.execute("INSERT INTO batch_files VALUES (?, ?, 'batch_output', ?, ?, ?, ?, ?)",
                                         (ids[-1], tenant, f"{batch_id}_{kind}.jsonl", len(content), now, expires,
                                          content))
                    if not conn.execute(f"UPDATE batches SET status = ?, {final}_at = ?, output_file_id = ?, "
                                        f"error_file_id = ?, owner = NULL WHERE id = ? AND owner = ? AND status IN "
                                        f"{ACTIVE}", (final, now, ids[0], ids[1], batch_id, owner)).rowcount:
                        raise _NotOurs
                    reason = "batch_expired" if final == "expired" else f"batch {final} before the line ran"
                    conn.executemany(INSERT, [UsageRecord(line_id(batch_id, idx), tenant, model, f"batch:{endpoint}",
                                                          "cancelled", key_id, started_at=now, finished_at=now,
                                                          detail=reason).row() for idx, model in unrun])
            except _Again:
                continue
            except _NotOurs:
                return False
            return True
        raise RuntimeError(f"batch {batch_id}: lines kept landing while it was being finished")

    def _outputs(self, batch_id: str, final: str) -> tuple[list[tuple[str, bytes | None]], list[tuple[int, str]]]:
        """The output and error files' contents (None: no such lines) and the lines not run: (index, model)."""
        output: list[str] = []
        errors: list[str] = []
        unrun: list[tuple[int, str]] = []
        for idx, custom_id, body, state, code, response, error, request_id in self._conn.execute(
                "SELECT idx, custom_id, body, state, status_code, response, error, request_id FROM batch_lines "
                "WHERE batch_id = ? ORDER BY idx", (batch_id,)).fetchall():
            if state == "pending":
                unrun.append((idx, str(json.loads(body).get("model", ""))))
                if final != "expired":
                    continue
                error = json.dumps({"code": "batch_expired", "message": "This request could not be executed "
                                    "before the completion window expired."})
            line = {"id": line_id(batch_id, idx), "custom_id": custom_id,
                    "response": ({"status_code": code, "request_id": request_id or line_id(batch_id, idx),
                                  "body": json.loads(response)} if response is not None else None),
                    "error": json.loads(error) if error is not None else None}
            (output if state == "done" and code == 200 else errors).append(json.dumps(line, separators=(",", ":")))
        files = [(kind, ("\n".join(lines) + "\n").encode() if lines else None)
                 for kind, lines in (("output", output), ("error", errors))]
        return files, unrun


_BATCH_FIELDS = ("id", "endpoint", "errors", "input_file_id", "completion_window", "status", "output_file_id",
                 "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                 "failed_at", "expired_at", "cancelling_at", "cancelled_at", "total", "metadata")
_BATCH_COLUMNS = ", ".join(_BATCH_FIELDS)
