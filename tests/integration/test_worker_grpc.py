"""The engine worker as a real process speaking gRPC on loopback."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.integration.conftest import channel, load_report, start_service, wait_for
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.llm import LLM
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc


def stub_for(address: str, role: str = "gateway") -> engine_pb2_grpc.EngineServiceStub:
    """A worker's stub with ``role``'s certificate: gateways generate, operators abort and drain."""
    return engine_pb2_grpc.EngineServiceStub(channel(address, "worker", role))


@pytest.fixture(scope="module")
def prompt(default_model_dir) -> list[int]:
    tokenizer = Tokenizer(default_model_dir)
    return tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": "What is a cloud?"}]))


def test_health_and_reflection(worker):
    operator = channel(worker.address, "worker", "operator")  # reflection is an operator's tool
    health = health_pb2_grpc.HealthStub(operator)
    status = health.Check(health_pb2.HealthCheckRequest(service="tokenfleet.v1.EngineService")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    services = ProtoReflectionDescriptorDatabase(operator).get_services()
    assert "tokenfleet.v1.EngineService" in services and "grpc.health.v1.Health" in services


def test_generate_streams_the_engine_output(worker, default_model_dir, prompt):
    stub = stub_for(worker.address)
    request = engine_pb2.GenerateRequest(
        request_id="g1", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.0)
    )
    responses = list(stub.Generate(request))
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[-1] == "final" and set(kinds[:-1]) == {"chunk"}
    tokens = [t for r in responses[:-1] for t in r.chunk.token_ids]
    text = "".join(r.chunk.text for r in responses[:-1])
    final = responses[-1].final
    expected = LLM(str(default_model_dir), dtype="float32", num_threads=1).generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0)
    )[0]
    assert tokens == expected.token_ids and text == expected.text
    assert final.usage.prompt_tokens == len(prompt) and final.usage.completion_tokens == len(tokens)
    assert final.request_id == "g1" and final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


@pytest.mark.parametrize(
    ("request_kwargs", "needle"),
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 2], "sampling": common_pb2.SamplingParams(temperature=-1.0)}, "temperature"),
        ({"prompt_token_ids": [1, 2], "sampling": common_pb2.SamplingParams(top_p=0.0)}, "top_p"),
        ({"prompt_token_ids": [10**6]}, "out of range"),
    ],
)
def test_bad_requests_are_invalid_argument(worker, request_kwargs, needle):
    with pytest.raises(grpc.RpcError) as info:
        list(stub_for(worker.address).Generate(engine_pb2.GenerateRequest(**request_kwargs)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in info.value.details()


def test_cancelled_stream_aborts_and_frees_blocks(worker, prompt):
    stub = stub_for(worker.address)
    idle = wait_for(lambda: (r := load_report(worker.address)).num_running == 0 and r, "idle worker")
    call = stub.Generate(engine_pb2.GenerateRequest(
        request_id="cancel-me", prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
    ))
    for _ in range(3):
        next(call)
    assert load_report(worker.address).num_running == 1
    call.cancel()
    after = wait_for(lambda: (r := load_report(worker.address)).num_running == 0 and r.num_in_flight == 0 and r, "abort")
    assert after.num_blocks_used == idle.num_blocks_used
    assert after.num_aborted == idle.num_aborted + 1
    # Aborted at the next step: far fewer steps ran than the 500 tokens asked for.
    assert after.num_steps - idle.num_steps < 100


def test_abort_rpc_ends_the_stream_with_abort(worker, prompt):
    stub = stub_for(worker.address)
    call = stub.Generate(engine_pb2.GenerateRequest(
        request_id="abort-rpc", prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
    ))
    next(call)
    stub_for(worker.address, "operator").Abort(engine_pb2.AbortRequest(request_id="abort-rpc"))
    rest = list(call)
    assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_ABORT


def test_sigterm_mid_stream_finishes_the_stream_then_exits(default_model_dir, prompt):
    service = start_service(
        "tokenfleet.services.decode", "--model", str(default_model_dir), "--dtype", "float32", "--threads", "1",
        "--num-blocks", "128",
    )
    try:
        stub = stub_for(service.address)
        call = stub.Generate(engine_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        ))
        first = next(call)
        service.proc.terminate()
        rest = list(call)
        tokens = list(first.chunk.token_ids) + [t for r in rest if r.HasField("chunk") for t in r.chunk.token_ids]
        assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(tokens) == 40
        assert service.proc.wait(timeout=60) == 0
    finally:
        service.stop()


def test_drain_rpc_finishes_in_flight_then_exits(default_model_dir, prompt):
    service = start_service(
        "tokenfleet.services.decode", "--model", str(default_model_dir), "--dtype", "float32", "--threads", "1",
        "--num-blocks", "128",
    )
    try:
        stub = stub_for(service.address)
        call = stub.Generate(engine_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        ))
        next(call)
        drained: list[engine_pb2.DrainResponse] = []
        operator = stub_for(service.address, "operator")
        drainer = threading.Thread(target=lambda: drained.append(operator.Drain(engine_pb2.DrainRequest())))
        drainer.start()
        rest = list(call)
        drainer.join(timeout=60)
        assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert drained and drained[0].num_drained == 1
        assert service.proc.wait(timeout=60) == 0  # drained workers exit on their own
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(engine_pb2.GenerateRequest(prompt_token_ids=prompt)))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        service.stop()


def test_worker_metrics_endpoint(default_model_dir, prompt):
    import urllib.request

    service = start_service(
        "tokenfleet.services.decode", "--model", str(default_model_dir), "--dtype", "float32", "--threads", "1",
        "--num-blocks", "64", "--metrics-port", "0",
    )
    try:
        metrics_address = service.announced("METRICS")  # printed before LISTENING
        list(stub_for(service.address).Generate(engine_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0))))
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=30) as response:
            text = response.read().decode()
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line and line[0] != "#"}
        assert samples["tokenfleet_worker_kv_blocks_used"] + samples["tokenfleet_worker_kv_blocks_free"] == 64
        assert samples["tokenfleet_worker_steps_total"] >= 3
        assert samples["tokenfleet_worker_running"] == 0
        # utilization: busy seconds, the steps' model FLOPs and bytes, and the measured peaks they are shares of
        assert samples["tokenfleet_worker_busy_seconds_total"] > 0 and samples["tokenfleet_worker_model_flops_total"] > 0
        assert samples["tokenfleet_worker_peak_flops"] > 0 and samples["tokenfleet_worker_peak_bytes_per_second"] > 0
        assert samples["tokenfleet_worker_model_bytes_total"] >= 3 * 0.5e9  # 3 steps, each reading ~0.5 GB of fp32 weights
    finally:
        service.stop()
