"""Which cluster a command talks to: the flags it was given, over the running `tokenfleet up` cluster's state file
(its registry and etcd addresses, its certificates, whether it is plaintext).

Every command that reaches the internal plane builds one ``ClusterContext`` with ``cluster_context(...)`` and asks it
for the addresses it needs and the operator's plane; the launcher writes the state file this reads.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenfleet import envs
from tokenfleet.security.identity import Identity
from tokenfleet.security.plane import Plane

NO_CLUSTER = "no {flags} given and no `tokenfleet up` cluster is running"


def state_file() -> Path:
    return envs.cache_dir() / "cluster.json"


def cluster_state() -> dict[str, Any]:
    """Addresses of the running `tokenfleet up` cluster ({} when none)."""
    path = state_file()
    return json.loads(path.read_text()) if path.exists() else {}


@dataclass(frozen=True)
class ClusterContext:
    """A command's cluster. ``registry`` and ``etcd``: the flag's address, else the running cluster's, else "".
    ``certs``/``insecure``: the command's ``--certs``/``--insecure``. Reading it touches no certificate file (the
    plane reads them on its first call)."""

    state: dict[str, Any]
    registry: str
    etcd: str
    certs: str | None
    insecure: bool

    @cached_property
    def plane(self) -> Plane:
        """The plane as an operator: plaintext with ``insecure`` or when the running cluster is plaintext (and no
        ``certs`` were given); else the certificates in ``certs``, the running cluster's, or the default folder."""
        if self.insecure or (self.certs is None and self.state.get("insecure")):
            return Plane.plaintext()
        return Plane(Identity(Path(self.certs or self.state.get("certs") or envs.certs_dir()), "operator"))

    def require_registry(self) -> str:
        """The registry's address; ConnectionError when there is none."""
        if not self.registry:
            raise ConnectionError(NO_CLUSTER.format(flags="--registry"))
        return self.registry

    def require_etcd(self, flags: str = "--etcd") -> str:
        """etcd's endpoint; ConnectionError (naming ``flags``, the ways the command takes one) when there is none."""
        if not self.etcd:
            raise ConnectionError(NO_CLUSTER.format(flags=flags))
        return self.etcd

    def etcd_identity(self) -> Identity | None:
        """Who etcd sees: no certificate for a plaintext endpoint (http://) or a plaintext plane."""
        return None if self.require_etcd().startswith("http://") else self.plane.identity


def cluster_context(registry: str | None = None, etcd: str | None = None, certs: str | None = None,
                    insecure: bool = False) -> ClusterContext:
    """The cluster a command's flags name, the running `tokenfleet up` cluster filling in what they leave out."""
    state = cluster_state()
    return ClusterContext(state, registry or state.get("registry") or "", etcd or state.get("etcd") or "", certs,
                          insecure)


def add_operator_arguments(p: argparse.ArgumentParser) -> None:
    """How a command reaches the internal plane (registry, etcd) as an operator."""
    p.add_argument("--certs", help="certificates folder with operator.pem (default: the `tokenfleet up` cluster's, "
                   "else $TOKENFLEET_CERTS or ~/.cache/tokenfleet/certs)")
    p.add_argument("--insecure", action="store_true", help="plaintext (a cluster started with --insecure)")


def add_registry_arguments(p: argparse.ArgumentParser) -> None:
    """Which registry a command calls, and how it reaches it."""
    p.add_argument("--registry", help="registry address host:port (default: the `tokenfleet up` cluster's)")
    add_operator_arguments(p)


def registry_stub(context: ClusterContext) -> Any:
    """A RegistryService stub on the context's registry, as an operator."""
    from tokenfleet.v1 import registry_pb2_grpc

    channel = context.plane.sync_channel(context.require_registry(), "registry")
    return registry_pb2_grpc.RegistryServiceStub(channel)


def registry_call(call: Any) -> Any:
    """One registry RPC (``call()`` makes it); gRPC statuses become CLI errors."""
    import grpc

    try:
        return call()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            raise LookupError(e.details()) from e
        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                        grpc.StatusCode.PERMISSION_DENIED):
            raise ValueError(e.details()) from e
        raise ConnectionError(f"registry: {e.code().name}: {e.details()}") from e
