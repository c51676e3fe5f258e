"""Registry service over a real etcd; the CLI; two registered models served by different workers."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import openai
import pytest
from tokenfleet.services.registry.convert import record_to_proto

from tests.integration.conftest import channel as grpc_channel
from tests.integration.conftest import load_report, start_service, wait_for
from tests.integration.test_membership import replicas
from tests.integration.test_router import scrape
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.cluster.registry import ModelRecord
from tokenfleet.v1 import registry_pb2, registry_pb2_grpc


@pytest.fixture(scope="module")
def registry():
    etcd = EtcdServer.create().start()
    service = start_service("tokenfleet.services.registry", "--etcd", etcd.endpoint, "--metrics-port", "0")
    channel = grpc_channel(service.address, "registry", "operator")
    yield etcd, service, registry_pb2_grpc.RegistryServiceStub(channel)
    channel.close()
    service.stop()
    etcd.cleanup()


def register(stub, name: str, path: str, version: str = "v1", dtype: str = "float32") -> registry_pb2.RegisterModelResponse:
    record = ModelRecord(name=name, version=version, path=path, dtype=dtype)
    return stub.RegisterModel(registry_pb2.RegisterModelRequest(record=record_to_proto(record)))


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_register_get_alias_and_errors(registry, default_model_dir):
    _, service, stub = registry
    first = register(stub, "alpha", str(default_model_dir))
    assert first.created and first.record.created_at > 0
    assert not register(stub, "alpha", str(default_model_dir)).created  # identical: a no-op
    assert code_of(lambda: register(stub, "alpha", str(default_model_dir), dtype="bfloat16")) == \
        grpc.StatusCode.ALREADY_EXISTS  # versions are immutable
    register(stub, "alpha", str(default_model_dir), version="v2")
    assert stub.GetModel(registry_pb2.GetModelRequest(ref="alpha")).version == "v2"  # newest
    assert stub.GetModel(registry_pb2.GetModelRequest(ref="alpha@v1")).version == "v1"

    stub.SetAlias(registry_pb2.SetAliasRequest(alias="stable", target="alpha@v1"))
    assert stub.GetModel(registry_pb2.GetModelRequest(ref="stable")).version == "v1"
    stub.SetModelStatus(registry_pb2.SetModelStatusRequest(ref="alpha@v2", status=registry_pb2.MODEL_STATUS_DISABLED))
    assert stub.GetModel(registry_pb2.GetModelRequest(ref="alpha")).version == "v1"  # disabled versions skipped
    listed = stub.ListModels(registry_pb2.ListModelsRequest())
    assert {(m.name, m.version) for m in listed.models} >= {("alpha", "v1"), ("alpha", "v2")}
    assert ("stable", "alpha@v1") in {(a.alias, a.target) for a in listed.aliases}

    assert code_of(lambda: stub.GetModel(registry_pb2.GetModelRequest(ref="nope"))) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stub.SetAlias(registry_pb2.SetAliasRequest(alias="x", target="nope"))) == \
        grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stub.SetAlias(registry_pb2.SetAliasRequest(alias="alpha", target="alpha@v1"))) == \
        grpc.StatusCode.ALREADY_EXISTS  # an alias may not shadow a model
    bad = registry_pb2.ModelRecord(name="bad/name", version="v1", path="/x")
    assert code_of(lambda: stub.RegisterModel(registry_pb2.RegisterModelRequest(record=bad))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.DeleteAlias(registry_pb2.DeleteAliasRequest(alias="nope"))) == \
        grpc.StatusCode.NOT_FOUND
    # a canary split: validated, stored, listed
    stub.SetAlias(registry_pb2.SetAliasRequest(alias="canaried", target="alpha@v1", canary="alpha@v2", canary_weight=0.1))
    listed = {a.alias: a for a in stub.ListModels(registry_pb2.ListModelsRequest()).aliases}
    assert (listed["canaried"].canary, round(listed["canaried"].canary_weight, 3)) == ("alpha@v2", 0.1)
    for bad_split in (dict(canary="alpha@v2", canary_weight=1.5), dict(canary_weight=0.5)):
        request = registry_pb2.SetAliasRequest(alias="c2", target="alpha@v1", **bad_split)
        assert code_of(lambda r=request: stub.SetAlias(r)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.SetAlias(registry_pb2.SetAliasRequest(alias="c2", target="alpha@v1", canary="nope@v9",
                                                                      canary_weight=0.5))) == grpc.StatusCode.NOT_FOUND

    metrics = wait_for(lambda: (m := scrape(service.announced("METRICS")))
                       .get('tokenfleet_registry_versions{model="alpha",status="disabled"}') == 1 and m,
                       "registry metrics follow the registry")
    assert metrics['tokenfleet_registry_versions{model="alpha",status="ready"}'] == 1
    assert metrics["tokenfleet_registry_aliases"] >= 1


def test_watch_streams_every_change(registry, default_model_dir):
    _, _, stub = registry
    watch = stub.Watch(registry_pb2.WatchRequest())
    first = next(watch)
    register(stub, "watched", str(default_model_dir))
    seen = next(s for s in watch if any(m.name == "watched" for m in s.models))
    assert len(seen.models) == len(first.models) + 1
    watch.cancel()


def test_cli_register_list_alias(registry, default_model_dir):
    _, service, _ = registry

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tokenfleet.cli", "models", *args, "--registry", service.address],
                              capture_output=True, text=True, timeout=120, env={**os.environ})

    out = cli("register", "cli-model", "--path", str(default_model_dir), "--version", "2026-11", "--dtype", "float32")
    assert out.returncode == 0 and "registered cli-model@2026-11" in out.stdout, out.stderr
    assert cli("alias", "cli-alias", "cli-model@2026-11").returncode == 0
    listing = cli("list").stdout
    assert "cli-model@2026-11" in listing and "float32" in listing and "cli-alias -> cli-model@2026-11" in listing
    again = cli("register", "cli-model", "--path", str(default_model_dir), "--version", "2026-11")  # keeps its dtype
    assert again.returncode == 0 and "already registered cli-model@2026-11" in again.stdout, again.stderr
    bad = cli("register", "cli-model", "--path", str(default_model_dir), "--version", "2026-11", "--dtype", "bfloat16")
    assert bad.returncode == 2 and "immutable" in bad.stderr
    missing = cli("alias", "other", "no-such-model")
    assert missing.returncode == 2 and "not registered" in missing.stderr
    assert cli("alias", "cli-alias", "--delete").returncode == 0
    assert "cli-alias" not in cli("list").stdout


def test_two_models_are_served_by_their_own_workers(registry, default_model_dir):
    etcd, service, stub = registry
    register(stub, "smol-bf16", str(default_model_dir), dtype="bfloat16")
    register(stub, "smol-fp32", str(default_model_dir), dtype="float32")
    stub.SetAlias(registry_pb2.SetAliasRequest(alias="prod", target="smol-fp32@v1"))
    common = ["--registry", service.address, "--etcd", etcd.endpoint, "--threads", "1", "--num-blocks", "64"]
    bf16 = start_service("tokenfleet.services.decode", *common, "--model-name", "smol-bf16", "--replica-id", "w-bf16")
    fp32 = start_service("tokenfleet.services.decode", *common, "--model-name", "prod", "--replica-id", "w-fp32")
    router = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint, "--registry", service.address)
    gateway = start_service("tokenfleet.services.gateway", "--router", router.address, "--registry", service.address)
    try:
        records = wait_for(lambda: (r := replicas(etcd.endpoint)) and len(r) >= 2 and r, "both workers registered")
        assert {(r.model, r.model_version) for r in records.values()} == {("smol-bf16", "v1"), ("smol-fp32", "v1")}
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=120)
        wait_for(lambda: _served(client, "smol-bf16") and _served(client, "prod"), "gateway serves both models", 120)
        ids = {m.id for m in client.models.list().data}
        assert {"smol-bf16", "smol-fp32", "prod"} <= ids

        for model, busy, idle in [("smol-bf16", bf16, fp32), ("smol-fp32@v1", fp32, bf16), ("prod", fp32, bf16)]:
            steps = {w.address: load_report(w.address).num_steps for w in (bf16, fp32)}
            r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
            assert r.model == model and r.usage.completion_tokens == 4
            assert load_report(busy.address).num_steps > steps[busy.address]
            assert load_report(idle.address).num_steps == steps[idle.address]  # never sent to the other model

        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="smol-fp32@v9", prompt="x", max_tokens=1)
    finally:
        for s in (gateway, router, bf16, fp32):
            s.stop()


def _served(client, model: str) -> bool:
    try:
        client.completions.create(model=model, prompt="hi", max_tokens=1)
        return True
    except openai.APIError:
        return False


def test_the_first_worker_pins_what_auto_serves_for_the_whole_fleet(registry, default_model_dir):
    """A record with dtype "auto" is resolved once: the first pin stands (compare-and-set), re-registering keeps it,
    and a worker whose own fastest dtype differs serves the pin and says so in its replica record."""
    import torch

    from tokenfleet.models.auto_dtype import DtypeChoice
    from tokenfleet.models.loader import resolve_dtype

    etcd, service, stub = registry
    register(stub, "smol-auto", str(default_model_dir), dtype="auto")
    register(stub, "smol-own", str(default_model_dir), dtype="float32")
    for bad in ("not json", "{}", '{"dtype": "auto"}', ""):
        assert code_of(lambda b=bad: stub.PinNumerics(registry_pb2.PinNumericsRequest(ref="smol-auto", numerics=b))) \
            == grpc.StatusCode.INVALID_ARGUMENT, bad
    here = resolve_dtype("auto", torch.device("cpu"), model_dir=default_model_dir)
    other = "float32" if here == "bfloat16" else "bfloat16"
    pin = DtypeChoice(other, "another machine's measurement", "measured", {"fp32@64": 1.0}, "machine B").to_json()
    mine = DtypeChoice(here, "this machine's", "measured", {}, "machine A").to_json()
    own = stub.PinNumerics(registry_pb2.PinNumericsRequest(ref="smol-own", numerics=pin))
    assert (own.dtype, own.numerics) == ("float32", "")  # a record with a dtype of its own takes no pin
    as_gateway = registry_pb2_grpc.RegistryServiceStub(grpc_channel(service.address, "registry", "gateway"))
    assert code_of(lambda: as_gateway.PinNumerics(registry_pb2.PinNumericsRequest(ref="smol-auto", numerics=pin))) \
        == grpc.StatusCode.PERMISSION_DENIED
    as_worker = registry_pb2_grpc.RegistryServiceStub(grpc_channel(service.address, "registry", "worker"))
    assert as_worker.PinNumerics(registry_pb2.PinNumericsRequest(ref="smol-auto", numerics=pin)).numerics == pin
    assert stub.PinNumerics(registry_pb2.PinNumericsRequest(ref="smol-auto", numerics=mine)).numerics == pin
    assert not register(stub, "smol-auto", str(default_model_dir), dtype="auto").created  # same settings: a no-op
    assert stub.GetModel(registry_pb2.GetModelRequest(ref="smol-auto")).numerics == pin

    worker = start_service("tokenfleet.services.decode", "--registry", service.address, "--etcd", etcd.endpoint,
                           "--threads", "1", "--num-blocks", "64", "--model-name", "smol-auto",
                           "--replica-id", "w-auto")
    try:
        record = wait_for(lambda: replicas(etcd.endpoint).get("replicas/smol-auto/w-auto"), "registration")
        assert f"/{other}/" in record.kv_layout, record.kv_layout  # the pin's dtype serves
        assert f"serves the record's {other}" in record.numerics and f"fastest is {here}" in record.numerics, \
            record.numerics
        assert any("serving the record's pin" in line for line in worker.stderr_lines + worker.stdout_lines)
    finally:
        worker.stop()
