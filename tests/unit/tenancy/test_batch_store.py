"""The batch tier's store (tokenfleet.batch.store) on a real SQLite file, with the real ledger: files, validation,
quotas, leases, exactly-once results, the output and error files, cancel, expiry."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenfleet.batch.formats import BatchError, Limits, line_id, parse_lines, window_seconds
from tokenfleet.batch.store import BatchStore
from tokenfleet.tenancy.ledger import Ledger, UsageRecord, records

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def jsonl(n: int, url: str = CHAT) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                               "body": {"model": "m", "messages": [{"role": "user", "content": str(i)}]}}) + "\n"
                   for i in range(n)).encode()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path, clock) -> BatchStore:
    s = BatchStore(tmp_path / "ledger.sqlite3", Limits(max_file_bytes=10_000, max_lines=50, max_queued_lines=60),
                   clock=clock)
    yield s
    s.close()


def test_files_belong_to_their_tenant_and_expire(store, clock):
    f = store.add_file("alpha", "batch", "in.jsonl", jsonl(2), expires_after=3600)
    assert f["object"] == "file" and f["bytes"] == len(jsonl(2)) and f["expires_at"] == int(clock.now) + 3600
    assert store.file_content("alpha", f["id"]) == jsonl(2)
    with pytest.raises(BatchError) as e:
        store.file("beta", f["id"])  # another tenant's file does not exist for it
    assert e.value.status == 404
    assert [x["id"] for x in store.files("alpha")["data"]] == [f["id"]] and store.files("beta")["data"] == []
    clock.now += 3600
    with pytest.raises(BatchError):
        store.file("alpha", f["id"])
    assert store.sweep_expired_files() == 1


def test_uploads_are_checked(store):
    with pytest.raises(BatchError) as e:
        store.add_file("alpha", "batch", "big.jsonl", b"x" * 10_001)
    assert e.value.status == 413
    with pytest.raises(BatchError) as e:
        store.add_file("alpha", "fine-tune", "a.jsonl", b"{}")
    assert e.value.param == "purpose"
    with pytest.raises(BatchError):
        store.add_file("alpha", "batch", "a.csv", b"{}")
    f = store.add_file("alpha", "batch", "a.jsonl", b"{}\n")
    assert store.delete_file("alpha", f["id"])["deleted"] is True
    with pytest.raises(BatchError):
        store.file_content("alpha", f["id"])


def test_bad_lines_fail_the_batch_with_their_line_numbers(store):
    bad = (jsonl(1) + b"not json\n" + jsonl(1)  # a repeated custom_id too
           + json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {}}).encode() + b"\n"
           + json.dumps({"custom_id": "y", "url": CHAT, "body": {"stream": True}}).encode() + b"\n")
    f = store.add_file("alpha", "batch", "in.jsonl", bad)
    b = store.create("alpha", "k", f["id"], CHAT, "24h")
    assert b["status"] == "failed" and b["failed_at"] is not None
    codes = [(e["code"], e["line"]) for e in b["errors"]["data"]]
    assert codes == [("invalid_json_line", 2), ("duplicate_custom_id", 3), ("invalid_url", 4), ("invalid_request", 5)]


def test_parse_and_windows():
    lines, errors = parse_lines(jsonl(3) + b"\n", CHAT, 10)
    assert errors == [] and [c for c, _ in lines] == ["r0", "r1", "r2"]
    assert parse_lines(jsonl(3), CHAT, 2)[1][0]["code"] == "too_many_lines"
    assert parse_lines(b"", CHAT, 2)[1][0]["code"] == "empty_file"
    assert window_seconds("24h") == 86400 and window_seconds("90s") == 90
    for bad in ("24", "0h", "1w", ""):
        with pytest.raises(ValueError):
            window_seconds(bad)


def test_a_tenants_unfinished_lines_are_bounded(store):
    f = store.add_file("alpha", "batch", "in.jsonl", jsonl(40))
    store.create("alpha", "k", f["id"], CHAT, "24h")
    with pytest.raises(BatchError) as e:
        store.create("alpha", "k", f["id"], CHAT, "24h")  # 80 > 60
    assert e.value.status == 429 and e.value.code == "batch_quota_exceeded"
    g = store.add_file("beta", "batch", "in.jsonl", jsonl(40))
    assert store.create("beta", "k", g["id"], CHAT, "24h")["status"] == "validating"  # quotas are per tenant


def test_a_line_lands_once_with_its_charge_and_only_from_the_owner(tmp_path, store):
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    f = store.add_file("alpha", "batch", "in.jsonl", jsonl(3))
    b = store.create("alpha", "k", f["id"], CHAT, "24h")
    assert store.claim("gw-a/1", 30) == [b["id"]]
    assert store.batch("alpha", b["id"])["status"] == "in_progress"
    assert store.claim("gw-b/1", 30) == []  # the lease is held

    async def land(owner: str, index: int) -> bool:
        rid = line_id(b["id"], index)
        guard = store.line_guard(owner, b["id"], index, "done", 200, {"id": rid, "choices": []}, None, rid)
        return await ledger.write(UsageRecord(rid, "alpha", "m", "batch:" + CHAT, prompt_tokens=5), guard)

    async def scenario() -> list[bool]:
        return [await land("gw-a/1", 0), await land("gw-a/1", 0), await land("gw-b/1", 1)]

    assert asyncio.run(scenario()) == [True, False, False]  # once; a second run and a non-owner land nothing
    # the owner dies; a restarted life of the same gateway takes its batch back at once
    assert store.claim("gw-a/2", 30, reclaim_prefix="gw-a/") == [b["id"]]
    assert asyncio.run(land("gw-a/1", 1)) is False  # the dead life's late result is refused
    assert asyncio.run(land("gw-a/2", 1)) is True and asyncio.run(land("gw-a/2", 2)) is True
    assert store.pending(b["id"]) == []
    assert store.finish("gw-a/2", b["id"], "completed")
    done = store.batch("alpha", b["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    output = [json.loads(x) for x in store.file_content("alpha", done["output_file_id"]).decode().splitlines()]
    assert [o["custom_id"] for o in output] == ["r0", "r1", "r2"]
    assert output[0]["response"]["status_code"] == 200 and output[0]["id"] == line_id(b["id"], 0)
    assert done["error_file_id"] is None
    ledger.close()
    charged = [r.request_id for r in records(tmp_path / "ledger.sqlite3")]
    assert sorted(charged) == sorted(line_id(b["id"], i) for i in range(3))


def test_a_lapsed_lease_passes_to_another_gateway(store, clock):
    f = store.add_file("alpha", "batch", "in.jsonl", jsonl(1))
    b = store.create("alpha", "k", f["id"], CHAT, "24h")
    assert store.claim("gw-a/1", 30) == [b["id"]]
    clock.now += 10
    assert store.renew("gw-a/1", [b["id"]], 30) == {b["id"]}
    clock.now += 31
    assert store.claim("gw-b/1", 30) == [b["id"]]
    assert store.renew("gw-a/1", [b["id"]], 30) == set()  # lost: the old owner stops


def test_expiry_and_cancel_write_what_finished(store, clock):
    f = store.add_file("alpha", "batch", "in.jsonl", jsonl(3))
    b = store.create("alpha", "k", f["id"], CHAT, "60s", metadata={"job": "nightly"}, output_expires_after=7200)
    store.claim("gw/1", 30)
    rid = line_id(b["id"], 1)
    conn_guard = store.line_guard("gw/1", b["id"], 1, "failed", 400, {"error": {"message": "bad"}}, None, rid)
    ledger = Ledger(store.path)
    assert asyncio.run(ledger.write(UsageRecord(rid, "alpha", "m", "batch:" + CHAT, "rejected"), conn_guard))
    ledger.close()
    assert store.finish("gw/1", b["id"], "expired")
    expired = store.batch("alpha", b["id"])
    assert expired["status"] == "expired" and expired["metadata"] == {"job": "nightly"}
    assert expired["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    errors = [json.loads(x) for x in store.file_content("alpha", expired["error_file_id"]).decode().splitlines()]
    assert [(e["custom_id"], (e["error"] or {}).get("code"), (e["response"] or {}).get("status_code"))
            for e in errors] == [("r0", "batch_expired", None), ("r1", None, 400), ("r2", "batch_expired", None)]
    assert store.file("alpha", expired["error_file_id"])["expires_at"] == int(clock.now) + 7200
    # every line has one ledger record: the one that ran its own, the two never run a zero-token `cancelled` one
    kept = {r.request_id: (r.status, r.detail) for r in records(store.path)}
    assert kept == {line_id(b["id"], 0): ("cancelled", "batch_expired"), line_id(b["id"], 1): ("rejected", ""),
                    line_id(b["id"], 2): ("cancelled", "batch_expired")}
    with pytest.raises(BatchError) as e:
        store.cancel("alpha", b["id"])
    assert e.value.status == 409

    g = store.add_file("alpha", "batch", "in2.jsonl", jsonl(2))
    c = store.create("alpha", "k", g["id"], CHAT, "24h")
    assert store.cancel("alpha", c["id"])["status"] == "cancelling"
    assert c["id"] in store.claim("gw/1", 30)  # a runner finishes the cancel
    assert store.finish("gw/1", c["id"], "cancelled")
    cancelled = store.batch("alpha", c["id"])
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] is not None
    assert cancelled["output_file_id"] is None and cancelled["error_file_id"] is None
    listed = store.batches("alpha", limit=1)
    assert listed["data"][0]["id"] == c["id"] and listed["has_more"] is True
    assert store.batches("alpha", limit=5, after=c["id"])["data"][0]["id"] == b["id"]
