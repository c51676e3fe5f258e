"""A deliberately broken canary is rolled back by `tokenfleet models rollout` (real etcd, registry, router,
gateway and two workers, the real `openai` client): m@v2's worker fails half of its requests (--fail-fraction);
the rollout notices the canary's error rate on the gateway's per-version counters and puts the alias back on m@v1
within 60 s; failures happen only before the rollback and number at most the canary weight x requests sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import openai
import pytest
from tokenfleet.services.registry.convert import record_to_proto

from tests.integration.conftest import plane
from tokenfleet import envs
from tokenfleet.cli import launcher
from tokenfleet.cluster.registry import ModelRecord
from tokenfleet.v1 import registry_pb2, registry_pb2_grpc

FIRST_WEIGHT = 0.2


@pytest.fixture(scope="module")
def fleet(default_model_dir):
    cluster = launcher.up(1, str(default_model_dir), "m", 1, 0, record=False)
    try:
        registry = cluster.addresses["registry"]
        stub = registry_pb2_grpc.RegistryServiceStub(plane("operator").sync_channel(registry, "registry"))
        record = ModelRecord(name="m", version="v2", path=str(default_model_dir.resolve()), tool_format="hermes")
        stub.RegisterModel(registry_pb2.RegisterModelRequest(record=record_to_proto(record)))
        cluster.spawn("worker-v2", "tokenfleet.services.decode", "--registry", registry, "--model-name", "m@v2",
                      "--etcd", cluster.etcd.endpoint, "--replica-id", "v2-0", "--role", "both",
                      "--certs", str(envs.certs_dir()), "--fail-fraction", "0.5", threads=1)
        stub.SetAlias(registry_pb2.SetAliasRequest(alias="prod", target="m@v1"))
        yield cluster
    finally:
        cluster.stop()


def test_a_broken_canary_is_rolled_back_within_a_minute(fleet):
    client = openai.OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="unused", max_retries=0, timeout=60)
    sent: list[tuple[float, bool]] = []  # (when it ended, ok)
    lock = threading.Lock()
    stop = threading.Event()

    def user(worker: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                client.chat.completions.create(model="prod", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2, user=f"conversation-{worker}-{i}")
                ok = True
            except openai.APIError:
                ok = False
            with lock:
                sent.append((time.monotonic(), ok))
            i += 1

    threads = [threading.Thread(target=user, args=(w,), daemon=True) for w in range(2)]
    for t in threads:
        t.start()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    rollout = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", "models", "rollout", "prod", "--to", "m@v2",
         "--steps", f"{FIRST_WEIGHT},0.5,1", "--step-seconds", "30", "--min-requests", "3",
         "--registry", fleet.addresses["registry"], "--etcd", fleet.etcd.endpoint, "--metrics", fleet.gateway_metrics,
         "--certs", str(envs.certs_dir())],
        capture_output=True, text=True, env=env, timeout=180)
    rolled_back_at = time.monotonic()
    time.sleep(3)  # requests keep coming after the rollback: none may fail
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert rollout.returncode == 1, rollout.stdout + rollout.stderr
    assert "rolled_back" in rollout.stdout and "error rate" in rollout.stdout
    assert rolled_back_at - started < 60
    failures = [when for when, ok in sent if not ok]
    assert failures, "the canary took traffic and failed some of it"
    assert len(failures) <= FIRST_WEIGHT * len(sent)
    assert max(failures) <= rolled_back_at
    assert any(when > rolled_back_at for when, ok in sent if ok)
    status = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", "models", "rollout", "prod", "--status", "--etcd",
         fleet.etcd.endpoint, "--certs", str(envs.certs_dir())], capture_output=True, text=True, env=env, timeout=60)
    record = json.loads(status.stdout)
    assert record["state"] == "rolled_back" and record["history"][0]["weight"] == FIRST_WEIGHT
    listed = {a.alias: a for a in registry_pb2_grpc.RegistryServiceStub(
        plane("operator").sync_channel(fleet.addresses["registry"], "registry")).ListModels(
        registry_pb2.ListModelsRequest()).aliases}
    assert (listed["prod"].target, listed["prod"].canary) == ("m@v1", "")
