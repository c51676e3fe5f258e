"""Stored responses: each response's request, input items, output items and response object, in the usage
ledger's SQLite database (the one the batch tier uses), owned by a tenant.

- Ownership: every read and write names the tenant; another tenant's id is "not found", exactly as an id that
  never existed (nothing says whether it exists).
- Durability: a response is written (synchronous=FULL) before the client is told it is complete, and a background
  response before its id is returned; a gateway killed while a background response ran leaves it ``failed`` with
  the reason, found again by ``recover`` when a gateway of the same id starts.
- Retention: a stored response expires ``days`` after it was made (the tenant's period); ``sweep`` deletes what
  expired. Per tenant a byte quota bounds what is stored: a response that would pass it is served, not stored.
- KV retention bookkeeping: a response whose transcript the engine keeps cached (``retained_tokens`` until
  ``retained_until``) names the replica that holds it (``address``) and the conversation key the engine retains it
  under, so that deleting it (or its expiry) can release the blocks; a later turn of the same conversation
  supersedes the earlier one's retention (the engine re-pins the longer transcript).
- The retention quota (``retention`` table): every request that asks the engine to retain its transcript (a stored
  response, or chat's ``prompt_cache_retention``) reserves its tokens under its retention key (the conversation, or
  the request) before it is sent, in one transaction with the check against the tenant's quota, so concurrent turns
  cannot pass it together; its end settles the figure (tokens and the KV bytes the engine reported retaining). A
  later turn of the same key replaces the earlier one's figure.
- A response being generated holds a lease (``lease_until``) its gateway renews while it runs it; when a gateway
  dies, any gateway sharing the database finds the lapsed leases (``fail_orphans``) and marks those responses
  failed (never ``in_progress`` for good). A cancel or delete made on another gateway is seen by the running one
  (``statuses``), which stops the generation.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL,
    status TEXT NOT NULL, background INTEGER NOT NULL, owner TEXT NOT NULL, previous_id TEXT, root_id TEXT NOT NULL,
    instructions TEXT, input TEXT NOT NULL, output TEXT NOT NULL, object TEXT NOT NULL, bytes INTEGER NOT NULL,
    conversation TEXT NOT NULL DEFAULT '', address TEXT NOT NULL DEFAULT '',
    retained_tokens INTEGER NOT NULL DEFAULT 0, retained_until REAL NOT NULL DEFAULT 0,
    lease_until REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS responses_tenant ON responses (tenant, created_at);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at);
CREATE INDEX IF NOT EXISTS responses_root ON responses (tenant, root_id);
CREATE TABLE IF NOT EXISTS retention (
    tenant TEXT NOT NULL, key TEXT NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL DEFAULT 0,
    until REAL NOT NULL, request TEXT NOT NULL DEFAULT '',
    prev_tokens INTEGER NOT NULL DEFAULT 0, prev_until REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS retention_until ON retention (until);
"""
# columns added after the table's first version: (name, declaration), added to an older database when it is opened
_ADDED_COLUMNS = (("lease_until", "REAL NOT NULL DEFAULT 0"),)
RUNNING = ("queued", "in_progress")
FINISHED = ("completed", "incomplete", "failed", "cancelled")
CONTINUABLE = ("completed", "incomplete")
DEFAULT_DAYS = 30.0  # OpenAI keeps stored responses 30 days


class NotFound(LookupError):
    """No response of this id for this tenant (never made, deleted, expired, another tenant's, or not stored)."""


class Conflict(Exception):
    """The response is not in a state that allows the operation (e.g. cancelling a finished one)."""


@dataclass(frozen=True)
class Stored:
    """A stored response as the gateway reads it back."""

    id: str
    tenant: str
    status: str
    background: bool
    previous_id: str | None
    root_id: str
    instructions: str | None
    input: list[dict[str, Any]]
    output: list[dict[str, Any]]
    object: dict[str, Any]
    conversation: str
    address: str
    retained_tokens: int
    retained_until: float


@dataclass(frozen=True)
class Released:
    """A response's KV retention that no longer holds (deleted, expired): release ``conversation`` on ``address``."""

    address: str
    conversation: str


_COLUMNS = ("id, tenant, status, background, previous_id, root_id, instructions, input, output, object, conversation, "
            "address, retained_tokens, retained_until")


def _row(row: tuple) -> Stored:
    (rid, tenant, status, background, previous, root, instructions, inp, out, obj, conversation, address, tokens,
     until) = row
    return Stored(rid, tenant, status, bool(background), previous, root, instructions, json.loads(inp), json.loads(out),
                  json.loads(obj), conversation, address, tokens, until)


class ResponseStore:
    """Every method is one short transaction (callers run them with ``asyncio.to_thread``); gateways that open the
    same database file share the responses."""

    def __init__(self, path: str | Path, clock: Any = time.time):
        self.path = Path(path)
        self.clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(SCHEMA)
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(responses)")}
        for name, declaration in _ADDED_COLUMNS:
            if name not in columns:
                try:
                    self._conn.execute(f"ALTER TABLE responses ADD COLUMN {name} {declaration}")
                except sqlite3.OperationalError as e:  # another gateway opening the database added it first
                    if "duplicate column" not in str(e):
                        raise
        self._conn.execute("CREATE INDEX IF NOT EXISTS responses_running ON responses (status, lease_until)")
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    # ---- writes ---------------------------------------------------------------------------------------
    def create(self, tenant: str, response_id: str, obj: dict[str, Any], input_items: list[dict[str, Any]],
               previous_id: str | None, root_id: str, instructions: str | None, background: bool, owner: str = "",
               days: float = DEFAULT_DAYS, quota_bytes: int = 0, lease_s: float = 0.0) -> bool:
        """Store a response as it starts (``obj`` with its status). False, and nothing stored, when the tenant's
        ``quota_bytes`` (0: none) cannot hold its input. ``lease_s``: its lease (its owner renews it while it runs
        the response; 0: none, e.g. tests that never run it)."""
        now = self.clock()
        inp, out, body = json.dumps(input_items), "[]", json.dumps(obj)
        size = len(inp) + len(body) + len(instructions or "")
        with self._tx() as conn:
            if quota_bytes:
                used = conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM responses WHERE tenant = ? AND expires_at > ?",
                                    (tenant, now)).fetchone()[0]
                if used + size > quota_bytes:
                    return False
            conn.execute("INSERT INTO responses (id, tenant, created_at, expires_at, status, background, owner, "
                         "previous_id, root_id, instructions, input, output, object, bytes, lease_until) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (response_id, tenant, now, now + days * 86400, obj["status"], int(background), owner,
                          previous_id, root_id, instructions, inp, out, body, size, now + lease_s if lease_s else 0.0))
        return True

    def finish(self, tenant: str, response_id: str, obj: dict[str, Any], output_items: list[dict[str, Any]],
               conversation: str = "", address: str = "", retained_tokens: int = 0, retained_for: float = 0.0
               ) -> bool:
        """Record the response's end (durably: the caller tells the client only after). A response cancelled in the
        meantime stays cancelled (False). Its bytes are counted again whole: input, instructions, output and the
        response object (which repeats the output). With ``retained_tokens``, the engine keeps the transcript cached for
        ``retained_for`` seconds on ``address`` under ``conversation``; earlier turns of the conversation no longer
        count (their transcript is part of this one)."""
        now = self.clock()
        out, body = json.dumps(output_items), json.dumps(obj)
        with self._tx() as conn:
            row = conn.execute("SELECT status, root_id, length(input) + length(COALESCE(instructions, '')) "
                               "FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant)).fetchone()
            if row is None or row[0] == "cancelled":
                return False
            conn.execute("UPDATE responses SET status = ?, output = ?, object = ?, bytes = ?, conversation = ?, "
                         "address = ?, retained_tokens = ?, retained_until = ? WHERE id = ?",
                         (obj["status"], out, body, row[2] + len(out) + len(body), conversation, address,
                          retained_tokens, now + retained_for if retained_tokens else 0.0, response_id))
            if retained_tokens:
                conn.execute("UPDATE responses SET retained_tokens = 0, retained_until = 0 "
                             "WHERE tenant = ? AND root_id = ? AND id != ?", (tenant, row[1], response_id))
        return True

    def cancel(self, tenant: str, response_id: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Cancel a background response still running: Conflict when it already finished, ValueError when it is not
        a background response."""
        with self._tx() as conn:
            row = conn.execute("SELECT status, background FROM responses WHERE id = ? AND tenant = ? AND expires_at > ?",
                               (response_id, tenant, self.clock())).fetchone()
            if row is None:
                raise NotFound(response_id)
            if not row[1]:
                raise ValueError("only background responses can be cancelled")
            if row[0] in FINISHED:
                raise Conflict(f"cannot cancel a response that is {row[0]}")
            conn.execute("UPDATE responses SET status = 'cancelled', object = ? WHERE id = ?",
                         (json.dumps(obj), response_id))
        return obj

    def delete(self, tenant: str, response_id: str) -> Released | None:
        """Delete a response and its items; what its KV retention held, to release (None: nothing held)."""
        with self._tx() as conn:
            row = conn.execute("SELECT address, conversation, retained_until FROM responses "
                               "WHERE id = ? AND tenant = ? AND expires_at > ?",
                               (response_id, tenant, self.clock())).fetchone()
            if row is None:
                raise NotFound(response_id)
            conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            address, conversation, until = row
            held = bool(address and conversation and until > self.clock())
            if held:
                conn.execute("DELETE FROM retention WHERE tenant = ? AND key = ?", (tenant, conversation))
        return Released(address, conversation) if held else None

    def recover(self, owner: str) -> int:
        """Responses this gateway (``owner``) was generating when it stopped: failed, with the reason. Returns how
        many."""
        return self._fail_running("owner = ?", (owner,))

    def fail_orphans(self) -> int:
        """Responses whose gateway stopped renewing their lease (it died, or lost the database): failed, with the
        reason. Any gateway may call it. Returns how many."""
        return self._fail_running("lease_until > 0 AND lease_until < ?", (self.clock(),))

    def _fail_running(self, where: str, args: tuple) -> int:
        with self._tx() as conn:
            rows = conn.execute(f"SELECT id, object FROM responses WHERE status IN ({', '.join('?' * len(RUNNING))}) "
                                f"AND {where}", (*RUNNING, *args)).fetchall()
            for rid, obj in rows:
                body = json.loads(obj)
                body["status"] = "failed"
                body["error"] = {"code": "server_error", "message": "the gateway stopped before the response finished"}
                conn.execute("UPDATE responses SET status = 'failed', object = ? WHERE id = ?", (json.dumps(body), rid))
        return len(rows)

    def renew(self, owner: str, response_ids: list[str], lease_s: float) -> None:
        """Extend the leases of the responses ``owner`` is generating."""
        if not response_ids:
            return
        marks = ", ".join("?" * len(response_ids))
        with self._tx() as conn:
            conn.execute(f"UPDATE responses SET lease_until = ? WHERE owner = ? AND id IN ({marks})",
                         (self.clock() + lease_s, owner, *response_ids))

    def statuses(self, response_ids: list[str]) -> dict[str, str]:
        """The stored status of each of ``response_ids`` that still exists (a deleted or expired one is missing):
        how a gateway running background responses learns that another gateway cancelled or deleted one."""
        if not response_ids:
            return {}
        marks = ", ".join("?" * len(response_ids))
        with self._lock:
            rows = self._conn.execute(f"SELECT id, status FROM responses WHERE id IN ({marks}) AND expires_at > ?",
                                      (*response_ids, self.clock())).fetchall()
        return dict(rows)

    # ---- the retention quota --------------------------------------------------------------------------
    def reserve_retention(self, tenant: str, key: str, tokens: int, seconds: float, quota_tokens: int = 0,
                          request: str = "") -> bool:
        """Before a request that asks the engine to retain its transcript is sent: count its ``tokens`` (prompt and
        the most it may generate) against the tenant's ``quota_tokens`` (0: none) for ``seconds``, under ``key``
        (its conversation, or the request), replacing that key's earlier figure (kept aside: ``abandon_retention``
        puts it back) and marked as ``request``'s. False, and nothing counted, when the tenant's other retained
        transcripts leave no room."""
        now = self.clock()
        with self._tx() as conn:
            if quota_tokens:
                used = conn.execute("SELECT COALESCE(SUM(tokens), 0) FROM retention WHERE tenant = ? AND key != ? "
                                    "AND until > ?", (tenant, key, now)).fetchone()[0]
                if used + tokens > quota_tokens:
                    return False
            conn.execute("INSERT INTO retention (tenant, key, tokens, bytes, until, request) VALUES (?, ?, ?, 0, ?, ?) "
                         "ON CONFLICT (tenant, key) DO UPDATE SET prev_tokens = CASE WHEN until > ? THEN tokens ELSE 0 "
                         "END, prev_until = CASE WHEN until > ? THEN until ELSE 0 END, tokens = excluded.tokens, "
                         "until = excluded.until, request = excluded.request",
                         (tenant, key, tokens, now + seconds, request, now, now))
        return True

    def settle_retention(self, tenant: str, key: str, tokens: int, kv_bytes: int, seconds: float = 0.0,
                         request: str = "") -> None:
        """``request`` completed: the engine retains ``tokens`` (prompt and output) in ``kv_bytes`` of KV under
        ``key`` for ``seconds`` from now (0 bytes: it retained nothing, and the key's figure goes). A no-op when a
        later request of the key reserved it since (its figure stands)."""
        with self._tx() as conn:
            if kv_bytes:
                conn.execute("INSERT INTO retention (tenant, key, tokens, bytes, until, request) VALUES (?, ?, ?, ?, ?, ?) "
                             "ON CONFLICT (tenant, key) DO UPDATE SET tokens = excluded.tokens, bytes = excluded.bytes, "
                             "until = MAX(until, excluded.until) WHERE request = excluded.request",
                             (tenant, key, tokens, kv_bytes, self.clock() + seconds, request))
            else:
                conn.execute("DELETE FROM retention WHERE tenant = ? AND key = ? AND request = ?", (tenant, key, request))

    def abandon_retention(self, tenant: str, key: str, request: str = "") -> None:
        """``request`` did not complete (refused, failed, cut): its reservation goes, and the key's earlier figure
        (a previous turn the engine still retains) comes back while its window lasts. A no-op when a later request
        of the key reserved it since."""
        with self._tx() as conn:
            conn.execute("UPDATE retention SET tokens = prev_tokens, until = prev_until, prev_tokens = 0, "
                         "prev_until = 0, request = '' WHERE tenant = ? AND key = ? AND request = ? AND prev_until > ?",
                         (tenant, key, request, self.clock()))
            conn.execute("DELETE FROM retention WHERE tenant = ? AND key = ? AND request = ?", (tenant, key, request))

    def end_retention(self, tenant: str, key: str) -> None:
        """The retention under ``key`` was released (its response deleted)."""
        with self._tx() as conn:
            conn.execute("DELETE FROM retention WHERE tenant = ? AND key = ?", (tenant, key))

    def sweep(self) -> list[Released]:
        """Delete expired responses; the retention each still held, to release."""
        now = self.clock()
        with self._tx() as conn:
            rows = conn.execute("SELECT tenant, address, conversation, retained_until FROM responses "
                                "WHERE expires_at <= ?", (now,)).fetchall()
            conn.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
            released = [(t, a, c) for t, a, c, until in rows if a and c and until > now]
            conn.executemany("DELETE FROM retention WHERE tenant = ? AND key = ?", [(t, c) for t, _, c in released])
            conn.execute("DELETE FROM retention WHERE until <= ?", (now,))
        return [Released(a, c) for _, a, c in released]

    # ---- reads ----------------------------------------------------------------------------------------
    def get(self, tenant: str, response_id: str) -> Stored:
        with self._lock:
            row = self._conn.execute(f"SELECT {_COLUMNS} FROM responses WHERE id = ? AND tenant = ? AND expires_at > ?",
                                     (response_id, tenant, self.clock())).fetchone()
        if row is None:
            raise NotFound(response_id)
        return _row(row)

    def chain(self, tenant: str, response_id: str, limit: int = 10_000) -> list[Stored]:
        """The conversation up to ``response_id``: its responses, oldest first. NotFound when any of them is
        missing (deleted, expired) or not the tenant's."""
        chain: list[Stored] = []
        current: str | None = response_id
        while current is not None and len(chain) < limit:
            stored = self.get(tenant, current)
            chain.append(stored)
            current = stored.previous_id
        chain.reverse()
        return chain

    def input_items(self, tenant: str, response_id: str, after: str | None = None, limit: int = 20,
                    order: str = "desc") -> dict[str, Any]:
        """OpenAI's list of a response's input items (this request's own), a page of ``limit`` after ``after``."""
        items = self.get(tenant, response_id).input
        if order == "desc":
            items = list(reversed(items))
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise NotFound(after)
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def retained_tokens(self, tenant: str) -> int:
        """Transcript tokens the tenant's requests keep retained now (the retention quota's use)."""
        with self._lock:
            return self._conn.execute("SELECT COALESCE(SUM(tokens), 0) FROM retention WHERE tenant = ? AND until > ?",
                                      (tenant, self.clock())).fetchone()[0]

    def usage(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return _usage(self._conn, self.clock())


def _usage(conn: sqlite3.Connection, now: float, retention: bool = True) -> dict[str, dict[str, int]]:
    """Per tenant: stored responses and their bytes; transcript tokens retained in the engines' KV now, and the KV
    bytes the engines reported retaining for them."""
    out: dict[str, dict[str, int]] = {}
    for tenant, n, b in conn.execute("SELECT tenant, COUNT(*), SUM(bytes) FROM responses WHERE expires_at > ? "
                                     "GROUP BY tenant", (now,)):
        out[tenant] = {"responses": n, "bytes": b or 0, "retained_tokens": 0, "retained_bytes": 0}
    rows = conn.execute("SELECT tenant, SUM(tokens), SUM(bytes) FROM retention WHERE until > ? GROUP BY tenant",
                        (now,)) if retention else ()  # a database from before retention was counted: none
    for tenant, tokens, kv in rows:
        row = out.setdefault(tenant, {"responses": 0, "bytes": 0, "retained_tokens": 0, "retained_bytes": 0})
        row.update(retained_tokens=tokens or 0, retained_bytes=kv or 0)
    return out


def usage(path: str | Path, clock: Any = time.time) -> dict[str, dict[str, int]]:
    """``ResponseStore.usage`` of the database at ``path`` (the `tokenfleet usage` report), read-only: {} when it
    holds no responses (never created, or from before the Responses API)."""
    if not Path(path).exists():
        return {}
    conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=30)
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "responses" not in tables:
            return {}
        return _usage(conn, clock(), retention="retention" in tables)
    finally:
        conn.close()
