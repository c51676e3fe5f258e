"""Router process over a real etcd and real workers: spreads load, follows membership."""

from __future__ import annotations

import time
import urllib.request
from collections import Counter

import grpc
import pytest

from tests.integration.conftest import channel, start_service, wait_for
from tests.integration.test_membership import replicas, start_worker
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.v1 import router_pb2, router_pb2_grpc


@pytest.fixture
def cluster(default_model_dir):
    etcd = EtcdServer.create().start()
    workers = [start_worker(default_model_dir, etcd, f"rw{i}", ttl=2) for i in range(2)]
    router = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint, "--metrics-port", "0")
    yield etcd, workers, router
    router.stop()
    for w in workers:
        w.stop()
    etcd.cleanup()


def pick(stub, model: str = "smol", policy=router_pb2.POLICY_UNSPECIFIED) -> router_pb2.PickResponse:
    return stub.Pick(router_pb2.PickRequest(model=model, policy=policy))


def test_pick_spreads_follows_membership_and_rejects_unknown_models(cluster):
    etcd, workers, router = cluster
    wait_for(lambda: len(replicas(etcd.endpoint)) == 2, "both workers registered")
    stub = router_pb2_grpc.RouterServiceStub(channel(router.address, "router", "gateway"))
    wait_for(lambda: _try_pick(stub), "router sees the fleet")
    addresses = {w.address for w in workers}

    burst = Counter(pick(stub).address for _ in range(10))  # faster than load reports: pending counts spread it
    assert set(burst) == addresses and min(burst.values()) >= 4
    robin = [pick(stub, policy=router_pb2.POLICY_ROUND_ROBIN).address for _ in range(4)]
    assert set(robin) == addresses and robin[0] != robin[1]

    with pytest.raises(grpc.RpcError) as info:
        pick(stub, model="no-such-model")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    metrics = scrape(router.announced("METRICS"))
    assert metrics['tokenfleet_router_picks_total{model="smol",result="ok"}'] >= 14
    assert metrics['tokenfleet_router_picks_total{model="",result="not_found"}'] == 1
    assert metrics['tokenfleet_router_replicas{model="smol",state="serving"}'] == 2

    etcd.stop()  # routers keep serving from their last view while etcd is away
    assert {pick(stub).address for _ in range(6)} == addresses
    etcd.start()

    dead, alive = workers
    dead.proc.kill()
    dead.proc.wait(timeout=10)
    wait_for(lambda: all(pick(stub).address == alive.address for _ in range(5)), "dead worker dropped", 30)
    time.sleep(0.5)
    assert {pick(stub).address for _ in range(6)} == {alive.address}


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def _try_pick(stub) -> bool:
    try:
        pick(stub)
        return True
    except grpc.RpcError:
        return False
