"""How a process talks on the internal plane: mutual TLS with its role's certificate, or plaintext.

A ``Plane`` is built once per process from its command line (``add_arguments``/``from_args``):
``--certs DIR`` (default ``$TOKENFLEET_CERTS``, else ``~/.cache/tokenfleet/certs``) or
``--insecure``, which logs a warning at every start. Servers listen through ``add_port`` and
authorize callers with ``authz``; clients open channels that verify the server's role: a channel
to a router accepts only a certificate naming ``router.tokenfleet``, whatever its address.
``Channels`` keeps long-lived channels and rebuilds them after the certificate files change.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry

from tokenfleet import envs
from tokenfleet.security.certs import peer_name
from tokenfleet.security.identity import DEFAULT_WARN_DAYS, Identity

log = structlog.get_logger()
Options = Sequence[tuple[str, Any]]
INSECURE_WARNING = ("INSECURE: the internal plane is plaintext and unauthenticated (--insecure): anything that "
                    "reaches this port can call it. Development only")
CLOSE_GRACE_S = 600.0  # a replaced channel's calls get this long to finish


class Plane:
    def __init__(self, identity: Identity | None):
        self.identity = identity

    @property
    def secure(self) -> bool:
        return self.identity is not None

    @property
    def generation(self) -> int:
        return self.identity.current().generation if self.identity is not None else 0

    @classmethod
    def plaintext(cls) -> Plane:
        return cls(None)

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str, registry: CollectorRegistry | None = None) -> Plane:
        """The plane ``add_arguments`` describes, for a process of ``role``; IdentityError when the
        certificate files are missing or unusable (the process should not start then)."""
        if args.insecure:
            log.warning(INSECURE_WARNING, role=role)
            return cls(None)
        return cls(Identity(Path(args.certs), role, warn_days=args.cert_warn_days, registry=registry))

    def watch(self) -> asyncio.Task | None:
        """Background task: re-read rotated certificate files and repeat expiry warnings (None in plaintext)."""
        return asyncio.create_task(self.identity.watch()) if self.identity is not None else None

    # ---- clients -----------------------------------------------------------------------------
    def _secure_options(self, peer_role: str, options: Options) -> list[tuple[str, Any]]:
        return [*options, ("grpc.ssl_target_name_override", peer_name(peer_role))]

    def channel(self, address: str, peer_role: str, options: Options = ()) -> grpc.aio.Channel:
        """An asyncio channel to a server of ``peer_role`` (its certificate must name that role)."""
        if self.identity is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, self.identity.channel_credentials(),
                                       options=self._secure_options(peer_role, options))

    def sync_channel(self, address: str, peer_role: str, options: Options = ()) -> grpc.Channel:
        if self.identity is None:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self.identity.channel_credentials(),
                                   options=self._secure_options(peer_role, options))

    # ---- servers -----------------------------------------------------------------------------
    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.identity is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.identity.server_credentials())


class Channels:
    """Long-lived channels by (address, peer role), rebuilt when this process's certificate changed
    (the replaced channel's calls get ``CLOSE_GRACE_S`` to finish)."""

    def __init__(self, plane: Plane, options: Options = ()):
        self.plane = plane
        self.options = list(options)
        self._channels: dict[tuple[str, str], tuple[int, grpc.aio.Channel]] = {}
        self._closing: set[asyncio.Task] = set()

    def get(self, address: str, peer_role: str) -> grpc.aio.Channel:
        generation = self.plane.generation
        entry = self._channels.get((address, peer_role))
        if entry is not None and entry[0] == generation:
            return entry[1]
        if entry is not None:
            task = asyncio.get_running_loop().create_task(entry[1].close(grace=CLOSE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        channel = self.plane.channel(address, peer_role, self.options)
        self._channels[(address, peer_role)] = (generation, channel)
        return channel

    async def close(self) -> None:
        for _, channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        for task in list(self._closing):
            task.cancel()


def add_arguments(p: argparse.ArgumentParser, audit: bool = True) -> None:
    g = p.add_argument_group("internal plane security")
    g.add_argument("--certs", default=str(envs.certs_dir()),
                   help="folder with ca.pem and this role's <role>.pem/.key (`tokenfleet certs` creates them); "
                   "default $TOKENFLEET_CERTS, else ~/.cache/tokenfleet/certs")
    g.add_argument("--insecure", action="store_true",
                   help="plaintext, unauthenticated internal gRPC and etcd: development only (warned at every start)")
    g.add_argument("--cert-warn-days", type=float, default=DEFAULT_WARN_DAYS,
                   help="warn (log and metric) when the certificate expires within this many days")
    if audit:
        g.add_argument("--audit-log", default=envs.audit_log(),
                       help="also append administrative calls (who, what, when, outcome) to this JSON-lines file "
                       "(default $TOKENFLEET_AUDIT_LOG; always in the service log)")
