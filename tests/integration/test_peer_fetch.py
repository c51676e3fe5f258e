"""Peer fetch between real worker processes over gRPC (mutual TLS, membership in etcd), fp32: a worker
told that a peer holds a prompt's prefix pulls the blocks it lacks (from the peer's pool or from its
disk tier) and computes only the rest, with greedy output identical to the peer's; a peer that is not a
registered replica, or is gone, costs only the recompute; a mismatched layout is refused."""

from __future__ import annotations

import os

import grpc
import pytest

from tests.integration.conftest import channel, load_report, start_service, wait_for
from tests.integration.test_disaggregation import generate, idle, request
from tests.integration.test_membership import replicas
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

SYSTEM = "You are the support assistant of a bicycle shop. Answer briefly and politely. " * 5


def start(model_dir, etcd: EtcdServer, replica_id: str, *extra: str):
    os.environ["TOKENFLEET_CHECK_INVARIANTS"] = "1"
    try:
        return start_service("tokenfleet.services.decode", "--role", "both", "--model", str(model_dir),
                             "--dtype", "float32", "--threads", "1", "--num-blocks", "48", "--etcd", etcd.endpoint,
                             "--replica-id", replica_id, "--model-name", "smol", *extra)
    finally:
        del os.environ["TOKENFLEET_CHECK_INVARIANTS"]


@pytest.fixture(scope="module")
def pair(default_model_dir, tmp_path_factory):
    etcd = EtcdServer.create().start()
    a = start(default_model_dir, etcd, "a", "--kv-tier", f"disk:{tmp_path_factory.mktemp('tier')}")
    b = start(default_model_dir, etcd, "b")
    wait_for(lambda: len(replicas(etcd.endpoint)) == 2, "both workers registered")
    yield a, b
    b.stop()
    a.stop()
    etcd.cleanup()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def with_peer(prompt: list[int], request_id: str, replica_id: str, address: str) -> engine_pb2.GenerateRequest:
    msg = request(prompt, request_id)
    msg.prefix_source.replica_id, msg.prefix_source.address = replica_id, address
    msg.prefix_source.num_blocks = len(prompt) // 16
    return msg


def test_a_prefix_held_by_a_peer_is_fetched_not_recomputed(pair, tokenizer):
    a, b = pair
    prompt = tokenizer.encode(SYSTEM + "Customer: my chain keeps slipping, why?")
    expected = generate(a.address, request(prompt, "on-a"))
    before = load_report(b.address)
    got = generate(b.address, with_peer(prompt, "on-b", "a", a.address))
    after = idle(b.address)
    assert got[0] == expected[0] and got[1] == expected[1]
    assert after.num_peer_blocks_received - before.num_peer_blocks_received == len(prompt) // 16
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed < 16  # only the last block
    assert got[2].usage.cached_prompt_tokens >= (len(prompt) // 16) * 16 - 16
    assert load_report(a.address).num_peer_blocks_served >= len(prompt) // 16


def test_blocks_in_the_peers_disk_tier_are_fetched_too(pair, tokenizer):
    a, b = pair
    prompt = tokenizer.encode(SYSTEM + "Customer: how often should I replace brake pads?")
    expected = generate(a.address, request(prompt, "tier-a"))
    for i in range(4):  # other prompts push it out of a's pool (48 blocks) into a's disk tier
        generate(a.address, request(tokenizer.encode(f"Unrelated text number {i}. " * 60), f"flood-{i}", max_tokens=1))
    assert idle(a.address).tier_bytes_used > 0
    before = load_report(b.address)
    got = generate(b.address, with_peer(prompt, "tier-b", "a", a.address))
    after = idle(b.address)
    assert got[0] == expected[0]
    assert after.num_peer_blocks_received - before.num_peer_blocks_received >= len(prompt) // 16 - 4


def test_an_unregistered_or_dead_peer_costs_only_the_recompute(pair, tokenizer):
    a, b = pair
    prompt = tokenizer.encode(SYSTEM + "Customer: do you repair e-bikes?")
    expected = generate(a.address, request(prompt, "ref"))
    before = load_report(b.address)
    impostor = generate(b.address, with_peer(prompt, "x", "mallory", a.address))  # not the registered id
    dead = generate(b.address, with_peer(prompt + [13], "y", "a", "127.0.0.1:1"))  # registered id, wrong address
    after = idle(b.address)
    assert impostor[0] == expected[0]
    assert dead[2].usage.prompt_tokens == len(prompt) + 1
    assert after.num_peer_fetch_failures - before.num_peer_fetch_failures == 2
    assert after.num_peer_blocks_received == before.num_peer_blocks_received


def test_fetch_blocks_refuses_another_layout(pair, tokenizer):
    a, _ = pair
    with channel(a.address, "worker", "worker") as ch:
        layout = engine_pb2.KVLayout(hash_salt="other", dtype="float32", block_size=16, num_layers=30, num_kv_heads=3,
                                     head_dim=64)
        with pytest.raises(grpc.RpcError) as e:
            list(engine_pb2_grpc.EngineServiceStub(ch).FetchBlocks(
                engine_pb2.FetchBlocksRequest(block_hashes=[b"x" * 32], layout=layout)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
