"""The internal plane with real processes: etcd over TLS with client-certificate auth, registry, router
and a worker on mutual TLS. Callers without a certificate, with one from another CA, or with the wrong
role are refused by every service; certificates rotate without a restart; the audit log records
administrative calls; plaintext runs only when asked for, with a warning."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.conftest import start_service, wait_for
from tokenfleet import envs
from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.security import certs
from tokenfleet.security.identity import Identity
from tokenfleet.security.plane import Plane
from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc, registry_pb2, registry_pb2_grpc, router_pb2, router_pb2_grpc


@pytest.fixture(scope="module")
def plane_dir(tmp_path_factory):
    """A copy of the session's certificates: this module rotates some of them."""
    folder = tmp_path_factory.mktemp("secure") / "certs"
    shutil.copytree(envs.certs_dir(), folder)
    return folder


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    folder = tmp_path_factory.mktemp("other") / "certs"
    certs.ensure(folder)
    return folder


@pytest.fixture(scope="module")
def fleet(plane_dir, tmp_path_factory, default_model_dir):
    audit = tmp_path_factory.mktemp("audit") / "audit.log"
    etcd = EtcdServer.create(certs=plane_dir).start()
    tls = ["--certs", str(plane_dir), "--audit-log", str(audit)]
    services = {}
    try:
        services["registry"] = start_service("tokenfleet.services.registry", "--etcd", etcd.endpoint, *tls)
        services["worker"] = start_service(
            "tokenfleet.services.decode", "--model", str(default_model_dir), "--dtype", "float32", "--threads", "1",
            "--num-blocks", "64", "--etcd", etcd.endpoint, "--replica-id", "w0", "--model-name", "smol", *tls)
        services["router"] = start_service("tokenfleet.services.router", "--etcd", etcd.endpoint, *tls)
        yield etcd, services, audit
    finally:
        for service in services.values():
            service.stop()
        etcd.cleanup()


def as_role(folder, role: str) -> Plane:
    return Plane(Identity(folder, role))


# One call per service, and who may make it: (service, stub, call, allowed role, a refused role)
CALLS = {
    "worker": (engine_pb2_grpc.EngineServiceStub,
               lambda stub: list(stub.Generate(engine_pb2.GenerateRequest(
                   prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=60)),
               "gateway", "router"),
    "router": (router_pb2_grpc.RouterServiceStub,
               lambda stub: stub.Pick(router_pb2.PickRequest(model="smol"), timeout=30), "gateway", "worker"),
    "registry": (registry_pb2_grpc.RegistryServiceStub,
                 lambda stub: stub.SetAlias(registry_pb2.SetAliasRequest(alias="a", target="b"), timeout=30),
                 "operator", "gateway"),
}


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_service_refuses_callers_without_a_valid_certificate_of_the_right_role(fleet, plane_dir, other_ca, name):
    _, services, _ = fleet
    address = services[name].address
    stub_class, call, allowed, refused = CALLS[name]
    peer = "worker" if name == "worker" else name
    ca = (plane_dir / "ca.pem").read_bytes()
    no_cert = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca),
                                  options=[("grpc.ssl_target_name_override", certs.peer_name(peer))])
    foreign = grpc.secure_channel(address, grpc.ssl_channel_credentials(
        ca, (other_ca / "operator.key").read_bytes(), (other_ca / "operator.pem").read_bytes()),
        options=[("grpc.ssl_target_name_override", certs.peer_name(peer))])
    attempts = {
        "plaintext": grpc.insecure_channel(address),
        "no certificate": no_cert,
        "another CA": foreign,
    }
    for what, channel in attempts.items():
        assert _code(lambda c=channel: call(stub_class(c))) == grpc.StatusCode.UNAVAILABLE, what
        channel.close()
    with as_role(plane_dir, refused).sync_channel(address, peer) as channel:
        assert _code(lambda: call(stub_class(channel))) == grpc.StatusCode.PERMISSION_DENIED
    with as_role(plane_dir, allowed).sync_channel(address, peer) as channel:
        try:
            call(stub_class(channel))
        except grpc.RpcError as e:  # allowed through: what is left is the service's own answer
            assert e.code() not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE), e


def test_a_client_refuses_a_server_of_another_role(fleet, plane_dir):
    """A gateway that believes the worker's address is the router's: the TLS check fails."""
    _, services, _ = fleet
    with as_role(plane_dir, "gateway").sync_channel(services["worker"].address, "router") as channel:
        code = _code(lambda: router_pb2_grpc.RouterServiceStub(channel).Pick(router_pb2.PickRequest(model="smol"),
                                                                               timeout=30))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_etcd_refuses_clients_without_a_certificate(fleet, plane_dir, other_ca):
    etcd, _, _ = fleet

    async def attempt(endpoint: str, identity: Identity | None) -> str:
        client = EtcdClient(endpoint, identity=identity, timeout=5)
        try:
            await client.get("anything")
            return "served"
        except Exception as e:  # noqa: BLE001 - aetcd raises its own error types
            return type(e).__name__
        finally:
            await client.close()

    plain = etcd.endpoint.replace("https://", "http://")
    assert asyncio.run(attempt(plain, None)) != "served"
    assert asyncio.run(attempt(etcd.endpoint, Identity(other_ca, "operator"))) != "served"
    assert asyncio.run(attempt(etcd.endpoint, Identity(plane_dir, "operator"))) == "served"
    host, port = etcd.endpoint.removeprefix("https://").split(":")
    context = ssl.create_default_context(cafile=str(plane_dir / "ca.pem"))  # TLS, but no client certificate
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"GET /health HTTP/1.1\r\nHost: etcd\r\n\r\n")
                if not tls.recv(1024):
                    raise ConnectionError("closed without an answer")


def served_serial(address: str, folder, role: str = "operator") -> int:
    """The serial of the certificate a server presents to a new TLS connection."""
    context = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    context.load_cert_chain(str(folder / f"{role}.pem"), str(folder / f"{role}.key"))
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=certs.peer_name("worker")) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_rotated_certificate_is_served_without_a_restart(fleet, plane_dir):
    _, services, _ = fleet
    worker = services["worker"]
    before = served_serial(worker.address, plane_dir)
    certs.issue(plane_dir, "worker")
    _, new_serial, _ = certs.describe(plane_dir / "worker.pem")
    assert new_serial != before
    wait_for(lambda: served_serial(worker.address, plane_dir) == new_serial, "the new certificate served")
    with as_role(plane_dir, "gateway").sync_channel(worker.address, "worker") as channel:  # and it still serves
        final = list(engine_pb2_grpc.EngineServiceStub(channel).Generate(engine_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=60))[-1]
    assert final.HasField("final") and worker.proc.poll() is None


def test_internal_messages_have_limits_that_fit_them(fleet, plane_dir):
    _, services, _ = fleet
    with as_role(plane_dir, "operator").sync_channel(services["registry"].address, "registry") as channel:
        huge = registry_pb2.SetAliasRequest(alias="a", target="x" * (2 << 20))
        code = _code(lambda: registry_pb2_grpc.RegistryServiceStub(channel).SetAlias(huge, timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_plaintext_only_when_asked_for_and_warned_about(tmp_path):
    etcd = EtcdServer.create().start()
    try:
        without = subprocess.run([sys.executable, "-m", "tokenfleet.services.registry", "--etcd", etcd.endpoint,
                                  "--certs", str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
        assert without.returncode == 2 and "tokenfleet certs" in without.stderr
        insecure = start_service("tokenfleet.services.registry", "--etcd", etcd.endpoint, "--insecure")
        try:
            with grpc.insecure_channel(insecure.address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            insecure.stop()
        assert any("INSECURE" in line and "warning" in line for line in insecure.stderr_lines)
    finally:
        etcd.cleanup()


def test_the_audit_log_records_who_drained_a_worker(fleet, plane_dir):
    """Last in this module: the drained worker exits."""
    _, services, audit = fleet
    worker = services["worker"]
    with as_role(plane_dir, "gateway").sync_channel(worker.address, "worker") as channel:
        assert _code(lambda: engine_pb2_grpc.EngineServiceStub(channel).Drain(engine_pb2.DrainRequest())) == \
            grpc.StatusCode.PERMISSION_DENIED
    with as_role(plane_dir, "operator").sync_channel(worker.address, "worker") as channel:
        engine_pb2_grpc.EngineServiceStub(channel).Drain(engine_pb2.DrainRequest(), timeout=60)
    assert worker.proc.wait(timeout=60) == 0
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    drains = [(r["who"]["role"], r["outcome"], r["service"]) for r in records if r["method"].endswith("/Drain")]
    assert ("gateway", "denied", "worker-decode") in drains and ("operator", "ok", "worker-decode") in drains
    done = next(r for r in records if r["method"].endswith("/Drain") and r["outcome"] == "ok")
    assert done["who"]["serial"] and done["who"]["peer"].startswith("ipv4:127.0.0.1") and done["time"]
