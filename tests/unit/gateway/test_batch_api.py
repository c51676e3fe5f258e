"""The Files and Batch endpoints' edge (in process, the real app and store, no workers): API keys, one tenant's
objects invisible to another, upload limits, OpenAI's error shape, and a gateway without the batch tier."""

from __future__ import annotations

import io
import json

import pytest
from fastapi.testclient import TestClient
from tokenfleet.services.gateway.app import create_app
from tokenfleet.services.gateway.catalog import ModelCatalog
from tokenfleet.services.gateway.pipeline import Gateway

from tokenfleet.batch.formats import Limits
from tokenfleet.batch.store import BatchStore
from tokenfleet.tenancy.admission import Admission
from tokenfleet.tenancy.tenants import Directory, Tenant, new_key

CHAT = "/v1/chat/completions"


def lines(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT,
                               "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}) + "\n"
                   for i in range(n)).encode()


@pytest.fixture
def app(tmp_path):
    keys = {}
    records = {}
    for name in ("alpha", "beta"):
        key, record = new_key(name)
        keys[name], records[record.key_hash] = key, record
    directory = Directory({n: Tenant(n) for n in keys}, records)
    store = BatchStore(tmp_path / "ledger.sqlite3", Limits(max_file_bytes=2000, max_queued_lines=10))
    gateway = Gateway(["127.0.0.1:1"], ModelCatalog(), admission=Admission(directory))
    client = TestClient(create_app(gateway, batches=store))
    yield client, {n: {"authorization": f"Bearer {k}"} for n, k in keys.items()}
    store.close()


def upload(client, headers, content: bytes, name: str = "in.jsonl", purpose: str = "batch"):
    return client.post("/v1/files", headers=headers, files={"file": (name, io.BytesIO(content))},
                       data={"purpose": purpose})


def test_keys_and_tenants(app):
    client, auth = app
    assert client.get("/v1/files").status_code == 401
    made = upload(client, auth["alpha"], lines(2))
    assert made.status_code == 200 and made.json()["object"] == "file" and made.json()["purpose"] == "batch"
    file_id = made.json()["id"]
    hidden = client.get(f"/v1/files/{file_id}", headers=auth["beta"])
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "file_not_found"
    assert client.get(f"/v1/files/{file_id}/content", headers=auth["alpha"]).content == lines(2)
    batch = client.post("/v1/batches", headers=auth["alpha"], json={
        "input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}).json()
    assert batch["status"] == "validating" and batch["request_counts"]["total"] == 2
    assert client.get(f"/v1/batches/{batch['id']}", headers=auth["beta"]).status_code == 404
    assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth["beta"]).status_code == 404
    assert client.get("/v1/batches", headers=auth["beta"]).json()["data"] == []
    cancelling = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth["alpha"]).json()
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"] is not None


def test_bad_uploads_and_batches_get_openai_errors(app):
    client, auth = app
    big = upload(client, auth["alpha"], b"x" * 2001)
    assert big.status_code == 413 and big.json()["error"]["code"] == "file_too_large"
    assert upload(client, auth["alpha"], lines(1), purpose="fine-tune").json()["error"]["param"] == "purpose"
    missing = client.post("/v1/files", headers=auth["alpha"], data={"purpose": "batch"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "file"
    assert client.post("/v1/files", headers=auth["alpha"], content=b"{}").status_code == 400  # not a form
    bad_limit = client.get("/v1/batches?limit=x", headers=auth["alpha"])
    assert bad_limit.status_code == 400 and bad_limit.json()["error"]["param"] == "limit"
    file_id = upload(client, auth["alpha"], lines(8)).json()["id"]
    for body, param in (({"endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
                        ({"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
                         "endpoint"),
                        ({"input_file_id": file_id, "endpoint": CHAT, "completion_window": "soon"},
                         "completion_window")):
        refused = client.post("/v1/batches", headers=auth["alpha"], json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.json()
    assert client.post("/v1/batches", headers=auth["alpha"], json={
        "input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}).status_code == 200
    over = client.post("/v1/batches", headers=auth["alpha"], json={
        "input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})  # 16 unfinished > 10
    assert over.status_code == 429 and over.json()["error"]["code"] == "batch_quota_exceeded"


def test_a_gateway_without_the_batch_tier_names_the_one_with_it(tmp_path):
    gateway = Gateway(["127.0.0.1:1"], ModelCatalog())
    client = TestClient(create_app(gateway, batch_url="http://gateway-batch:8000/v1"))
    off = client.get("/v1/batches")
    assert off.status_code == 404 and off.json()["error"]["code"] == "batch_tier_off"
    assert "http://gateway-batch:8000/v1" in off.json()["error"]["message"]
