"""The Responses API end to end with the official openai client: gateway (API keys from etcd, the ledger's database)
-> router -> worker, real processes and the real model. Stored responses, streaming events, a two-turn function
calling loop with previous_response_id, tenants that cannot see each other's responses, and the bad-input cases in
OpenAI's error shape."""

from __future__ import annotations

import json
import sqlite3
import time

import httpx2 as httpx
import openai
import pytest

from tests.integration.conftest import load_report, start_service, wait_for
from tests.integration.test_membership import replicas, start_worker
from tests.integration.test_tenancy import add_tenant, cli
from tokenfleet.cluster.etcd_server import EtcdServer

MODEL = "smol"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    etcd = EtcdServer.create().start()
    services = []
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    try:
        services.append(start_worker(default_model_dir, etcd, "r0", ttl=5))
        router = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint)
        services.append(router)
        gateway = start_service("tokenfleet.services.gateway", "--router", router.address, "--model",
                                f"{MODEL}={default_model_dir}", "--auth", "on", "--etcd", etcd.endpoint,
                                "--ledger", str(ledger))
        services.append(gateway)
        wait_for(lambda: replicas(etcd.endpoint), "worker registered")
        keys = {name: add_tenant(etcd.endpoint, name) for name in ("alice", "bob")}
        clients = {name: openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key=key, max_retries=0,
                                       timeout=120) for name, key in keys.items()}
        wait_for(lambda: _ready(clients["alice"]), "gateway knows the tenants")
        yield clients, gateway, ledger, etcd, router, services[0]
    finally:
        for service in reversed(services):
            service.stop()
        etcd.cleanup()


def _ready(client: openai.OpenAI) -> bool:
    try:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=1, store=False)
        return True
    except openai.APIError:
        return False


def test_create_retrieve_list_items_and_delete(stack):
    clients, _, ledger, _, _, _ = stack
    alice = clients["alice"]
    r = alice.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=20,
                               temperature=0, instructions="Answer in one sentence.")
    assert r.status == "completed" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 20
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = alice.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.status == "completed"
    items = alice.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "What is the capital of France?")]
    with sqlite3.connect(ledger) as conn:  # billed as chat is, under the Responses endpoint
        billed = conn.execute("SELECT tenant, status, prompt_tokens, completion_tokens FROM usage "
                              "WHERE endpoint = '/v1/responses' AND completion_tokens = ?",
                              (r.usage.output_tokens,)).fetchall()
    assert ("alice", "ok", r.usage.input_tokens, r.usage.output_tokens) in billed
    deleted = alice.responses.with_raw_response.delete(r.id)
    assert deleted.status_code == 200 and deleted.http_response.json() == {"id": r.id, "object": "response",
                                                                            "deleted": True}
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)


def test_a_stored_turn_is_retained_on_its_worker_until_deleted(stack):
    clients, worker = stack[0], stack[5]
    before = load_report(worker.address)
    r = clients["alice"].responses.create(model=MODEL, input="Name three colours.", max_output_tokens=12)
    held = wait_for(lambda: (report := load_report(worker.address)).retained_bytes_per_tenant.get("alice") and report,
                    "the worker retains alice's transcript")
    assert held.num_retained_blocks >= r.usage.input_tokens // 16
    clients["alice"].responses.delete(r.id)
    after = wait_for(lambda: (report := load_report(worker.address)).num_retention_releases
                     > before.num_retention_releases and report, "the delete released it")
    assert after.num_retained_blocks < held.num_retained_blocks


def test_streaming_sends_the_documented_events_and_the_same_text(stack):
    alice = stack[0]["alice"]
    ask = {"model": MODEL, "input": "Write a haiku about rain.", "max_output_tokens": 24, "temperature": 0}
    whole = alice.responses.create(**ask)
    events = list(alice.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert alice.responses.retrieve(final.id).output_text == text  # stored as streamed


def test_the_clients_stream_helper_accumulates_the_same_text(stack):
    """``responses.stream`` checks the event sequence as it folds it (item announced empty, then its part)."""
    alice = stack[0]["alice"]
    ask = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 60, "temperature": 0}
    whole = alice.responses.create(**ask)
    assert whole.status == "completed"  # the helper's final response needs response.completed (OpenAI's too)
    with alice.responses.stream(**ask) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and snapshots[-1] == whole.output_text
    assert all(later.startswith(earlier) for earlier, later in zip(snapshots, snapshots[1:], strict=False))


def test_two_turn_function_calling_loop_reuses_the_transcript(stack):
    alice = stack[0]["alice"]
    first = alice.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                   tool_choice="required", temperature=0, max_output_tokens=60)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments)
    second = alice.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"temperature_c": 18, "sky": "sunny"})}])
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert second.output and second.usage.input_tokens > first.usage.input_tokens
    # the first turn's transcript was cached on the same replica: most of it is a prefix hit
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    items = alice.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["function_call_output"]


def test_streamed_function_call_events(stack):
    alice = stack[0]["alice"]
    events = list(alice.responses.create(model=MODEL, input="What is the weather in Rome?", tools=[WEATHER],
                                         tool_choice="required", temperature=0, max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    calls = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert calls and calls == [item for item in events[-1].response.output if item.type == "function_call"]
    for call in calls:  # each call's deltas add up to its arguments (the model may call more than once)
        done = next(e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == call.id)
        deltas = "".join(e.delta for e in events
                         if e.type == "response.function_call_arguments.delta" and e.item_id == call.id)
        assert done.arguments == deltas == call.arguments and json.loads(deltas)["city"]


def test_a_tenant_cannot_see_another_tenants_responses(stack):
    clients = stack[0]
    mine = clients["alice"].responses.create(model=MODEL, input="Say hello.", max_output_tokens=5)
    bob = clients["bob"]
    for attempt in (lambda: bob.responses.retrieve(mine.id), lambda: bob.responses.delete(mine.id),
                    lambda: bob.responses.input_items.list(mine.id),
                    lambda: bob.responses.create(model=MODEL, input="And?", previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            attempt()
        assert caught.value.body["code"] == "not_found" and mine.id in caught.value.body["message"]
    assert clients["alice"].responses.retrieve(mine.id).id == mine.id  # still there for its owner


def test_store_false_leaves_nothing_and_unknown_ids_are_404(stack):
    alice = stack[0]["alice"]
    r = alice.responses.create(model=MODEL, input="Say hello.", max_output_tokens=5, store=False)
    assert r.store is False and r.output_text
    for missing in (r.id, "resp_" + "0" * 32):
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError):
            alice.responses.create(model=MODEL, input="And?", previous_response_id=missing)


@pytest.mark.parametrize("extra,param", [
    ({"input": [{"type": "function_call_output", "call_id": "call_nowhere", "output": "42"}]}, "input"),
    ({"input": "hi", "prompt_cache_retention": "1h"}, "prompt_cache_retention"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": "hi", "background": True, "store": False}, "background"),
])
def test_bad_input_is_a_400_naming_the_field(stack, extra, param):
    alice = stack[0]["alice"]
    with pytest.raises(openai.BadRequestError) as caught:
        alice.responses.create(model=MODEL, max_output_tokens=5, **extra)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param


def test_background_response_runs_and_a_finished_one_cannot_be_cancelled(stack):
    alice = stack[0]["alice"]
    r = alice.responses.create(model=MODEL, input="Count from one to five.", max_output_tokens=20, background=True)
    assert r.status in ("queued", "in_progress") and r.background
    wait_for(lambda: alice.responses.retrieve(r.id).status not in ("queued", "in_progress"), "background response", 120)
    done = alice.responses.retrieve(r.id)
    assert done.status in ("completed", "incomplete") and done.output_text, done
    with pytest.raises(openai.APIStatusError) as caught:
        alice.responses.cancel(r.id)
    assert caught.value.status_code == 409
    plain = alice.responses.create(model=MODEL, input="Say hi.", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError):
        alice.responses.cancel(plain.id)  # only background responses are cancelled
    long = alice.responses.create(model=MODEL, input="Count to one thousand.", max_output_tokens=2000,
                                  background=True)
    assert alice.responses.cancel(long.id).status == "cancelled"
    assert alice.responses.cancel(long.id).status == "cancelled"  # again: the same answer, not a 409
    time.sleep(1.0)  # the run stops; nothing it still produced overwrites the cancellation
    assert alice.responses.retrieve(long.id).status == "cancelled"


def test_a_tenant_over_its_stored_bytes_is_served_and_not_stored(stack):
    clients, gateway, _, etcd, _, _ = stack
    key = add_tenant(etcd.endpoint, "carol", "--response-bytes", "100")
    carol = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key=key, max_retries=0, timeout=120)
    wait_for(lambda: _ready(carol), "gateway knows carol")
    raw = carol.responses.with_raw_response.create(model=MODEL, input="Say hello.", max_output_tokens=5)
    r = raw.parse()
    assert r.output_text and r.store is False and raw.headers["x-tokenfleet-store"] == "quota-exceeded"
    with pytest.raises(openai.NotFoundError):
        carol.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as caught:  # accepted, it could never be retrieved
        carol.responses.create(model=MODEL, input="Say hello.", max_output_tokens=5, background=True)
    assert caught.value.body["code"] == "storage_unavailable"
    report = cli("usage", "--ledger", str(stack[2]))
    assert "stored responses" in report and "alice" in report.split("stored responses")[1]


def test_prompt_cache_key_and_retention_are_accepted_on_chat(stack):
    alice = stack[0]["alice"]
    r = alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3,
                                      prompt_cache_key="conversation-1", prompt_cache_retention="in_memory")
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as caught:
        alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3,
                                      extra_body={"prompt_cache_retention": "forever"})
    assert caught.value.body["param"] == "prompt_cache_retention"


def test_unauthenticated_callers_get_401_not_404(stack):
    gateway = stack[1]
    answer = httpx.get(f"http://{gateway.address}/v1/responses/resp_x", timeout=10)
    assert answer.status_code == 401 and answer.json()["error"]["type"]


def test_gateways_sharing_the_database_cancel_and_recover_each_others_responses(stack, tmp_path, default_model_dir):
    """A cancel made on another gateway stops the generation where it runs; a gateway killed while generating has
    its background response failed by the other once its lease lapses (different --gateway-id: no restart needed)."""
    _, _, _, etcd, router, worker = stack
    key = add_tenant(etcd.endpoint, "frank")
    ledger = tmp_path / "ledger.sqlite3"
    base = ("tokenfleet.services.gateway", "--router", router.address, "--model", f"{MODEL}={default_model_dir}",
            "--auth", "on", "--etcd", etcd.endpoint, "--ledger", str(ledger), "--response-lease-seconds", "2")
    first = start_service(*base, "--gateway-id", "gw-a")
    second = start_service(*base, "--gateway-id", "gw-b")
    try:
        a, b = (openai.OpenAI(base_url=f"http://{g.address}/v1", api_key=key, max_retries=0, timeout=120)
                for g in (first, second))
        wait_for(lambda: _ready(a) and _ready(b), "both gateways serve frank")
        # an idle worker: what runs on it next is this test's response (no earlier test's request still generating)
        wait_for(lambda: load_report(worker.address).num_running == 0, "the worker is idle")
        aborted = load_report(worker.address).num_aborted
        running = a.responses.create(model=MODEL, input="Count to one thousand.", max_output_tokens=2000,
                                     background=True)
        # generating on the worker (cancelled earlier, it would stop before reaching it: nothing to abort there)
        wait_for(lambda: load_report(worker.address).num_running > 0, "the background response runs on the worker")
        assert b.responses.cancel(running.id).status == "cancelled"
        wait_for(lambda: load_report(worker.address).num_aborted > aborted, "gateway A stopped the generation")
        assert a.responses.retrieve(running.id).status == "cancelled"

        orphan = a.responses.create(model=MODEL, input="Count to one thousand.", max_output_tokens=2000,
                                    background=True)
        first.proc.kill()
        first.proc.wait(timeout=30)
        wait_for(lambda: b.responses.retrieve(orphan.id).status == "failed", "gateway B failed the orphan")
        assert "stopped" in b.responses.retrieve(orphan.id).error.message
    finally:
        first.stop()
        second.stop()


def test_a_killed_gateway_loses_no_acknowledged_response(stack, tmp_path, default_model_dir):
    """kill -9 while a background response runs: the responses whose end reached the client are still there after a
    restart, and the background response (acknowledged with its id) is failed with the reason, not lost."""
    _, _, _, etcd, router, _ = stack
    key = add_tenant(etcd.endpoint, "dave")
    ledger = tmp_path / "ledger.sqlite3"
    args = ("tokenfleet.services.gateway", "--router", router.address, "--model", f"{MODEL}={default_model_dir}", "--auth",
            "on", "--etcd", etcd.endpoint, "--ledger", str(ledger), "--gateway-id", "gw-durable")
    gateway = start_service(*args)
    try:
        dave = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key=key, max_retries=0, timeout=120)
        wait_for(lambda: _ready(dave), "the gateway serves dave")
        kept = dave.responses.create(model=MODEL, input="Say hello.", max_output_tokens=5)
        running = dave.responses.create(model=MODEL, input="Count to one thousand.", max_output_tokens=2000,
                                        background=True)
        gateway.proc.kill()
        gateway.proc.wait(timeout=30)
        gateway = start_service(*args)
        dave = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key=key, max_retries=0, timeout=120)
        assert dave.responses.retrieve(kept.id).output_text == kept.output_text
        failed = dave.responses.retrieve(running.id)
        assert failed.status == "failed" and "stopped" in failed.error.message
    finally:
        gateway.stop()


def test_the_retention_quota_applies_to_chat_and_usage_reports_retained_bytes(stack):
    clients, gateway, ledger, etcd, _, _ = stack
    key = add_tenant(etcd.endpoint, "erin", "--retention-tokens", "150")  # one ~110-token conversation, not two
    erin = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key=key, max_retries=0, timeout=120)
    wait_for(lambda: _ready(erin), "gateway knows erin")
    messages = [{"role": "user", "content": "Tell me about the sea. " * 12}]

    def chat(conversation: str):
        return erin.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, prompt_cache_key=conversation,
            prompt_cache_retention="in_memory")

    kept = chat("first")
    assert kept.parse().choices[0].message.content and "x-tokenfleet-retention" not in kept.headers
    kept_again = chat("first")  # the same conversation's later turn replaces its own figure
    assert "x-tokenfleet-retention" not in kept_again.headers
    refused = chat("second")  # a second conversation does not fit beside the first: served, not retained
    assert refused.parse().choices[0].message.content
    assert refused.headers["x-tokenfleet-retention"] == "quota-exceeded"
    usage = kept_again.parse().usage
    report = cli("usage", "--ledger", str(ledger), "--tenant", "erin").split("retained conversations")[1]
    row = next(line.split("\t") for line in report.splitlines() if line.startswith("erin\t"))
    tokens, kv_bytes = int(row[3]), int(row[4])
    assert tokens == usage.prompt_tokens + usage.completion_tokens  # settled: what the first conversation keeps
    assert kv_bytes > 0  # as the engine reported it
