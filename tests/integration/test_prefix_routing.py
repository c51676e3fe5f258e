"""Prefix-aware routing through a real router, etcd and workers: one tenant's prompts land on
one replica, the assignment is recorded in etcd's affinity map, and a restarted router
follows it at once."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.integration.conftest import channel, start_service, wait_for
from tests.integration.test_membership import replicas, start_worker
from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.v1 import router_pb2, router_pb2_grpc

TENANTS = ["a bakery", "a bicycle shop", "a law firm", "a zoo", "a bookshop"]


def system_prompt(tenant: str) -> str:
    return f"You are the assistant of {tenant}. " + "Be concise, accurate and friendly in every answer. " * 6


@pytest.fixture
def fleet(default_model_dir):
    etcd = EtcdServer.create().start()
    workers = []
    try:
        workers = [start_worker(default_model_dir, etcd, f"pw{i}", ttl=5) for i in range(3)]
        yield etcd, workers
    finally:
        for w in workers:
            w.stop()
        etcd.cleanup()


def affinity_keys(endpoint: str) -> dict[str, bytes]:
    async def read() -> dict[str, bytes]:
        client = EtcdClient(endpoint)
        try:
            return await client.get_prefix("affinity/smol/")
        finally:
            await client.close()
    return asyncio.run(read())


def pick(stub, prompt: list[int]) -> str:
    return stub.Pick(router_pb2.PickRequest(model="smol", prompt_token_ids=prompt)).replica_id


def test_same_prefix_lands_on_one_replica_and_survives_a_router_restart(fleet, default_model_dir):
    etcd, workers = fleet
    tokenizer = Tokenizer(default_model_dir)
    wait_for(lambda: len(replicas(etcd.endpoint)) == 3, "three workers registered")
    router = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint)
    try:
        stub = router_pb2_grpc.RouterServiceStub(channel(router.address, "router", "gateway"))
        wait_for(lambda: _picks(stub), "router sees the fleet")
        homes: dict[str, str] = {}
        for turn in range(3):
            for tenant in TENANTS:
                prompt = tokenizer.encode(system_prompt(tenant) + f"User turn {turn}: hello?")
                homes.setdefault(tenant, pick(stub, prompt))
                assert pick(stub, prompt) == homes[tenant]
            time.sleep(0.3)  # a load report clears the router's pending counts between turns
        assert len(set(homes.values())) >= 2  # tenants spread over replicas, not herded onto one
        recorded = wait_for(lambda: len(keys := affinity_keys(etcd.endpoint)) >= len(TENANTS) and keys,
                            "affinity entries in etcd")
        assert len(recorded) == len(TENANTS)  # written on assignment, not per request
    finally:
        router.stop()

    restarted = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint)
    try:
        stub = router_pb2_grpc.RouterServiceStub(channel(restarted.address, "router", "gateway"))
        wait_for(lambda: _picks(stub), "restarted router sees the fleet")
        for tenant in TENANTS:
            prompt = tokenizer.encode(system_prompt(tenant) + "A brand new question after the restart?")
            assert pick(stub, prompt) == homes[tenant]
    finally:
        restarted.stop()


def _picks(stub) -> bool:
    try:
        stub.Pick(router_pb2.PickRequest(model="smol"))
        return True
    except grpc.RpcError:
        return False
