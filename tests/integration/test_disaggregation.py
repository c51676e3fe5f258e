"""Disaggregated prefill/decode between real worker processes over gRPC (mutual TLS, membership in
etcd): identical greedy output, the decode worker computes no prompt, only missing blocks travel,
cancellation at every phase frees every block on both sides, a refused layout, a dead prefill
replica, and a prefill source that is not a registered replica refused."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import threading
import time

import grpc
import pytest

from tests.integration.conftest import channel, load_report, start_service, wait_for
from tests.integration.test_membership import replicas
from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc

SYSTEM = "You are the support assistant of a hardware store. Answer briefly and politely. " * 4


def start(model_dir, role: str, etcd: EtcdServer, replica_id: str):
    os.environ["TOKENFLEET_CHECK_INVARIANTS"] = "1"  # both engines check their block pools after every step
    try:
        return start_service("tokenfleet.services.decode", "--role", role, "--model", str(model_dir),
                             "--dtype", "float32", "--threads", "1", "--num-blocks", "256",
                             "--transfer-timeout", "5", "--etcd", etcd.endpoint, "--replica-id", replica_id,
                             "--model-name", "smol")
    finally:
        del os.environ["TOKENFLEET_CHECK_INVARIANTS"]


@pytest.fixture(scope="module")
def etcd():
    server = EtcdServer.create().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def pair(default_model_dir, etcd):
    """A prefill replica registered as "p" and a decode replica, both in etcd (a decode worker takes
    KV only from registered prefill replicas)."""
    prefill = start(default_model_dir, "prefill", etcd, "p")
    try:
        decode = start(default_model_dir, "decode", etcd, "d")
    except BaseException:
        prefill.stop()
        raise
    wait_for(lambda: len(replicas(etcd.endpoint)) == 2, "both workers registered")
    yield prefill, decode
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def request(prompt: list[int], request_id: str, prefill_address: str = "", max_tokens: int = 12):
    msg = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    if prefill_address:
        msg.prefill.address = prefill_address
        msg.prefill.replica_id = "p"
    return msg


def generate(address: str, msg) -> tuple[list[int], str, engine_pb2.GenerateFinal]:
    with channel(address, "worker", "gateway") as gateway:
        tokens, text, final = [], "", None
        for response in engine_pb2_grpc.EngineServiceStub(gateway).Generate(msg):
            if response.HasField("chunk"):
                tokens += response.chunk.token_ids
                text += response.chunk.text
            elif response.HasField("final"):
                final = response.final
        assert final is not None
        return tokens, text, final


def idle(address: str) -> engine_pb2.LoadReport:
    return wait_for(lambda: (r := load_report(address)).num_blocks_used == 0 and r.num_in_flight == 0 and r,
                    f"{address} back to idle")


def test_disaggregated_output_equals_colocated_and_decode_prefills_nothing(pair, tokenizer):
    prefill, decode = pair
    before = load_report(decode.address)
    for i, text in enumerate(["The capital of France is", "Once upon a time, in a quiet village,",
                              SYSTEM + "Customer: do you sell hammers?"]):
        prompt = ids(tokenizer, text)
        colocated = generate(prefill.address, request(prompt, f"colo-{i}"))
        disaggregated = generate(decode.address, request(prompt, f"dis-{i}", prefill.address))
        assert disaggregated[0] == colocated[0] and disaggregated[1] == colocated[1]
        assert disaggregated[2].usage.prompt_tokens == len(prompt)
        assert disaggregated[2].usage.completion_tokens == 12
    after = idle(decode.address)
    assert after.num_prompt_tokens_computed == before.num_prompt_tokens_computed  # no prompt prefill here
    assert after.num_remote_prefills == before.num_remote_prefills + 3
    assert load_report(prefill.address).num_kv_blocks_sent >= after.num_kv_blocks_received > 0
    idle(prefill.address)


def test_shared_prefix_transfers_only_the_missing_blocks(pair, tokenizer):
    prefill, decode = pair
    first = ids(tokenizer, SYSTEM * 2 + "Customer: where are the screws?")
    second = ids(tokenizer, SYSTEM * 2 + "Customer: what time do you open on Sunday?")
    shared_blocks = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // 16
    generate(decode.address, request(first, "share-1", prefill.address))
    received = idle(decode.address).num_kv_blocks_received
    generate(decode.address, request(second, "share-2", prefill.address))
    after = idle(decode.address)
    assert shared_blocks >= 4
    assert after.num_kv_blocks_received - received == -(-len(second) // 16) - shared_blocks


def test_cancelling_at_random_phases_frees_every_block_on_both_sides(pair, tokenizer):
    prefill, decode = pair
    rng = random.Random(7)
    gateway = channel(decode.address, "worker", "gateway")
    stub = engine_pb2_grpc.EngineServiceStub(gateway)
    prompts = [ids(tokenizer, SYSTEM * rng.randint(1, 4) + f"Customer question number {i}?") for i in range(16)]

    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            _one(i)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:  # our own cancel is expected; anything else is not
                errors.append(e)
        except BaseException as e:  # noqa: BLE001 - a thread's error must fail the test, not vanish
            errors.append(e)

    def _one(i: int) -> None:
        call = stub.Generate(request(prompts[i], f"cancel-{i}", prefill.address, max_tokens=30))
        phase = i % 4  # 0: queued/prefilling, 1: transferring, 2: just after the first token, 3: decoding
        if phase < 2:
            time.sleep(rng.uniform(0.0, 0.3) if phase == 0 else rng.uniform(0.3, 1.5))
            call.cancel()
            return
        for n, _ in enumerate(call):
            if n >= (1 if phase == 2 else 5):
                call.cancel()
                return

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    gateway.close()
    assert not errors, errors
    # Both pools back to the idle baseline (prefill: held blocks released; decode: reservations freed),
    # and the engines, which checked their invariants after every step, are still serving.
    idle(decode.address)
    idle(prefill.address)
    assert generate(decode.address, request(prompts[0], "after-cancel", prefill.address))[2].usage.completion_tokens == 12


def test_a_mismatched_layout_is_refused(pair, tokenizer):
    prefill, _ = pair
    report = load_report(prefill.address)
    layout = engine_pb2.KVLayout()
    layout.CopyFrom(report.layout)
    layout.block_size = 32
    with channel(prefill.address, "worker", "worker") as peer:  # Prefill is a worker's call
        stream = engine_pb2_grpc.EngineServiceStub(peer).Prefill(engine_pb2.PrefillRequest(
            request_id="bad-layout", prompt_token_ids=ids(tokenizer, "Hello there"), layout=layout,
            sampling=common_pb2.SamplingParams(temperature=0.0)))
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size" in info.value.details()


def put_replica(etcd: EtcdServer, record) -> None:
    async def write() -> None:
        client = EtcdClient(etcd.endpoint)
        try:
            await client.put(record.key, record.to_json())
        finally:
            await client.close()

    asyncio.run(write())


def test_an_unreachable_prefill_replica_falls_back_to_local_prefill(pair, etcd, tokenizer):
    """A registered prefill replica that cannot be reached: the decode worker computes the prompt itself."""
    prefill, decode = pair
    ghost = dataclasses.replace(replicas(etcd.endpoint)["replicas/smol/p"], replica_id="ghost", address="127.0.0.1:1")
    put_replica(etcd, ghost)
    prompt = ids(tokenizer, "The three primary colours are")
    expected = generate(prefill.address, request(prompt, "fallback-colo"))
    msg = request(prompt, "fallback", "127.0.0.1:1")
    msg.prefill.replica_id = "ghost"
    got = wait_for(lambda: _generate_unless_refused(decode.address, msg), "the decode worker sees the ghost replica")
    assert got[0] == expected[0]
    idle(decode.address)


def _generate_unless_refused(address: str, msg):
    try:
        return generate(address, msg)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.PERMISSION_DENIED:
            raise
        return None


@pytest.mark.parametrize("replica_id, address", [("p", "127.0.0.1:1"), ("stranger", ""), ("d", "")])
def test_a_prefill_source_that_is_not_a_registered_prefill_replica_is_refused(pair, tokenizer, replica_id, address):
    """Registered "p" at another address, an unregistered replica, a decode-only replica: PERMISSION_DENIED,
    no connection is made, and nothing from it reaches the decode worker's cache."""
    prefill, decode = pair
    before = idle(decode.address)
    msg = request(ids(tokenizer, SYSTEM + "Customer: any paint?"), f"refused-{replica_id}", prefill.address)
    msg.prefill.replica_id = replica_id
    msg.prefill.address = address or (decode.address if replica_id == "d" else prefill.address)
    with pytest.raises(grpc.RpcError) as info:
        generate(decode.address, msg)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "refused as a KV source" in info.value.details()
    after = idle(decode.address)
    assert after.num_kv_blocks_received == before.num_kv_blocks_received
    assert after.num_remote_prefills == before.num_remote_prefills
    assert after.num_prefix_hit_tokens == before.num_prefix_hit_tokens


def test_through_the_gateway_the_router_disaggregates_long_prompts(default_model_dir):
    """etcd + prefill worker + decode-only worker + router + gateway, the official openai client."""
    import openai

    etcd = EtcdServer.create().start()
    services = []
    try:
        for role, replica_id in (("prefill", "p0"), ("decode", "d0")):
            services.append(start_service(
                "tokenfleet.services.decode", "--role", role, "--model", str(default_model_dir), "--dtype", "float32",
                "--threads", "1", "--num-blocks", "128", "--etcd", etcd.endpoint, "--replica-id", replica_id,
                "--model-name", "smol"))
        prefill, decode = services
        router = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint, "--disagg-min-tokens", "64")
        services.append(router)
        gateway = start_service("tokenfleet.services.gateway", "--router", router.address,
                                "--model", f"smol={default_model_dir}")
        services.append(gateway)
        wait_for(lambda: len(replicas(etcd.endpoint)) == 2, "both workers registered")
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell nails?"}]
        warmed = load_report(decode.address).num_prompt_tokens_computed  # the worker's warm-up generation
        reply = wait_for(lambda: _chat(client, messages), "a reply through the disaggregated fleet")
        assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content
        report = load_report(decode.address)
        assert report.num_remote_prefills >= 1 and report.num_prompt_tokens_computed == warmed
        assert load_report(prefill.address).num_kv_blocks_sent >= -(-reply.usage.prompt_tokens // 16)
        short = client.completions.create(model="smol", prompt="Hi", max_tokens=2, temperature=0)
        assert short.usage.completion_tokens == 2
        assert load_report(decode.address).num_prompt_tokens_computed > warmed  # short prompts prefill locally
    finally:
        for service in reversed(services):
            service.stop()
        etcd.cleanup()


def _chat(client, messages):
    import openai

    try:
        return client.chat.completions.create(model="smol", messages=messages, max_tokens=8, temperature=0)
    except openai.APIError:
        return None
