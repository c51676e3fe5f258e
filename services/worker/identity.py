"""What a worker calls itself in the fleet: its replica id and the address it advertises. A worker can take them
from the container it runs in, so one compose service can run any number of replicas of the same command:

    --replica-id hostname              the host's name (a compose container's: its short container id)
    --advertise-address hostname:PORT  the host's name, for networks whose DNS knows it
    --advertise-address auto:PORT      the address the host's name resolves to (a container: its IP on its network)
    --kv-tier disk:DIR/{replica}       {replica}: the replica id, so each replica keeps its own tier folder

Any other value is used as written. ``derive_identity`` and ``expand_kv_tier`` are pure: the host name and the
resolver are passed in. ``worker_identity`` passes this machine's and exits with status 2 on a refusal.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Callable

HOSTNAME = "hostname"  # --replica-id hostname, --advertise-address hostname:PORT
AUTO = "auto"  # --advertise-address auto:PORT
REPLICA_FIELD = "{replica}"  # in --kv-tier


def derive_identity(replica_id_arg: str | None, advertise_arg: str | None, bound_address: str, hostname: str,
                    resolve: Callable[[str], str]) -> tuple[str, str]:
    """(replica id, advertised address). Without the flags: the bound address, and ``<hostname>-<advertised port>``.
    ``resolve`` maps a host name to an IP address (``socket.gethostbyname``). ValueError, saying what to pass
    instead, when ``auto`` does not resolve or resolves to a loopback address (other machines cannot reach it)."""
    address = _advertise_address(advertise_arg, hostname, resolve) if advertise_arg else bound_address
    replica_id = _replica_id(replica_id_arg, hostname) or f"{hostname}-{address.rpartition(':')[2]}"
    return replica_id, address


def expand_kv_tier(spec: str, replica_id_arg: str | None, hostname: str) -> str:
    """``spec`` (``--kv-tier``) with ``{replica}`` replaced by the replica id. ValueError when it has the field and
    no ``--replica-id`` is given: the default id names the bound port, which is known only after the tier opens."""
    if REPLICA_FIELD not in spec:
        return spec
    replica_id = _replica_id(replica_id_arg, hostname)
    if replica_id is None:
        raise ValueError(f"--kv-tier {spec}: {REPLICA_FIELD} needs --replica-id (a name, or {HOSTNAME} for this "
                         "host's name)")
    return spec.replace(REPLICA_FIELD, replica_id)


def worker_identity(replica_id_arg: str | None, advertise_arg: str | None, bound_address: str) -> tuple[str, str]:
    """``derive_identity`` with this machine's host name and resolver. A refusal prints why and exits with status 2,
    as a bad argument does."""
    try:
        return derive_identity(replica_id_arg, advertise_arg, bound_address, socket.gethostname(),
                               socket.gethostbyname)
    except ValueError as e:
        print(f"tokenfleet worker: error: {e}", file=sys.stderr)
        raise SystemExit(2) from e


def _replica_id(replica_id_arg: str | None, hostname: str) -> str | None:
    return hostname if replica_id_arg == HOSTNAME else replica_id_arg or None


def _advertise_address(advertise_arg: str, hostname: str, resolve: Callable[[str], str]) -> str:
    host, _, port = advertise_arg.rpartition(":") if ":" in advertise_arg else (advertise_arg, "", "")
    if host not in (HOSTNAME, AUTO):
        return advertise_arg
    if not port.isdigit():
        raise ValueError(f"--advertise-address {advertise_arg}: pass {host}:PORT, PORT the one others connect to")
    if host == HOSTNAME:
        return f"{hostname}:{port}"
    instead = f"pass --advertise-address HOST:{port} with an address other machines reach"
    try:
        ip = resolve(hostname)
    except OSError as e:
        raise ValueError(f"--advertise-address {advertise_arg}: this host's name {hostname!r} does not resolve "
                         f"({e}); {instead}") from e
    if ipaddress.ip_address(ip).is_loopback:
        raise ValueError(f"--advertise-address {advertise_arg}: this host's name {hostname!r} resolves to {ip}, a "
                         f"loopback address; {instead}")
    return f"{ip}:{port}"
