"""LoRA adapters through every layer: `tokenfleet up --lora a0=PATH` (fp32), the real `openai` client asks for
model `smol:a0`, and gets what PEFT's merged model gives greedily (run here in-process); `smol` stays the base
model; an adapter the workers do not have is a 400 naming it. Adapters registered in the registry (versions of
`bot`, base `smol`) are loaded by the running worker on first use; an operator loads another one over
`LoadAdapter`; the worker advertises what it holds in its load reports."""

from __future__ import annotations

import time

import grpc
import openai
import pytest
from tokenfleet.services.registry.convert import record_to_proto

from tests.integration.conftest import plane
from tests.model.helpers import greedy, make_core, run_to_completion
from tests.model.test_lora import make_adapter
from tokenfleet.api.chat_template import render_chat
from tokenfleet.cli import launcher
from tokenfleet.cluster.registry import ModelRecord
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc, registry_pb2, registry_pb2_grpc

QUESTION = "Name three fruits."


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    make_adapter(default_model_dir, root / "a0", root / "merged", seed=3)
    cluster = launcher.up(1, str(default_model_dir), "smol", 1, 0, dtype="float32", record=False,
                          lora=[f"a0={root / 'a0'}"])
    yield cluster, root
    cluster.stop()


def test_an_adapter_is_served_as_model_base_colon_name(served, default_model_dir):
    cluster, root = served
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]

    def ask(model: str) -> str:
        return client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0) \
            .choices[0].message.content or ""

    merged = make_core(root / "merged")
    prompt = merged.tokenizer.encode(render_chat(merged.tokenizer, messages))
    expected = merged.tokenizer.decode(run_to_completion(merged, {0: [("m", prompt, greedy(12))]})["m"])
    base = make_core(default_model_dir)
    plain = base.tokenizer.decode(run_to_completion(base, {0: [("b", prompt, greedy(12))]})["b"])
    assert ask("smol:a0") == expected
    assert ask("smol") == plain != expected
    with pytest.raises(openai.BadRequestError, match="nope"):
        ask("smol:nope")


def greedy_text(model_dir, messages, n: int = 12) -> str:
    core = make_core(model_dir)
    prompt = core.tokenizer.encode(render_chat(core.tokenizer, messages))
    return core.tokenizer.decode(run_to_completion(core, {0: [("r", prompt, greedy(n))]})["r"])


def test_registered_adapters_load_on_first_use_and_over_load_adapter(served, default_model_dir):
    cluster, root = served
    make_adapter(default_model_dir, root / "a1", root / "merged1", seed=5)
    messages = [{"role": "user", "content": QUESTION}]
    v1, v2 = greedy_text(root / "merged", messages), greedy_text(root / "merged1", messages)
    assert v1 != v2
    registry = registry_pb2_grpc.RegistryServiceStub(plane("operator").sync_channel(cluster.addresses["registry"],
                                                                                    "registry"))
    for version, folder in (("v1", "a0"), ("v2", "a1")):
        record = ModelRecord(name="bot", version=version, path=str(root / folder), base="smol", dtype="float32")
        registry.RegisterModel(registry_pb2.RegisterModelRequest(record=record_to_proto(record)))
    with pytest.raises(grpc.RpcError) as missing:  # an adapter's base must be registered
        orphan = ModelRecord(name="orphan", version="v1", path=str(root / "a0"), base="nobody")
        registry.RegisterModel(registry_pb2.RegisterModelRequest(record=record_to_proto(orphan)))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(model: str) -> str:
        return client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0) \
            .choices[0].message.content or ""

    deadline = time.monotonic() + 30
    while True:  # the gateway learns the new records from the registry's watch
        try:
            got = ask("bot")
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert got == v2  # the newest version, loaded by the worker on this first request
    assert ask("bot@v1") == v1

    worker = engine_pb2_grpc.EngineServiceStub(plane("operator").sync_channel(cluster.addresses["worker-0"], "worker"))
    with pytest.raises(grpc.RpcError) as bad:
        worker.LoadAdapter(engine_pb2.LoadAdapterRequest(name="late", path=str(root / "nowhere")))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    loaded = worker.LoadAdapter(engine_pb2.LoadAdapterRequest(name="late", path=str(root / "a1")))
    assert set(loaded.adapters) == {"a0", "bot@v1", "bot@v2", "late"}
    assert ask("smol:late") == v2
    report = next(iter(worker.Load(engine_pb2.LoadRequest(interval_ms=100))))
    assert set(report.adapters) == {"a0", "bot@v1", "bot@v2", "late"}  # what the router prefers replicas by
