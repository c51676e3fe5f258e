"""Package layering, checked on the source: which tokenfleet packages may import which.

Every ``import`` / ``from ... import`` in a module counts, function-level and TYPE_CHECKING ones too
(a lazy import is still a dependency). The rules (docs/architecture.md explains them):

- engine: the pure core (scheduler, block manager, request lifecycle, the runner and KV-connector
  interfaces). Never backends, services, cluster, nor the gRPC / HTTP libraries: a backend
  plugs into the engine, not the other way round, and the simulator reuses the engine off-line.
- routing: placement policies over plain records. Never cluster (etcd), services nor the engine (the
  block hash it shares with the engine lives in kvcache).
- kvcache: the block hash and KV layout every component agrees on. No other tokenfleet package.
- backends: model runners for one framework each. Never services (a backend runs inside a worker
  service, it does not call the fleet's services).
- models: model code and kernels. Of the engine, only the runner interface.
- tenancy: tenants, budgets, admission, the ledger. Never services (the gateway uses it).
- security: certificates, the internal plane, authorization. Never services, engine nor cluster (the
  services and the etcd client use it, not the other way round).
- cluster: etcd, membership, registry and tenant records as stored. Never backends, models, api, tenancy,
  planning nor batch (tenancy and the simulator build on it, not the other way round).
- api: the OpenAI schema, templates, tools. Never cluster, backends, tenancy, batch, planning, torch nor the
  gRPC / HTTP libraries (the gateway serves it; the offline API parses with it).
- planning: the calculator and the fleet simulator, run off-line. Never backends, models, torch nor the
  gRPC / HTTP libraries; of cluster only the autoscaler's pure policy (``cluster.autoscale``).
- batch: the batch tier's file formats and store. Never engine, backends, models, cluster nor the gRPC /
  HTTP libraries (the gateway drives it).
- responses: the Responses API's request, items and stored responses. Never engine, backends, models, cluster,
  tenancy, batch nor the gRPC / HTTP libraries (the gateway serves it; it builds on api's schema).
- telemetry, envs, files, v1: leaves everything imports. No other tokenfleet package (telemetry reads its
  settings through envs; v1's generated modules import each other).
- the operator's surface: only cli starts and calls the services (services call each other), and nothing
  imports cli (its launcher included): libraries and services never reach for the command line.

A test of the test plants each kind of violation in a scratch tree and expects it reported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HTTP_AND_GRPC = ("grpc", "aiohttp", "fastapi", "starlette", "uvicorn", "httpx", "requests", "urllib.request")
RULES: dict[str, tuple[str, ...]] = {  # package -> module prefixes it must not import
    "tokenfleet.engine": ("tokenfleet.backends", "tokenfleet.services", "tokenfleet.cluster", *HTTP_AND_GRPC),
    "tokenfleet.routing": ("tokenfleet.cluster", "tokenfleet.services", "tokenfleet.engine"),
    "tokenfleet.kvcache": ("tokenfleet",),
    "tokenfleet.backends": ("tokenfleet.services",),
    "tokenfleet.models": ("tokenfleet.engine",),
    "tokenfleet.tenancy": ("tokenfleet.services",),
    "tokenfleet.security": ("tokenfleet.services", "tokenfleet.engine", "tokenfleet.cluster"),
    "tokenfleet.cluster": ("tokenfleet.backends", "tokenfleet.models", "tokenfleet.api", "tokenfleet.tenancy",
                           "tokenfleet.planning", "tokenfleet.batch"),
    "tokenfleet.api": ("tokenfleet.cluster", "tokenfleet.backends", "tokenfleet.tenancy", "tokenfleet.batch",
                       "tokenfleet.planning", "torch", *HTTP_AND_GRPC),
    "tokenfleet.planning": ("tokenfleet.backends", "tokenfleet.models", "tokenfleet.cluster", "torch", *HTTP_AND_GRPC),
    "tokenfleet.batch": ("tokenfleet.engine", "tokenfleet.backends", "tokenfleet.models", "tokenfleet.cluster",
                         *HTTP_AND_GRPC),
    "tokenfleet.responses": ("tokenfleet.engine", "tokenfleet.backends", "tokenfleet.models", "tokenfleet.cluster",
                             "tokenfleet.tenancy", "tokenfleet.batch", *HTTP_AND_GRPC),
    "tokenfleet.telemetry": ("tokenfleet",),
    "tokenfleet.envs": ("tokenfleet",),
    "tokenfleet.files": ("tokenfleet",),
    "tokenfleet.v1": ("tokenfleet",),
}
ALLOWED: dict[str, tuple[str, ...]] = {  # exceptions to a forbidden prefix
    "tokenfleet.models": ("tokenfleet.engine.runner",),
    "tokenfleet.kvcache": ("tokenfleet.kvcache",),
    "tokenfleet.planning": ("tokenfleet.cluster.autoscale",),
    "tokenfleet.telemetry": ("tokenfleet.telemetry", "tokenfleet.envs"),
    "tokenfleet.envs": ("tokenfleet.envs",),
    "tokenfleet.files": ("tokenfleet.files",),
    "tokenfleet.v1": ("tokenfleet.v1",),
}
# The operator's surface, over every package: module prefix -> the packages that alone may import it.
ONLY_FROM: dict[str, tuple[str, ...]] = {
    "tokenfleet.services": ("tokenfleet.cli", "tokenfleet.services"),
    "tokenfleet.cli": ("tokenfleet.cli",),
}
# Where each package's source lives (services are installed as tokenfleet.services from ./services).
SOURCES = {"tokenfleet": "tokenfleet", "tokenfleet.services": "services"}


def module_files(root: Path) -> dict[str, Path]:
    out = {}
    for package, folder in SOURCES.items():
        base = root / folder
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def imports(path: Path, module: str) -> list[tuple[str, tuple[str, ...]]]:
    """Each import statement as (the module it names, the most specific names it reaches).

    ``from pkg import x`` reaches ``pkg.x`` (x may be a submodule, and an allowed submodule of a
    forbidden package is fine); ``import a, b`` is two statements.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, (alias.name,)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((name, tuple(f"{name}.{alias.name}" for alias in node.names)))
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path) -> list[str]:
    out = []
    for module, path in sorted(module_files(root).items()):
        found = imports(path, module)
        for package, forbidden in RULES.items():
            if not _under(module, package):
                continue
            allowed = ALLOWED.get(package, ())
            for name, reached in found:
                if any(any(_under(r, f) for f in forbidden) and not any(_under(r, a) for a in allowed) for r in reached):
                    out.append(f"{module} imports {name}")
        for target, owners in ONLY_FROM.items():
            if not any(_under(module, owner) for owner in owners):
                out += [f"{module} imports {name}" for name, reached in found if any(_under(r, target) for r in reached)]
    return sorted(set(out))


def test_the_packages_keep_their_layers():
    assert violations(ROOT) == []


@pytest.mark.parametrize(("where", "line"), [
    ("tokenfleet/engine/planted.py", "from tokenfleet.backends.torch.runner import TorchModelRunner"),
    ("tokenfleet/engine/planted.py", "import grpc"),
    ("tokenfleet/engine/planted.py", "def f():\n    from tokenfleet.cluster.etcd import EtcdClient"),
    ("tokenfleet/engine/planted.py", "from tokenfleet.services.registry import client"),
    ("tokenfleet/routing/planted.py", "from tokenfleet.cluster import affinity"),
    ("tokenfleet/routing/planted.py", "import tokenfleet.services.router.fleet"),
    ("tokenfleet/routing/planted.py", "from tokenfleet.engine.scheduler import Scheduler"),
    ("tokenfleet/kvcache/planted.py", "from tokenfleet.engine.kv_transfer import KVReceiver"),
    ("tokenfleet/kvcache/planted.py", "from tokenfleet import envs"),
    ("tokenfleet/backends/planted.py", "from tokenfleet.services.registry.convert import record_to_proto"),
    ("tokenfleet/models/planted.py", "from tokenfleet.engine.scheduler import Scheduler"),
    ("tokenfleet/tenancy/planted.py", "from tokenfleet.services.gateway.pipeline import Call"),
    ("tokenfleet/security/planted.py", "from tokenfleet.cluster.etcd import EtcdClient"),
    ("tokenfleet/engine/sub/planted.py", "from ...services import common"),  # relative, resolved
    ("tokenfleet/cluster/planted.py", "from tokenfleet.tenancy.store import EtcdTenantStore"),
    ("tokenfleet/cluster/planted.py", "from tokenfleet.models.config import ModelConfig"),
    ("tokenfleet/api/planted.py", "from tokenfleet.cluster.registry import ModelRecord"),
    ("tokenfleet/api/planted.py", "import torch"),
    ("tokenfleet/planning/planted.py", "from tokenfleet.cluster.etcd import EtcdClient"),
    ("tokenfleet/planning/planted.py", "from tokenfleet.backends.torch.runner import TorchModelRunner"),
    ("tokenfleet/batch/planted.py", "from tokenfleet.engine.scheduler import Scheduler"),
    ("tokenfleet/batch/planted.py", "import fastapi"),
    ("tokenfleet/responses/planted.py", "from tokenfleet.tenancy.ledger import Ledger"),
    ("tokenfleet/telemetry/planted.py", "from tokenfleet.engine.stats import SchedulerStats"),
    ("tokenfleet/v1/planted.py", "from tokenfleet.api import openai_schema"),
    ("tokenfleet/envs.py", "from tokenfleet.telemetry import logging"),
    ("tokenfleet/cluster/planted.py", "from tokenfleet.services.registry.client import fetch_record"),
    ("tokenfleet/llm.py", "from tokenfleet.services.worker import main"),
    ("tokenfleet/planning/planted.py", "def f():\n    from tokenfleet.cli import launcher"),
    ("tokenfleet/tenancy/planted.py", "from tokenfleet.cli.context import cluster_context"),
    ("services/gateway/planted.py", "from tokenfleet.cli.launcher import Cluster"),
])
def test_a_planted_violation_is_reported(tmp_path, where, line):
    for folder in SOURCES.values():
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    target = tmp_path / where
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(line + "\n")
    found = violations(tmp_path)
    module = ("tokenfleet." if where.startswith("services/") else "") + where.removesuffix(".py").replace("/", ".")
    assert len(found) == 1 and found[0].startswith(module + " imports"), found


def test_the_runner_interface_is_what_models_may_import(tmp_path):
    (tmp_path / "services").mkdir()
    target = tmp_path / "tokenfleet" / "models" / "ok.py"
    target.parent.mkdir(parents=True)
    target.write_text("from tokenfleet.engine.runner import ModelRunner\nfrom tokenfleet.engine import runner\n")
    assert violations(tmp_path) == []


def test_scheduler_imports_no_torch_and_no_grpc():
    """The scheduler and block manager stay importable without torch or gRPC (the fleet simulator reuses them)."""
    code = (
        "import sys; import tokenfleet.engine.scheduler, tokenfleet.engine.block_manager, tokenfleet.engine.output;"
        "bad = [m for m in ('torch', 'grpc') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
