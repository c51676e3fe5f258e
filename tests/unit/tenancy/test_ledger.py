"""The SQLite usage ledger: durable writes, group commit, the per-day report."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from tokenfleet.tenancy.ledger import Ledger, UsageRecord, format_report, records, report

DAY = 1_795_000_000.0  # a fixed timestamp


def rec(i: int, tenant: str = "acme", status: str = "ok", **kw) -> UsageRecord:
    return UsageRecord(request_id=f"r{i}", tenant=tenant, model="smol", endpoint="chat", status=status,
                       prompt_tokens=10, cached_tokens=4, completion_tokens=5, duration_ms=12.0,
                       started_at=DAY, finished_at=DAY + i, **kw)


def test_concurrent_writes_are_all_durable_and_share_commits(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite3")

    async def many() -> None:
        await asyncio.gather(*(ledger.write(rec(i)) for i in range(200)))

    asyncio.run(many())
    # another connection (another process would do the same) sees every record once it was awaited
    assert [r.request_id for r in records(tmp_path / "ledger.sqlite3")] == [f"r{i}" for i in range(200)]
    assert ledger.num_commits < 200  # group commit
    with sqlite3.connect(tmp_path / "ledger.sqlite3") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    ledger.close()


def test_report_per_tenant_model_day_in_table_and_csv(tmp_path):
    ledger = Ledger(tmp_path / "l.db")
    for future in [ledger.submit(rec(1)), ledger.submit(rec(2, status="rejected", detail="over budget")),
                   ledger.submit(rec(3, tenant="beta", status="cancelled"))]:
        future.result(timeout=10)
    rows = report(tmp_path / "l.db")
    assert [(r["tenant"], r["requests"], r["ok"], r["rejected"], r["cancelled"], r["prompt_tokens"]) for r in rows] == [
        ("acme", 2, 1, 1, 0, 20), ("beta", 1, 0, 0, 1, 10)]
    assert report(tmp_path / "l.db", tenant="beta")[0]["completion_tokens"] == 5
    csv_text = format_report(rows, "csv")
    assert csv_text.splitlines()[0].startswith("day,tenant,model,requests")
    assert "acme" in format_report(rows, "table")
    ledger.close()


def test_bad_status_is_refused():
    with pytest.raises(ValueError, match="status"):
        rec(1, status="great")


def test_a_ledger_from_before_the_model_router_gains_the_requested_model_column(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as conn:  # the schema as it was: no requested_model
        conn.execute("CREATE TABLE usage (id INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL, tenant TEXT "
                     "NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL, endpoint TEXT NOT NULL, status TEXT NOT NULL, "
                     "prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
                     "ttft_ms REAL, duration_ms REAL NOT NULL, started_at REAL NOT NULL, finished_at REAL NOT NULL, "
                     "detail TEXT NOT NULL)")
        conn.execute("INSERT INTO usage (request_id, tenant, key_id, model, endpoint, status, prompt_tokens, cached_tokens, "
                     "completion_tokens, ttft_ms, duration_ms, started_at, finished_at, detail) VALUES ('old', 't', '', "
                     "'m', 'chat', 'ok', 1, 0, 1, 1.0, 2.0, 1.0, 2.0, '')")
    ledger = Ledger(path)
    asyncio.run(ledger.write(UsageRecord("new", "t", "small", "chat", finished_at=3.0, requested_model="auto")))
    ledger.close()
    assert [(r.request_id, r.model, r.requested_model) for r in records(path)] == [("old", "m", ""), ("new", "small", "auto")]


def test_a_writer_whose_caller_stopped_waiting_keeps_writing(tmp_path):
    """A request cancelled while its record is being written (a client gone at its last chunk) cancels the
    future the writer will resolve: the record is still written and later writes still complete."""
    ledger = Ledger(tmp_path / "l.sqlite3")

    async def scenario() -> None:
        first = asyncio.ensure_future(ledger.write(rec(1)))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.wait_for(asyncio.gather(*(ledger.write(rec(i)) for i in range(2, 40))), 30)

    asyncio.run(scenario())
    ledger.close()
    assert ledger._thread.is_alive() is False  # closed, not died: every record made it
    assert sorted(r.request_id for r in records(tmp_path / "l.sqlite3")) == sorted(f"r{i}" for i in range(1, 40))


def test_a_ledger_that_cannot_be_written_withholds_the_result_and_refuses_new_requests_until_it_can(tmp_path):
    """A full disk (here: the table gone, the same sqlite3.Error): the request that finished is not returned as if
    billed (503 ledger_unavailable), new ones are refused before they run, and a commit that succeeds again clears it."""
    from tokenfleet.api.openai_schema import APIError
    from tokenfleet.tenancy.admission import Admission, Caller
    from tokenfleet.tenancy.tenants import Tenant

    path = tmp_path / "l.sqlite3"
    ledger = Ledger(path)
    admission = Admission(ledger=ledger)
    caller = Caller(Tenant("t"), "k")
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE usage RENAME TO usage_away")
    ticket = admission.admit(caller, "smol", "/v1/chat/completions", "r1", 5, 10)
    with pytest.raises(APIError) as withheld:
        asyncio.run(ticket.finish("ok", 5, 0, 3, None))
    assert withheld.value.status == 503 and withheld.value.code == "ledger_unavailable"
    assert ledger.failing(60) and not ledger.failing(0)
    with pytest.raises(APIError) as refused:
        admission.precheck(caller, "r2", "/v1/chat/completions")
    assert refused.value.status == 503 and refused.value.headers["retry-after"] == "2"
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE usage_away RENAME TO usage")
    asyncio.run(ledger.write(rec(3)))
    assert not ledger.failing(60)
    admission.precheck(caller, "r4", "/v1/chat/completions")  # admitted again
    assert [r.request_id for r in records(path)] == ["r3"]
    ledger.close()
