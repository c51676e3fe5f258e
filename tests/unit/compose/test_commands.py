"""Every compose command is one the CLI knows and its service's own parser accepts; addresses and
healthchecks reach ports the services listen on; the healthcheck script works."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from tests.unit.compose.files import (
    ADDRESS_FLAGS,
    DERIVED_HOSTS,
    HEALTHCHECK_SCRIPT,
    WORKER_ROLES,
    _words,
    command_lines,
    dockerfile,
    dockerfile_env,
    exposed_ports,
    flag,
    is_scalable,
    listening_ports,
    replicas,
    server_argv,
    services,
    split_address,
    tokenfleet_services,
    worker_role,
)
from tokenfleet.cli import parser as cli

# ---------------------------------------------------------------------------------------------------------------------
# (b) Commands: the CLI knows them and each service's own parser accepts the flags


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse `tokenfleet ...` the way the CLI would; argparse errors fail the test with argparse's message."""
    assert argv[0] == "tokenfleet", f"{argv}: not a tokenfleet command"
    assert len(argv) > 1, "tokenfleet without a command"
    command, rest = argv[1], argv[2:]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            cli.build_parser().parse_args([command])  # the top-level parser lists the command
            if command in ("decode", "prefill"):
                from tokenfleet.services.worker.main import parse_args as worker_args

                return worker_args(rest, default_role=command)
            if command in cli.SERVICE_COMMANDS:
                return importlib.import_module(f"tokenfleet.services.{command}.main").parse_args(rest)
            args = cli.build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`{shlex.join(argv)}` does not parse:\n{stderr.getvalue()}")
    assert hasattr(args, "func"), f"`{shlex.join(argv)}` names no command"
    return args


@pytest.mark.parametrize("service", tokenfleet_services())
def test_service_command_parses(service: str) -> None:
    for argv in command_lines(services()[service]):
        args = parse(argv)
        if argv[1] in WORKER_ROLES:
            assert args.role == worker_role(argv)


def test_the_parse_check_catches_mistakes() -> None:
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        parse(["tokenfleet", "router", "--etcd", "etcd:2379", "--prot", "50070"])
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        parse(["tokenfleet", "serve"])
    with pytest.raises(AssertionError, match="not a tokenfleet command"):
        parse(["python", "-m", "tokenfleet"])


def test_init_imports_and_registers_the_models_workers_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two models at once: init imports and registers the default model and Gemma 3 270M, and each one
    has workers that prefill and decode it."""
    from tokenfleet.models import gguf_import

    init = command_lines(services()["init"])
    assert init[-1][1:3] == ["tenants", "add"]
    assert "--if-missing" in init[-1], "a second `up` must not fail init because the demo tenant exists"
    assert {tuple(argv[1:3]) for argv in init[:-1]} == {("models", "import"), ("models", "register")}
    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", dockerfile_env()["TOKENFLEET_CACHE_DIR"])
    imported: list[str] = []
    registered: dict[str, str] = {}  # name -> --registry
    for argv in init[:-1]:
        args = parse(argv)
        if argv[2] == "import":
            imported.append(args.name)
            continue
        assert args.name in imported, f"{args.name} is registered before it is imported"
        assert args.path == str(gguf_import.model_dir(args.name)), f"{args.name} registered at {args.path}"
        registered[args.name] = args.registry
    models = {gguf_import.DEFAULT_MODEL_NAME, gguf_import.GEMMA3_MODEL_NAME}
    assert set(imported) == set(registered) == models
    workers = {name: argv for name in tokenfleet_services() if (argv := server_argv(name)) and argv[1] in WORKER_ROLES}
    roles: dict[str, set[str]] = {model: set() for model in models}
    for name, argv in workers.items():
        model = flag(argv, "--model-name")
        assert model in registered, f"{name} serves {model}, which init does not register"
        assert flag(argv, "--registry") == registered[model]
        assert "TOKENFLEET_NUM_THREADS" in services()[name].get("environment", {}), f"{name}: no CPU thread setting"
        role = worker_role(argv)
        roles[model] |= set(WORKER_ROLES) if role == "both" else {role}
    for model, served in roles.items():
        assert served == set(WORKER_ROLES), f"{model}: no worker prefills and decodes it (roles: {sorted(served)})"


def test_addresses_reach_services_that_listen_there() -> None:
    etcd = services()["etcd"]
    etcd_client_ports = {split_address(url.rpartition("/")[2])[1]
                         for url in (flag(_words(etcd["command"]), "--listen-client-urls") or "").split(",") if url}
    assert etcd_client_ports and etcd_client_ports <= exposed_ports(etcd)
    for name in tokenfleet_services():
        if (argv := server_argv(name)) is not None:
            assert flag(argv, "--host") == "0.0.0.0", f"{name} must bind 0.0.0.0 to be reachable from other containers"
            assert listening_ports(name) == exposed_ports(services()[name]), f"{name}: expose lists other ports"
        for argv in command_lines(services()[name]):
            for f in ADDRESS_FLAGS:
                if (address := flag(argv, f)) is None:
                    continue
                host, port = split_address(address)
                if f == "--advertise-address":
                    assert port == int(flag(argv, "--port") or 0), f"{name} advertises {address}"
                    if host in DERIVED_HOSTS:  # the container's own name or address
                        continue
                    assert host == name, f"{name} advertises {address}"
                assert host in services(), f"{name} {f} {address}: no service {host}"
                assert port in exposed_ports(services()[host]), f"{name} {f} {address}: {host} does not listen on {port}"


def test_decode_workers_are_one_scalable_service() -> None:
    """`docker compose up --scale decode=N` (and the autoscaler's compose driver) runs N decode workers of one
    command: each takes its replica id, advertised address and tier folder from its container."""
    decode = services()["decode"]
    argv = server_argv("decode")
    assert argv is not None and worker_role(argv) == "decode"
    assert replicas(decode) >= 2
    assert flag(argv, "--replica-id") == "hostname"
    assert flag(argv, "--advertise-address") == f"auto:{flag(argv, '--port')}"
    assert flag(argv, "--kv-tier") == "disk:/cache/kv-tier/{replica}"
    args = parse(argv)
    assert args.kv_tier == f"disk:/cache/kv-tier/{socket.gethostname()}"  # a folder per replica
    assert not [n for n in services() if n.startswith("decode-")], "per-worker decode services remain"


def test_only_scalable_workers_run_more_than_one_replica() -> None:
    """Replicas of a command with a fixed --replica-id or --advertise-address would all register under one name;
    they cannot share a tier folder, a container name or a published host port either."""
    scaled = [name for name, svc in services().items() if replicas(svc) > 1]
    assert "decode" in scaled
    for name in scaled:
        svc = services()[name]
        argv = server_argv(name) if name in tokenfleet_services() else None
        assert argv is not None and argv[1] in WORKER_ROLES, f"{name}: {replicas(svc)} replicas of a non-worker"
        assert is_scalable(argv), f"{name}: {replicas(svc)} replicas that would share one identity"
        assert "{replica}" in (flag(argv, "--kv-tier") or "{replica}"), f"{name}: replicas would share a tier folder"
        assert "container_name" not in svc and not svc.get("ports"), f"{name}: replicas would clash"


def test_healthchecks_probe_the_service_port() -> None:
    copied = [shlex.split(args) for instruction, args in dockerfile() if instruction == "COPY" and "healthcheck.py" in args]
    assert copied, "the Dockerfile does not copy compose/healthcheck.py"
    script_in_image = copied[0][-1]
    for name in tokenfleet_services():
        if server_argv(name) is None:
            continue
        test = services()[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", script_in_image], f"{name}: {test}"
        port = int(re.search(r":(\d+)(/|$)", test[-1])[1])  # type: ignore[index]
        assert port in listening_ports(name), f"{name}: healthcheck probes port {port}"


# ---------------------------------------------------------------------------------------------------------------------
# compose/healthcheck.py


@pytest.fixture(scope="module")
def healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("compose_healthcheck", HEALTHCHECK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_grpc(healthcheck: Any) -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main(["grpc", f"127.0.0.1:{port}"]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main(["grpc", f"127.0.0.1:{port}"]) == 1
    finally:
        server.stop(None)
    assert healthcheck.main(["grpc", f"127.0.0.1:{port}"]) == 1  # nobody listens
    assert healthcheck.main(["tcp", "127.0.0.1:1"]) == 2
    assert healthcheck.main(["grpcs", f"127.0.0.1:{port}"]) == 2  # grpcs names the server's role


def test_healthcheck_grpc_over_mutual_tls(healthcheck: Any, internal_certs: Any) -> None:
    """The compose cluster's default: the operator certificate from $TOKENFLEET_CERTS, the server's role checked."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    folder = internal_certs
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials([((folder / "router.key").read_bytes(), (folder / "router.pem").read_bytes())],
                                              (folder / "ca.pem").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main(["grpcs", "router", f"127.0.0.1:{port}"]) == 0
        assert healthcheck.main(["grpcs", "worker", f"127.0.0.1:{port}"]) == 1  # not the role expected there
        assert healthcheck.main(["grpc", f"127.0.0.1:{port}"]) == 1  # plaintext to a TLS port
    finally:
        server.stop(None)


@contextlib.contextmanager
def http_server(status: int) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/health"
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_http(healthcheck: Any) -> None:
    with http_server(200) as url:
        assert healthcheck.main(["http", url]) == 0
    with http_server(503) as url:
        assert healthcheck.main(["http", url]) == 1


