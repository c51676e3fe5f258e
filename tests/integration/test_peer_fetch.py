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
def etcd():
    server = EtcdServer.create().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def pair(default_model_dir, tmp_path_factory, etcd):
    a = start(default_model_dir, etcd, "a", "--kv-tier", f"disk:{tmp_path_factory.mktemp('tier')}")
    b = start(default_model_dir, etcd, "b")
    wait_for(lambda: len(replicas(etcd.endpoint)) == 2, "both workers registered")
    yield a, b
    b.stop()
    a.stop()


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


def test_a_drained_worker_hands_its_blocks_to_peers_and_keeps_them_on_disk(pair, tokenizer, default_model_dir,
                                                                          tmp_path, etcd):
    """SIGTERM: the worker stops taking requests but keeps sending blocks to peers until none asks for a
    while; it then copies its pool to its disk tier, so when it starts again on the same folder it reports
    the prompt's blocks as held in its second tier (apart from the pool) and restores them on a hit."""
    _, b = pair
    tier = f"disk:{tmp_path / 'c'}"
    args = ("--kv-tier", tier, "--handoff-idle-seconds", "3", "--grace-seconds", "60")
    c = start(default_model_dir, etcd, "c", *args)
    prompt = tokenizer.encode(SYSTEM + "Customer: can you true a wheel while I wait?")
    try:
        expected = generate(c.address, request(prompt, "on-c"))
        wait_for(lambda: len(replicas(etcd.endpoint)) == 3, "c registered")
        c.proc.terminate()  # drains (nothing open), then hands off until 3 s without a fetch
        before = load_report(b.address)
        got = generate(b.address, with_peer(prompt, "from-draining-c", "c", c.address))
        assert got[0] == expected[0]
        after = idle(b.address)
        assert after.num_peer_blocks_received > before.num_peer_blocks_received  # b held the system prompt's
        assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed < 16  # only the last block
        assert c.proc.wait(timeout=60) == 0
    finally:
        c.stop()
    c = start(default_model_dir, etcd, "c", *args)
    try:
        first = load_report(c.address)
        assert first.hashes_reset and len(first.added_tier_block_hashes) >= len(prompt) // 16
        assert set(first.added_tier_block_hashes) == set(first.added_block_hashes)  # nothing in the pool yet
        again = generate(c.address, request(prompt, "after-restart"))
        assert again[0] == expected[0]
        assert again[2].usage.cached_prompt_tokens >= (len(prompt) // 16) * 16 - 16
        later = wait_for(lambda: (r := load_report(c.address)).num_tier_hit_blocks and r, "the tier hits reported")
        assert later.num_tier_hit_blocks >= len(prompt) // 16 - 1
    finally:
        c.stop()


def test_a_prefill_replica_fetches_what_the_decode_replica_holds(pair, tokenizer):
    """Disaggregated: the decode replica (a) holds the transcript (here: the whole prompt, as after the turn
    it generated); the prefill replica (b) it asks for the prompt fetches those blocks from a instead of
    recomputing them (GenerateRequest.prefix_source forwarded in PrefillRequest), output unchanged."""
    a, b = pair
    prompt = tokenizer.encode(SYSTEM + "Customer: I need a new saddle, something for long rides. Ideas?")
    expected = generate(a.address, request(prompt, "turn-on-a"))
    msg = with_peer(prompt, "disagg", "a", a.address)
    msg.prefill.replica_id, msg.prefill.address = "b", b.address
    before_b = load_report(b.address)
    got = generate(a.address, msg)
    after_b = idle(b.address)
    assert got[0] == expected[0] and got[1] == expected[1]
    assert after_b.num_peer_blocks_received > before_b.num_peer_blocks_received
    assert after_b.num_prompt_tokens_computed - before_b.num_prompt_tokens_computed < 16  # b computed the tail only
    assert after_b.num_peer_fetch_failures == before_b.num_peer_fetch_failures
