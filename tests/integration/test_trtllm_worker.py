"""Workers started with ``--backend trtllm`` (real processes, real etcd, router and gateway, the
openai client), with TensorRT-LLM replaced by the in-repo test double of its API
(TOKENFLEET_TRTLLM_API=tests.trtllm_double:api; the double's "cache transceiver" is a shared
folder). What this checks is our wiring: flags -> spec -> LLM kwargs, registration, load reports
with the TRT layout, the Prefill RPC carrying a hand-off, generation_only on the decode worker,
streaming through the gateway, and a failed engine leaving the fleet."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.integration.conftest import channel, load_report, start_service, wait_for
from tests.integration.test_membership import replicas
from tokenfleet.cluster.etcd_server import EtcdServer

MODEL = "smol"


@pytest.fixture(scope="module")
def fake_engine_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trt-engine")
    (path / "config.json").write_text(json.dumps({
        "pretrained_config": {"vocab_size": 49152, "max_position_embeddings": 8192, "dtype": "bfloat16",
                              "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}},
        "build_config": {"max_seq_len": 4096}}))
    (path / "rank0.engine").write_bytes(b"")  # an engine dir: the TRT-engine LLM class is chosen
    return path


@pytest.fixture(scope="module")
def cluster(default_model_dir, fake_engine_dir, tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("TOKENFLEET_TRTLLM_API", "TRTLLM_DOUBLE_FABRIC")}
    os.environ["TOKENFLEET_TRTLLM_API"] = "tests.trtllm_double:api"
    os.environ["TRTLLM_DOUBLE_FABRIC"] = str(tmp_path_factory.mktemp("fabric"))
    etcd = EtcdServer.create().start()
    common = ("--backend", "trtllm", "--model", str(fake_engine_dir), "--tokenizer", str(default_model_dir),
              "--etcd", etcd.endpoint, "--model-name", MODEL, "--lease-ttl", "5")
    prefill = start_service("tokenfleet.services.prefill", *common, "--replica-id", "trt-p")
    decode = start_service("tokenfleet.services.decode", *common, "--replica-id", "trt-d")
    router = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint)
    gateway = start_service("tokenfleet.services.gateway", "--router", router.address,
                            "--model", f"{MODEL}={default_model_dir}")
    import openai

    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=60)
    wait_for(lambda: len(replicas(etcd.endpoint)) == 2, "both workers registered")
    yield client, prefill, decode, etcd
    for service in (gateway, router, decode, prefill):
        service.stop()
    etcd.cleanup()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_workers_register_and_report_the_trt_layout(cluster):
    _, prefill, decode, etcd = cluster
    records = replicas(etcd.endpoint)
    assert {r.roles for r in records.values()} == {("prefill",), ("decode",)}
    report = load_report(decode.address)
    assert report.layout.dtype == "trtllm-fp8" and report.layout.block_size == 32
    assert report.layout.num_layers == 0  # raw blocks never leave TensorRT-LLM


def test_long_prompt_is_disaggregated_through_a_hand_off_and_streams(cluster):
    client, prefill, decode, _ = cluster
    before = load_report(decode.address).num_remote_prefills
    prompt = "Summarize the following notes about the warehouse inventory. " * 20  # > 128 tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch(r"(t\d+ ){8}", text), text  # the double's 8 tokens, the first not repeated
    assert chunks[-1].usage.completion_tokens == 8
    assert load_report(decode.address).num_remote_prefills == before + 1
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                           temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == "length"


def test_short_prompt_runs_on_the_decode_worker_alone(cluster):
    client, _, decode, _ = cluster
    before = load_report(decode.address).num_remote_prefills
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0)
    assert re.fullmatch(r"(t\d+ ){3}", reply.choices[0].message.content)
    assert load_report(decode.address).num_remote_prefills == before


def test_a_failed_engine_deregisters_and_exits(fake_engine_dir, tmp_path):
    import grpc

    from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    etcd = EtcdServer.create().start()
    os.environ.update(TOKENFLEET_TRTLLM_API="tests.trtllm_double:api", TRTLLM_DOUBLE_FAIL_AFTER="2")
    try:
        worker = start_service("tokenfleet.services.decode", "--backend", "trtllm", "--model", str(fake_engine_dir),
                               "--tokenizer", str(fake_engine_dir),
                               "--etcd", etcd.endpoint, "--model-name", MODEL, "--replica-id", "doomed",
                               "--lease-ttl", "30")
    finally:
        del os.environ["TRTLLM_DOUBLE_FAIL_AFTER"]
    try:
        wait_for(lambda: "replicas/smol/doomed" in replicas(etcd.endpoint), "registration")
        stub = engine_pb2_grpc.EngineServiceStub(channel(worker.address, "worker", "gateway"))

        def generate(request_id: str) -> list:
            return list(stub.Generate(engine_pb2.GenerateRequest(
                request_id=request_id, prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=2))))

        assert generate("ok")[-1].HasField("final")  # request 2 (1 was the health generation)
        with pytest.raises(grpc.RpcError) as failed:
            generate("boom")  # request 3: the "device" fails
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        # Not waiting for the 30 s lease: the worker deletes its key and exits non-zero.
        wait_for(lambda: "replicas/smol/doomed" not in replicas(etcd.endpoint), "deregistration", 20)
        assert worker.proc.wait(timeout=60) == 3
    finally:
        worker.stop()
        etcd.cleanup()
