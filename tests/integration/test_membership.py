"""Workers register in a real etcd under a lease; draining, deregistration, expiry, etcd outages."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.integration.conftest import channel, start_service, wait_for
from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.cluster.membership import DRAINING, SERVING, ReplicaRecord
from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc


@pytest.fixture
def etcd():
    server = EtcdServer.create().start()
    yield server
    server.cleanup()


def replicas(endpoint: str) -> dict[str, ReplicaRecord]:
    async def read() -> dict[str, bytes]:
        client = EtcdClient(endpoint)
        try:
            return await client.get_prefix("replicas/")
        finally:
            await client.close()

    return {k: ReplicaRecord.from_json(v) for k, v in asyncio.run(read()).items()}


def start_worker(model_dir, etcd: EtcdServer, replica_id: str, ttl: int = 2):
    return start_service(
        "tokenfleet.services.decode", "--model", str(model_dir), "--dtype", "float32", "--threads", "1",
        "--num-blocks", "64", "--etcd", etcd.endpoint, "--lease-ttl", str(ttl), "--replica-id", replica_id,
        "--model-name", "smol",
    )


def test_register_drain_deregister(default_model_dir, etcd):
    worker = start_worker(default_model_dir, etcd, "w1", ttl=30)
    try:
        record = wait_for(lambda: replicas(etcd.endpoint).get("replicas/smol/w1"), "registration")
        assert record.address == worker.address and record.state == SERVING and record.roles == ("decode",)
        stub = engine_pb2_grpc.EngineServiceStub(channel(worker.address, "worker", "operator"))
        assert stub.Drain(engine_pb2.DrainRequest()).num_drained == 0
        assert worker.proc.wait(timeout=60) == 0
        assert "replicas/smol/w1" not in replicas(etcd.endpoint)  # deregistered at exit, not by the TTL
    finally:
        worker.stop()


def test_sigterm_marks_draining_before_exit(default_model_dir, etcd):
    worker = start_worker(default_model_dir, etcd, "w2", ttl=30)
    try:
        wait_for(lambda: replicas(etcd.endpoint).get("replicas/smol/w2"), "registration")
        stub = engine_pb2_grpc.EngineServiceStub(channel(worker.address, "worker", "gateway"))
        call = stub.Generate(engine_pb2.GenerateRequest(
            prompt_token_ids=list(range(100, 140)),
            sampling=common_pb2.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
        ))
        next(call)
        worker.proc.send_signal(signal.SIGTERM)
        seen = wait_for(lambda: (r := replicas(etcd.endpoint).get("replicas/smol/w2")) and r.state == DRAINING and r,
                        "draining state")
        assert seen.state == DRAINING
        assert list(call)[-1].HasField("final")
        assert worker.proc.wait(timeout=60) == 0
        assert "replicas/smol/w2" not in replicas(etcd.endpoint)
    finally:
        worker.stop()


def test_killed_worker_disappears_when_its_lease_expires(default_model_dir, etcd):
    worker = start_worker(default_model_dir, etcd, "w3", ttl=2)
    try:
        wait_for(lambda: replicas(etcd.endpoint).get("replicas/smol/w3"), "registration")
        worker.proc.kill()
        worker.proc.wait(timeout=10)
        wait_for(lambda: "replicas/smol/w3" not in replicas(etcd.endpoint), "lease expiry", deadline_s=30)
    finally:
        worker.stop()


def test_worker_survives_an_etcd_outage_and_is_registered_after(default_model_dir, etcd):
    worker = start_worker(default_model_dir, etcd, "w4", ttl=2)
    try:
        wait_for(lambda: replicas(etcd.endpoint).get("replicas/smol/w4"), "registration")
        etcd.stop()
        time.sleep(5)  # longer than the lease TTL
        stub = engine_pb2_grpc.EngineServiceStub(channel(worker.address, "worker", "gateway"))
        responses = list(stub.Generate(engine_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=4)
        )))
        assert responses[-1].HasField("final")  # still serving without etcd
        etcd.start()
        record = wait_for(lambda: replicas(etcd.endpoint).get("replicas/smol/w4"), "re-registration", deadline_s=60)
        assert record.address == worker.address
    finally:
        worker.stop()
        etcd.cleanup()


def test_record_roundtrip_and_key_rules():
    record = ReplicaRecord("r1", "m", "127.0.0.1:1", ("decode", "prefill"), num_blocks=8)
    assert ReplicaRecord.from_json(record.to_json()) == record
    assert record.key == "replicas/m/r1"
    with pytest.raises(ValueError, match="must not contain"):
        ReplicaRecord("a/b", "m", "x", ("decode",)).key  # noqa: B018
