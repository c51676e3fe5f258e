"""The batch tier through a real `tokenfleet up` (fp32) with the official `openai` client: files and batches as
OpenAI's API has them, each line's output identical to the same request sent directly, one ledger charge per line,
and a gateway killed with SIGKILL mid-batch (restarted by `up`'s supervision) resuming without a lost or repeated
line."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import start_up, wait_for
from tests.integration.test_supervision import service_pid

CHAT = "/v1/chat/completions"


def body(i: int, max_tokens: int = 8) -> dict:
    return {"model": "smollm2-135m", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Name a colour, then count to {i}."}]}


def upload(client: openai.OpenAI, lines: list[dict]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def finish(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
        except openai.APIConnectionError:  # the gateway restarting (any answer it gives is checked)
            time.sleep(0.5)
            continue
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} not finished in {timeout}s")


def charges(tmp_path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(tmp_path / "ledger.sqlite3") as conn:
        return conn.execute("SELECT request_id, status FROM usage WHERE endpoint = ?", (f"batch:{CHAT}",)).fetchall()


@pytest.mark.timeout(900)
def test_batches_through_the_openai_client_survive_a_gateway_kill(default_model_dir, tmp_path):
    up = start_up(tmp_path, "--workers", "1", "--dtype", "float32", "--model", f"smollm2-135m={default_model_dir}")
    try:
        client = openai.OpenAI(base_url=f"{up.announced['gateway:']}", api_key="none", max_retries=0, timeout=60)
        # 1. a small batch: outputs equal direct requests; a bad line goes to the error file with the endpoint's 400
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body(i)} for i in range(6)]
        lines.append({"custom_id": "bad", "method": "POST", "url": CHAT, "body": {**body(0), "max_tokens": -1}})
        file_id = upload(client, lines)
        assert client.files.retrieve(file_id).purpose == "batch"
        batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                      metadata={"suite": "integration"})
        assert batch.status == "validating" and batch.request_counts.total == 7
        done = finish(client, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
        output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in output) == [f"c{i}" for i in range(6)]
        for o in output:
            direct = client.chat.completions.create(**body(int(o["custom_id"][1:])))
            got = o["response"]["body"]["choices"][0]["message"]["content"]
            assert o["response"]["status_code"] == 200 and got == direct.choices[0].message.content
        errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
        assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("bad", 400)]
        assert "max_tokens" in errors[0]["response"]["body"]["error"]["message"]
        assert sorted(status for _, status in charges(tmp_path)) == ["ok"] * 6 + ["rejected"]
        assert [b.id for b in client.batches.list(limit=5)] == [batch.id]
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)
        assert client.files.delete(file_id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)

        # 2. kill -9 of the gateway mid-batch: `up` restarts it, it takes its batch back, nothing lost or repeated
        lines = [{"custom_id": f"k{i}", "method": "POST", "url": CHAT, "body": body(i, 24)} for i in range(30)]
        batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 4, "lines completed", 300)
        os.kill(service_pid(up.proc.pid, "tokenfleet.services.gateway"), signal.SIGKILL)
        done = finish(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 30, done
        output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in output) == sorted(f"k{i}" for i in range(30))
        assert all(o["response"]["body"]["usage"]["completion_tokens"] > 0 for o in output)
        charged = [rid for rid, status in charges(tmp_path) if status == "ok"]
        assert len(charged) == len(set(charged)) == 36  # 6 + 30: one charge per line
        assert "[supervisor] gateway restarted" in up.log.read_text()
    finally:
        up.stop()
