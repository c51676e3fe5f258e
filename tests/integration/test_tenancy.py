"""Tenants end to end: API keys from etcd (made with the CLI), 401/403 in OpenAI's shape with the
official client, revocation on a running gateway, token budgets with reserve/settle and 429s,
the usage ledger and `tokenfleet usage`, and the ledger's durability across kill -9."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time

import openai
import pytest

from tests.integration.conftest import start_service, wait_for
from tests.integration.test_membership import replicas, start_worker
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.tenancy.ledger import records

MODEL = "smol"


def cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def add_tenant(etcd: str, name: str, *options: str) -> str:
    return cli("tenants", "add", name, "--etcd", etcd, *options).strip().splitlines()[-1]


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    etcd = EtcdServer.create().start()
    services = []
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    try:
        services.append(start_worker(default_model_dir, etcd, "t0", ttl=5))
        router = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint)
        services.append(router)
        gateway = start_service("tokenfleet.services.gateway", "--router", router.address, "--model",
                                f"{MODEL}={default_model_dir}", "--auth", "on", "--etcd", etcd.endpoint,
                                "--ledger", str(ledger))
        services.append(gateway)
        wait_for(lambda: replicas(etcd.endpoint), "worker registered")
        yield etcd, router, gateway, ledger
    finally:
        for service in reversed(services):
            service.stop()
        etcd.cleanup()


def client(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key=key, max_retries=0, timeout=120)


def ask(c: openai.OpenAI, **extra):  # type: ignore[no-untyped-def]
    return c.completions.with_raw_response.create(model=MODEL, temperature=0,
                                                  **{"prompt": "The capital of France is", "max_tokens": 4, **extra})


def test_keys_tenants_models_and_revocation(stack):
    etcd, _, gateway, ledger = stack
    key = add_tenant(etcd.endpoint, "acme")
    other = add_tenant(etcd.endpoint, "narrow", "--models", "some-other-model")
    ok = wait_for(lambda: _try(lambda: ask(client(gateway, key))), "the gateway sees the new key")
    assert ok.parse().usage.completion_tokens == 4
    conn = http.client.HTTPConnection(gateway.address, timeout=30)
    conn.request("GET", "/v1/models")  # no Authorization header (the openai client always sends one)
    missing = conn.getresponse()
    body = json.loads(missing.read())
    conn.close()
    assert missing.status == 401 and "didn't provide an API key" in body["error"]["message"]
    assert body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as unknown:
        ask(client(gateway, "tfk_00000000_" + "x" * 32))
    assert unknown.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as forbidden:
        ask(client(gateway, other))
    assert forbidden.value.body["code"] == "model_not_allowed"
    with pytest.raises(openai.BadRequestError):  # refused before admission: still one `rejected` record
        ask(client(gateway, key), top_p=7)
    refused = wait_for(lambda: [r for r in records(ledger) if r.tenant == "acme" and r.status == "rejected"],
                       "a ledger record of the refused request")
    assert refused[0].detail == "HTTP 400" and refused[0].key_id == key.split("_")[1]

    key_id = key.split("_")[1]
    assert f"keys: {key_id}" in cli("tenants", "list", "--etcd", etcd.endpoint)
    assert key not in cli("tenants", "list", "--etcd", etcd.endpoint)  # stored hashed, never shown again
    cli("tenants", "revoke", key_id, "--etcd", etcd.endpoint)
    wait_for(lambda: _status(lambda: ask(client(gateway, key))) == 401, "the revoked key is refused", 10)
    new_key = cli("tenants", "rotate", other.split("_")[1], "--etcd", etcd.endpoint).strip().splitlines()[-1]
    wait_for(lambda: _status(lambda: ask(client(gateway, other))) == 401, "the rotated-out key is refused", 10)
    with pytest.raises(openai.PermissionDeniedError):  # the new key works (same tenant, same model list)
        ask(client(gateway, new_key))
    assert not any(key in line for line in gateway.stderr_lines)  # keys never reach the logs
    failed = [json.loads(line) for line in gateway.stderr_lines if "authentication failed" in line]
    assert failed and all(entry["peer"].startswith("127.0.0.1:") for entry in failed)  # who tried, from where


def test_token_budget_reserves_settles_and_rejects_with_retry_after(stack):
    etcd, _, gateway, ledger = stack
    key = add_tenant(etcd.endpoint, "metered", "--tokens-per-minute", "300")
    c = client(gateway, key)
    first = wait_for(lambda: _try(lambda: ask(c, max_tokens=250, stop=[" "])), "the gateway sees the key")
    used = first.parse().usage.total_tokens
    assert used < 50  # stopped early: most of the 250 reserved tokens went back ...
    second = ask(c, max_tokens=250, stop=[" "])  # ... so this one fits (without the refund it could not)
    assert int(second.headers["x-ratelimit-limit-tokens"]) == 300
    assert int(second.headers["x-ratelimit-remaining-tokens"]) < 300 - 250
    stream = c.completions.with_streaming_response.create(
        model=MODEL, prompt="Count slowly:", max_tokens=250, temperature=0, stream=True, extra_body={"ignore_eos": True})
    with stream as held:  # admitted and streaming: its 256 tokens stay reserved until it ends
        lines = held.iter_lines()  # keep the iterator: dropping it closes the stream
        next(lines)
        with pytest.raises(openai.RateLimitError) as denied:
            ask(c, max_tokens=250)
    assert int(denied.value.response.headers["retry-after"]) >= 1
    assert denied.value.body["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError) as too_big:
        ask(c, max_tokens=400)
    assert "retry-after" not in too_big.value.response.headers  # larger than the budget: never admitted
    rows = wait_for(lambda: len(r := [r for r in records(ledger) if r.tenant == "metered"]) == 5 and r,
                    "five ledger records (the cancelled stream's comes when the gateway notices)")
    assert sorted(r.status for r in rows) == ["cancelled", "ok", "ok", "rejected", "rejected"]
    ok = [r for r in rows if r.status == "ok"]
    assert ok[0].prompt_tokens + ok[0].completion_tokens == used
    cancelled = next(r for r in rows if r.status == "cancelled")
    assert 1 <= cancelled.completion_tokens < 250  # billed for what it produced, not what it reserved
    report = cli("usage", "--ledger", str(ledger), "--tenant", "metered", "--format", "csv").splitlines()
    assert report[0].startswith("day,tenant,model,requests") and ",metered,smol,5,2,2,1,0," in report[1]


def test_every_request_whose_end_reached_a_client_is_billed_once_across_kill_9(stack, tmp_path, default_model_dir):
    etcd, router, _, _ = stack
    key = add_tenant(etcd.endpoint, "durable")
    ledger = tmp_path / "ledger.sqlite3"
    args = ("tokenfleet.services.gateway", "--router", router.address, "--model", f"{MODEL}={default_model_dir}",
            "--auth", "on", "--etcd", etcd.endpoint, "--ledger", str(ledger))
    gateway = start_service(*args)
    done: list[dict] = []  # (id, usage) of every stream whose [DONE] arrived
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            result = _stream(gateway.address, key)
            if result is not None:
                done.append(result)

    try:
        wait_for(lambda: _stream(gateway.address, key), "the gateway serves the tenant")
        threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: len(done) >= 6, "streams completing", 120)
        gateway.proc.kill()  # mid-stream for some: no drain, nothing flushed on the way out
        gateway.proc.wait(timeout=30)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        gateway = start_service(*args)  # the restarted gateway reopens the same ledger
        assert _stream(gateway.address, key) is not None
    finally:
        stop.set()
        gateway.stop()
    billed = {}
    for r in records(ledger):
        if r.tenant == "durable" and r.status == "ok":
            assert r.request_id not in billed, f"{r.request_id} billed twice"
            billed[r.request_id] = r
    assert len(done) >= 6
    for result in done:
        record = billed[result["id"]]  # exactly one record for every stream a client saw finish
        assert (record.prompt_tokens, record.completion_tokens) == (result["usage"]["prompt_tokens"],
                                                                    result["usage"]["completion_tokens"])


def _stream(address: str, key: str) -> dict | None:
    """One streamed chat completion; its id and usage if [DONE] arrived, else None."""
    conn = http.client.HTTPConnection(address, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 12,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json", "authorization": f"Bearer {key}"})
        response = conn.getresponse()
        if response.status != 200:
            return None
        request_id, usage = None, None
        while line := response.readline().decode():
            if line.startswith("data: [DONE]"):
                return {"id": request_id, "usage": usage}
            if line.startswith("data: "):
                event = json.loads(line[6:])
                request_id = event.get("id", request_id)
                usage = event.get("usage") or usage
        return None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def _try(call):  # type: ignore[no-untyped-def]
    try:
        return call()
    except openai.APIStatusError:
        return None


def _status(call) -> int:  # type: ignore[no-untyped-def]
    try:
        call()
        return 200
    except openai.APIStatusError as e:
        return e.status_code



def test_two_gateways_split_one_budget_and_admit_no_more_than_it(stack, default_model_dir):
    """Each gateway enforces half of the tenant's budget while both are alive; together, under more
    demand than the budget, they admit at most the budget plus what refills during the run."""
    etcd, router, first, _ = stack
    budget = 240  # tokens per minute: 4 per second, 120 per gateway
    key = add_tenant(etcd.endpoint, "shared", "--tokens-per-minute", str(budget))
    second = start_service("tokenfleet.services.gateway", "--router", router.address, "--model",
                           f"{MODEL}={default_model_dir}", "--auth", "on", "--etcd", etcd.endpoint, "--ledger", "none")
    try:
        clients = [client(first, key), client(second, key)]
        wait_for(lambda: all(_try(lambda c=c: ask(c, max_tokens=1)) for c in clients), "both gateways serve the key")
        wait_for(lambda: int(ask(clients[1], max_tokens=1).headers["x-ratelimit-remaining-tokens"]) < budget / 2,
                 "the second gateway enforces half the budget")
        admitted, denied = [], []
        start = time.monotonic()

        def hammer(c: openai.OpenAI) -> None:
            while time.monotonic() - start < 8:
                try:  # ignore_eos and an exact max_tokens: used == reserved
                    admitted.append(ask(c, max_tokens=16, extra_body={"ignore_eos": True}).parse().usage.total_tokens)
                except openai.RateLimitError:
                    denied.append(1)
                    time.sleep(0.2)

        threads = [threading.Thread(target=hammer, args=(c,)) for c in clients for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        elapsed = time.monotonic() - start
        print(f"two-gateway budget: admitted {sum(admitted)} tokens in {elapsed:.1f} s, {len(denied)} denials; "
              f"bound {budget + budget / 60 * elapsed:.0f}")
        assert denied, "the demand must exceed the budget for this test to mean anything"
        assert sum(admitted) <= budget + budget / 60 * elapsed, (sum(admitted), elapsed)
        assert sum(admitted) >= budget / 2  # both shares were spent, not just one
    finally:
        second.stop()


def test_early_rejection_when_the_predicted_wait_exceeds_the_tier_objective(stack, default_model_dir, tmp_path):
    etcd, router, _, _ = stack
    ledger = tmp_path / "ledger.sqlite3"
    strict = start_service("tokenfleet.services.gateway", "--router", router.address, "--model",
                           f"{MODEL}={default_model_dir}", "--ttft-objective", "interactive=0.001",
                           "--ledger", str(ledger))
    try:
        c = client(strict, "unused")  # auth off: the anonymous tenant, interactive
        # the worker knows its prefill rate after one prefill of at least 128 tokens; then any prompt predicts > 1 ms
        error = wait_for(lambda: _rejected(c), "an early rejection")
        assert error.status_code == 503 and error.body["code"] == "overloaded"
        assert "exceeds the objective" in error.message and int(error.response.headers["retry-after"]) >= 1
        rejected = wait_for(lambda: [r for r in records(ledger) if r.status == "rejected"], "the ledger record")
        assert rejected[0].tenant == "anonymous" and "objective" in rejected[0].detail
    finally:
        strict.stop()


def _rejected(c: openai.OpenAI):  # type: ignore[no-untyped-def]
    try:
        ask(c, prompt=LONG_PROMPT * 2)  # ~180 tokens: a prefill long enough to measure the rate by
    except openai.APIStatusError as e:
        return e
    return None


def test_a_tenants_file_works_and_its_revocations_apply_without_a_restart(stack, default_model_dir, tmp_path):
    _, router, _, _ = stack
    path = tmp_path / "tenants.yaml"
    key = cli("tenants", "add", "filed", "--file", str(path)).strip().splitlines()[-1]
    gateway = start_service("tokenfleet.services.gateway", "--router", router.address, "--model",
                            f"{MODEL}={default_model_dir}", "--auth", "on", "--tenants-file", str(path),
                            "--ledger", "none")
    try:
        assert wait_for(lambda: _try(lambda: ask(client(gateway, key))), "served with the file's key")
        cli("tenants", "revoke", key.split("_")[1], "--file", str(path))
        wait_for(lambda: _status(lambda: ask(client(gateway, key))) == 401, "the file's revocation applied", 10)
    finally:
        gateway.stop()


LONG_PROMPT = ("Our store opens at nine and closes at six. We sell hammers, nails, screws, paint and garden tools. "
               "Returns are accepted within thirty days with a receipt. ") * 3


def cached(c: openai.OpenAI, prompt: str = LONG_PROMPT, cache_salt: str | None = None) -> tuple[int, str | None]:
    """(cached prompt tokens, the replica header) of one completion."""
    extra = {"extra_body": {"cache_salt": cache_salt}} if cache_salt is not None else {}
    raw = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, **extra)
    details = raw.parse().usage.prompt_tokens_details
    return (details.cached_tokens if details else 0) or 0, raw.headers.get("x-tokenfleet-replica")


def test_tenants_never_share_cached_prefixes_unless_they_share_a_group(stack):
    """A hit is always one's own: another tenant's identical prompt is computed afresh (cached 0), a tenant
    of the same cache group shares, and cache_salt separates one tenant's requests. Only an internal
    tenant learns which replica served it."""
    etcd, _, gateway, _ = stack
    keys = {name: add_tenant(etcd.endpoint, name, *options) for name, options in [
        ("alpha", ()), ("beta", ()), ("gamma", ("--cache-group", "acme-corp")), ("delta", ("--cache-group", "acme-corp")),
        ("ops", ("--internal",))]}
    clients = {name: client(gateway, key) for name, key in keys.items()}
    wait_for(lambda: _try(lambda: ask(clients["ops"])), "the gateway sees the new keys")
    first, header = cached(clients["alpha"])
    assert first == 0 and header is None
    again, _ = cached(clients["alpha"])
    assert again >= 16  # its own prefix: a hit
    assert cached(clients["beta"])[0] == 0  # the same prompt from another tenant: no hit
    assert cached(clients["beta"])[0] >= 16  # ... until it sent it itself
    assert cached(clients["alpha"], cache_salt="user-1")[0] == 0  # its own salt: apart from its other requests
    assert cached(clients["alpha"], cache_salt="user-1")[0] >= 16
    prompt = LONG_PROMPT.replace("nine", "eight")
    assert cached(clients["gamma"], prompt)[0] == 0
    assert cached(clients["delta"], prompt)[0] >= 16  # one cache group: shared
    hits, replica = cached(clients["ops"], prompt)
    assert hits == 0 and replica == "t0"  # the internal tenant sees the replica, not others' prefixes
    with pytest.raises(openai.BadRequestError):
        cached(clients["alpha"], cache_salt="x" * 300)


def test_budgets_fail_closed_while_gateway_membership_is_unknown(default_model_dir, tmp_path):
    """etcd unreachable from the gateway's start: it cannot know how many gateways share a budget, so a
    tenant with limits gets 503 (not the whole budget on every gateway); an unlimited one is served."""
    import asyncio

    from tokenfleet.tenancy.store import FileTenantStore
    from tokenfleet.tenancy.tenants import Tenant

    store = FileTenantStore(tmp_path / "tenants.yaml")
    limited = asyncio.run(store.add(Tenant("limited", tokens_per_minute=10_000)))
    free = asyncio.run(store.add(Tenant("free", max_concurrent=0)))
    etcd = EtcdServer.create().start()
    worker = start_worker(default_model_dir, etcd, "fc0", ttl=5)
    router = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint)
    gateway = start_service("tokenfleet.services.gateway", "--router", router.address, "--model",
                            f"{MODEL}={default_model_dir}", "--auth", "on", "--tenants-file", str(tmp_path / "tenants.yaml"),
                            "--etcd", "http://127.0.0.1:1", "--ledger", "none")  # an etcd nobody answers at
    try:
        wait_for(lambda: replicas(etcd.endpoint), "worker registered")
        ok = wait_for(lambda: _try(lambda: ask(client(gateway, free))), "the unlimited tenant served")
        assert ok.parse().usage.completion_tokens == 4
        with pytest.raises(openai.InternalServerError) as closed:
            ask(client(gateway, limited))
        assert closed.value.status_code == 503 and closed.value.body["code"] == "budget_unavailable"
    finally:
        for service in (gateway, router, worker):
            service.stop()
        etcd.cleanup()
