"""Reading compose/: the compose file, Dockerfile and service commands, shared by the compose tests.

The Compose specification's JSON schema comes from the docker-compose 1.29.2 wheel (never installed:
only the JSON inside it is read). `scripts/install.sh --dev` downloads the wheel into
`.venv/share/tokenfleet/`; without it the tests download it into pytest's cache with pip.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any

import yaml
from tokenfleet.services.worker.identity import AUTO, HOSTNAME

from tokenfleet.cli import parser as cli

ROOT = Path(__file__).resolve().parents[3]
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
DERIVED_HOSTS = (AUTO, HOSTNAME)  # --advertise-address hosts a worker takes from its container
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


def worker_role(argv: list[str]) -> str:
    """A worker command's role: its `--role` (decode, prefill or both) if given, else the command's name."""
    return flag(argv, "--role") or argv[1]


def server_argv(name: str) -> list[str] | None:
    """The argv of a tokenfleet service that runs a server (`tokenfleet <service> ...`), else None."""
    lines = command_lines(services()[name])
    if len(lines) == 1 and len(lines[0]) > 1 and lines[0][1] in cli.SERVICE_COMMANDS:
        return lines[0]
    return None


def replicas(svc: dict[str, Any]) -> int:
    """How many containers `docker compose up` starts for a service (`deploy.replicas`, else `scale`, else 1)."""
    return int(svc.get("deploy", {}).get("replicas", svc.get("scale", 1)))


def is_scalable(argv: list[str]) -> bool:
    """A worker command every replica of one service can run: it takes its replica id and advertised address from
    its container, not from the command."""
    advertised = flag(argv, "--advertise-address")
    return flag(argv, "--replica-id") == HOSTNAME and advertised is not None and advertised.split(":")[0] == AUTO


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


