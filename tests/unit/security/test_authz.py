"""Authorization by role on a real mutual-TLS gRPC server in this process, and the policy's coverage."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokenfleet.security import certs
from tokenfleet.security.authz import ADMIN, POLICY, AuditLog, Authorizer
from tokenfleet.security.identity import Identity
from tokenfleet.security.plane import Channels, Plane
from tokenfleet.v1 import engine_pb2, inference_pb2, registry_pb2, router_pb2


def test_every_internal_rpc_has_a_policy_and_the_public_api_none():
    internal = [engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
                router_pb2.DESCRIPTOR.services_by_name["RouterService"],
                registry_pb2.DESCRIPTOR.services_by_name["RegistryService"]]
    methods = {f"/{service.full_name}/{method.name}" for service in internal for method in service.methods}
    assert methods <= set(POLICY), methods - set(POLICY)
    assert ADMIN <= set(POLICY)
    public = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
    assert not [m for m in POLICY if m.startswith(f"/{public.full_name}/")]
    assert POLICY["/tokenfleet.v1.EngineService/Generate"] == {"gateway"}
    assert POLICY["/tokenfleet.v1.EngineService/Prefill"] == {"worker"}
    assert "gateway" not in POLICY["/tokenfleet.v1.EngineService/Drain"]
    assert POLICY["/tokenfleet.v1.RegistryService/RegisterModel"] == {"operator"}
    # every call that changes what a worker serves, or what it loads from its disk, is audited
    changes = {m for m, roles in POLICY.items() if roles <= {"operator", "autoscaler"} and ".EngineService/" in m}
    assert changes == {"/tokenfleet.v1.EngineService/" + m for m in ("Abort", "Drain", "LoadAdapter")}
    assert changes <= ADMIN


@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "certs"
    certs.ensure(out)
    return out


def test_roles_are_enforced_and_admin_calls_audited(folder, tmp_path):
    audit_path = tmp_path / "audit.log"
    asyncio.run(_serve_and_call(folder, audit_path))
    records = [json.loads(line) for line in audit_path.read_text().splitlines()]
    outcomes = [(r["who"]["role"], r["method"].rsplit("/", 1)[1], r["outcome"]) for r in records]
    assert ("router", "Check", "ok") in outcomes and ("gateway", "Check", "denied") in outcomes
    assert ("gateway", "Watch", "denied") in outcomes and ("router", "Watch", "ok") not in outcomes  # not an admin call
    denied = next(r for r in records if r["outcome"] == "denied" and r["method"].endswith("Check"))
    assert denied["request"] == {"service": "x"} and denied["who"]["serial"] and denied["service"] == "test"


async def _serve_and_call(folder, audit_path) -> None:
    policy = {"/grpc.health.v1.Health/Check": frozenset({"router"}),
              "/grpc.health.v1.Health/Watch": frozenset({"router"})}
    server = grpc.aio.server(interceptors=[Authorizer(AuditLog(str(audit_path), "test"), policy,
                                                      frozenset({"/grpc.health.v1.Health/Check"}))])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = Plane(Identity(folder, "worker")).add_port(server, "127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        async with Plane(Identity(folder, "router")).channel(address, "worker") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest())  # a streaming handler that writes: still served
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        async with Plane(Identity(folder, "gateway")).channel(address, "worker") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="x"))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "'gateway' may not call /grpc.health.v1.Health/Check" in refused.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as refused_stream:
                await health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()).read()
            assert refused_stream.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with Plane(Identity(folder, "router")).channel(address, "router") as channel:  # the server is no router
            with pytest.raises(grpc.aio.AioRpcError) as wrong_server:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert wrong_server.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


def test_channels_are_rebuilt_after_the_certificate_changes(folder):
    asyncio.run(_rebuild(folder))


async def _rebuild(folder) -> None:
    identity = Identity(folder, "gateway", poll_seconds=0)
    channels = Channels(Plane(identity))
    first = channels.get("127.0.0.1:1", "router")
    assert channels.get("127.0.0.1:1", "router") is first
    certs.issue(folder, "gateway")
    second = channels.get("127.0.0.1:1", "router")
    assert second is not first and channels.get("127.0.0.1:1", "router") is second
    await channels.close()


def test_a_plaintext_plane_has_no_identity_and_says_so(capsys):
    import argparse

    from structlog.testing import capture_logs

    with capture_logs() as logs:
        plane = Plane.from_args(argparse.Namespace(insecure=True, certs="", cert_warn_days=30), "router")
    assert not plane.secure and plane.generation == 0
    assert any(entry["event"].startswith("INSECURE") and entry["log_level"] == "warning" for entry in logs)
