"""The model router end to end (real etcd, registry, router, gateway, two workers, the real `openai` client):
a routing alias "auto" sends fact questions to the small model and everything else to the big one; the response
names the model that answered, the gateway counts each decision, and the ledger records both names."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import openai
import pytest
from tokenfleet.services.gateway.main import default_ledger

from tests.integration.conftest import plane
from tokenfleet.cli import launcher
from tokenfleet.tenancy.ledger import records
from tokenfleet.v1 import registry_pb2, registry_pb2_grpc

POLICY = {"small": "small", "big": "m", "threshold": 0.5, "weights": {"bias_one": -4.0, "marker_fact": 8.0}}


@pytest.fixture(scope="module")
def fleet(default_model_dir):
    # "m" and "small" are the same weights under two names: the test is about where requests go
    cluster = launcher.up(1, str(default_model_dir), "m", 1, 0, record=False,
                          more_models=[("small", str(default_model_dir))])
    try:
        yield cluster
    finally:
        cluster.stop()


def registry_stub(fleet):
    return registry_pb2_grpc.RegistryServiceStub(plane("operator").sync_channel(fleet.addresses["registry"], "registry"))


def test_auto_routes_each_request_and_records_the_decision(fleet):
    stub = registry_stub(fleet)
    with pytest.raises(grpc.RpcError) as bad:  # the target must be the policy's big model
        stub.SetAlias(registry_pb2.SetAliasRequest(alias="auto", target="small", route=json.dumps(POLICY)))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as bad:
        stub.SetAlias(registry_pb2.SetAliasRequest(alias="auto", target="m", route=json.dumps({"small": "small"})))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.SetAlias(registry_pb2.SetAliasRequest(alias="auto", target="m", route=json.dumps(POLICY)))
    snapshot = stub.ListModels(registry_pb2.ListModelsRequest())
    assert any(a.alias == "auto" and json.loads(a.route)["small"] == "small" for a in snapshot.aliases)

    client = openai.OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)
    since = time.time()
    asks = {"What is the capital of France?": "small", "Which river flows through Paris?": "small",
            "Explain how a refrigerator keeps food cold.": "m", "Write a haiku about rain.": "m"}
    deadline = time.monotonic() + 30
    while True:  # the gateway follows the registry's watch: the new alias arrives within moments
        try:
            client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline, "the gateway never learned the routing alias"
            time.sleep(0.5)
    ids = {}
    for text, expected in asks.items():
        out = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": text}], max_tokens=4,
                                             temperature=0)
        assert out.model == expected, text
        ids[out.id] = expected
    completion = client.completions.create(model="auto", prompt="Who wrote Hamlet?", max_tokens=3)
    assert completion.model == "small"
    ids[completion.id] = "small"

    metrics = urllib.request.urlopen(f"http://{fleet.gateway_metrics}/metrics", timeout=10).read().decode()
    counts = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("tokenfleet_gateway_routed_total{")}
    # the two fact questions and the completion went to the small model; the rest and the first "hi" to the big one
    assert counts['alias="auto",model="small"'] == 3 and counts['alias="auto",model="m"'] == 3

    deadline = time.monotonic() + 10
    while True:
        rows = {r.request_id: r for r in records(default_ledger(), since) if r.request_id in ids}
        if len(rows) == len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {rid: (r.model, r.requested_model, r.status) for rid, r in rows.items()} == {
        rid: (model, "auto", "ok") for rid, model in ids.items()}
