"""Stored responses: ownership, chains, quotas, expiry, cancellation, recovery after a gateway stopped; the
retention quota's reservations."""

from __future__ import annotations

import sqlite3

import pytest

from tokenfleet.responses.store import Conflict, NotFound, Released, ResponseStore, usage


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def obj(status: str = "in_progress") -> dict:
    return {"status": status, "output": []}


def items(text: str) -> list[dict]:
    return [{"id": f"msg_{text}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


@pytest.fixture
def store(tmp_path):
    clock = Clock()
    s = ResponseStore(tmp_path / "ledger.sqlite3", clock=clock)
    s.clock = clock
    yield s
    s.close()


def test_a_response_is_its_tenants_alone(store):
    assert store.create("alice", "resp_1", obj(), items("hi"), None, "resp_1", None, False)
    assert store.get("alice", "resp_1").input == items("hi")
    for attempt in (lambda: store.get("bob", "resp_1"), lambda: store.delete("bob", "resp_1"),
                    lambda: store.input_items("bob", "resp_1"), lambda: store.chain("bob", "resp_1")):
        with pytest.raises(NotFound):
            attempt()
    assert store.get("alice", "resp_1").id == "resp_1"  # bob's delete removed nothing


def test_a_chain_is_read_oldest_first_and_breaks_when_a_link_is_gone(store):
    store.create("a", "r1", obj(), items("1"), None, "r1", None, False)
    store.finish("a", "r1", obj("completed"), [{"id": "fc_1", "type": "function_call"}])
    store.create("a", "r2", obj(), items("2"), "r1", "r1", None, False)
    store.finish("a", "r2", obj("completed"), [])
    chain = store.chain("a", "r2")
    assert [s.id for s in chain] == ["r1", "r2"] and chain[0].output == [{"id": "fc_1", "type": "function_call"}]
    store.delete("a", "r1")
    with pytest.raises(NotFound):
        store.chain("a", "r2")


def test_the_byte_quota_refuses_to_store_and_stores_nothing(store):
    assert not store.create("a", "big", obj(), items("x" * 500), None, "big", None, False, quota_bytes=100)
    with pytest.raises(NotFound):
        store.get("a", "big")
    assert store.create("a", "small", obj(), items("x"), None, "small", None, False, quota_bytes=1000)


def test_expired_responses_are_gone_and_the_sweep_releases_their_retention(store):
    store.create("a", "r1", obj(), items("1"), None, "r1", None, False, days=1)
    assert store.reserve_retention("a", "c1", 60, 2 * 86400)
    store.finish("a", "r1", obj("completed"), [], conversation="c1", address="w:1", retained_tokens=50,
                 retained_for=2 * 86400)
    store.settle_retention("a", "c1", 50, 4096)
    assert store.retained_tokens("a") == 50
    store.clock.now += 86400 + 1
    with pytest.raises(NotFound):
        store.get("a", "r1")
    assert store.sweep() == [Released("w:1", "c1")]
    assert store.usage() == {}


def test_a_later_turn_supersedes_the_earlier_turns_retention(store):
    store.create("a", "r1", obj(), items("1"), None, "r1", None, False)
    store.finish("a", "r1", obj("completed"), [], "c", "w:1", retained_tokens=100, retained_for=300)
    store.create("a", "r2", obj(), items("2"), "r1", "r1", None, False)
    store.finish("a", "r2", obj("completed"), [], "c", "w:1", retained_tokens=150, retained_for=300)
    assert store.reserve_retention("a", "c", 150, 300)
    assert store.delete("a", "r2") == Released("w:1", "c")
    assert store.retained_tokens("a") == 0  # released: no longer counted
    store.clock.now += 301
    assert store.delete("a", "r1") is None  # its retention lapsed: nothing to release


def test_cancel_is_for_running_background_responses(store):
    store.create("a", "bg", obj(), items("1"), None, "bg", None, True, owner="gw")
    store.create("a", "fg", obj(), items("1"), None, "fg", None, False, owner="gw")
    with pytest.raises(ValueError):
        store.cancel("a", "fg", obj("cancelled"))
    store.cancel("a", "bg", obj("cancelled"))
    assert not store.finish("a", "bg", obj("completed"), [])  # cancelled stays cancelled
    assert store.get("a", "bg").status == "cancelled"
    with pytest.raises(Conflict):
        store.cancel("a", "bg", obj("cancelled"))


def test_a_restarted_gateway_fails_the_background_responses_it_was_running(store):
    store.create("a", "bg", obj(), items("1"), None, "bg", None, True, owner="gw-1")
    store.create("a", "other", obj(), items("1"), None, "other", None, True, owner="gw-2")
    assert store.recover("gw-1") == 1
    failed = store.get("a", "bg")
    assert failed.status == "failed" and failed.object["error"]["code"] == "server_error"
    assert store.get("a", "other").status == "in_progress"


def test_input_items_pages(store):
    many = [{"id": f"msg_{i}", "type": "message"} for i in range(5)]
    store.create("a", "r", obj(), many, None, "r", None, False)
    page = store.input_items("a", "r", limit=2, order="asc")
    assert [i["id"] for i in page["data"]] == ["msg_0", "msg_1"] and page["has_more"]
    rest = store.input_items("a", "r", after="msg_1", limit=10, order="asc")
    assert [i["id"] for i in rest["data"]] == ["msg_2", "msg_3", "msg_4"] and not rest["has_more"]
    assert store.input_items("a", "r")["first_id"] == "msg_4"  # newest first by default


def test_a_finished_response_counts_its_output_and_object(store):
    store.create("a", "r", obj(), items("x"), None, "r", "be brief", False)
    before = store.usage()["a"]["bytes"]
    store.finish("a", "r", {"status": "completed", "output": ["y" * 1000]}, [{"text": "y" * 1000}])
    assert store.usage()["a"]["bytes"] >= before + 2000  # the output, and the object that repeats it


def test_the_retention_quota_is_reserved_with_its_check(store):
    assert store.reserve_retention("a", "c1", 100, 300, quota_tokens=200)
    assert not store.reserve_retention("a", "c2", 150, 300, quota_tokens=200)  # 100 + 150 > 200: nothing counted
    assert store.retained_tokens("a") == 100
    assert store.reserve_retention("a", "c1", 180, 300, quota_tokens=200)  # a later turn replaces its own figure
    assert store.reserve_retention("b", "c2", 150, 300, quota_tokens=200)  # another tenant's quota is its own
    store.settle_retention("a", "c1", 120, 8192)
    assert store.usage()["a"] == {"responses": 0, "bytes": 0, "retained_tokens": 120, "retained_bytes": 8192}
    store.settle_retention("b", "c2", 150, 0)  # the engine retained nothing
    assert "b" not in store.usage()
    store.clock.now += 301  # the window passed: no longer counted, and swept
    assert store.retained_tokens("a") == 0 and store.reserve_retention("a", "c2", 190, 300, quota_tokens=200)
    store.sweep()
    assert store.usage()["a"]["retained_tokens"] == 190


def test_a_gateway_that_stops_renewing_its_leases_has_its_responses_failed(store):
    store.create("a", "mine", obj(), items("1"), None, "mine", None, True, owner="gw-1", lease_s=30)
    store.create("a", "dead", obj(), items("1"), None, "dead", None, False, owner="gw-2", lease_s=30)
    store.create("a", "unleased", obj(), items("1"), None, "unleased", None, False, owner="gw-3")
    store.clock.now += 20
    store.renew("gw-1", ["mine"], 30)
    store.renew("gw-1", ["dead"], 30)  # not its own: untouched
    store.clock.now += 20
    assert store.fail_orphans() == 1
    assert store.get("a", "dead").status == "failed"
    assert store.get("a", "mine").status == "in_progress" and store.get("a", "unleased").status == "in_progress"


def test_statuses_show_a_cancel_or_delete_made_elsewhere(store):
    for rid in ("r1", "r2", "r3"):
        store.create("a", rid, obj(), items("1"), None, rid, None, True, owner="gw-1")
    store.cancel("a", "r1", obj("cancelled"))
    store.delete("a", "r2")
    assert store.statuses(["r1", "r2", "r3"]) == {"r1": "cancelled", "r3": "in_progress"}


def test_the_usage_report_reads_without_writing(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    sqlite3.connect(path).execute("CREATE TABLE usage (x)").connection.close()  # a ledger from before responses
    assert usage(path) == {}
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"usage"}


def test_an_older_database_gains_the_lease_column(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL, "
                 "expires_at REAL NOT NULL, status TEXT NOT NULL, background INTEGER NOT NULL, owner TEXT NOT NULL, "
                 "previous_id TEXT, root_id TEXT NOT NULL, instructions TEXT, input TEXT NOT NULL, output TEXT NOT NULL, "
                 "object TEXT NOT NULL, bytes INTEGER NOT NULL, conversation TEXT NOT NULL DEFAULT '', "
                 "address TEXT NOT NULL DEFAULT '', retained_tokens INTEGER NOT NULL DEFAULT 0, "
                 "retained_until REAL NOT NULL DEFAULT 0)")
    conn.commit()
    conn.close()
    store = ResponseStore(path)
    try:
        assert store.create("a", "r", obj(), items("1"), None, "r", None, True, owner="gw", lease_s=30)
        assert store.get("a", "r").status == "in_progress"
    finally:
        store.close()


def test_reservations_are_returned_and_settled_by_their_own_request(store):
    assert store.reserve_retention("a", "c", 100, 300, request="turn1")
    store.settle_retention("a", "c", 120, 4096, 300, request="turn1")
    store.clock.now += 100
    assert store.reserve_retention("a", "c", 500, 300, quota_tokens=1000, request="turn2")
    assert store.retained_tokens("a") == 500
    store.abandon_retention("a", "c", request="turn2")  # turn 2 failed: turn 1's retention is counted again
    assert store.usage()["a"] == {"responses": 0, "bytes": 0, "retained_tokens": 120, "retained_bytes": 4096}
    assert store.reserve_retention("a", "c", 500, 300, request="turn3")
    assert store.reserve_retention("a", "c", 600, 300, request="turn4")  # a concurrent turn of the conversation
    store.settle_retention("a", "c", 650, 8192, 300, request="turn3")  # turn 3 ends late: turn 4's figure stands
    store.abandon_retention("a", "c", request="turn3")
    assert store.retained_tokens("a") == 600
    store.settle_retention("a", "c", 640, 8192, 600, request="turn4")  # settled for its window from its end
    store.clock.now += 599
    assert store.retained_tokens("a") == 640
    assert store.reserve_retention("a", "d", 50, 300, request="other")
    store.abandon_retention("a", "d", request="other")  # nothing before it: gone
    assert "d" not in {k for k, in store._conn.execute("SELECT key FROM retention")}
