"""The one module that talks to etcd (aetcd underneath: asyncio-native, works with protobuf 7).

The card named `etcd3`, which cannot import with protobuf >= 4 (shared/reference/etcd.md).
aetcd gives async KV, leases and watches; what it lacks we add here: a lease keep-alive loop
that survives etcd restarts, gRPC keepalive/ping timeouts so a frozen etcd is noticed, and
keys namespaced under one root (default /tokenfleet/v1/), and TLS: aetcd opens only plaintext
channels, so ``_TlsClient`` opens a mutual-TLS one with the process's certificate instead.

Endpoints: ``https://host:port`` is TLS (a certificate is needed), ``http://host:port`` plaintext
(what ``--insecure`` and the test servers use), a bare ``host:port`` TLS when the process has a
certificate and plaintext otherwise. The server's certificate must name ``etcd.tokenfleet``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aetcd
import aetcd.rpc
import aetcd.watcher
import grpc
import structlog

from tokenfleet.security.certs import peer_name
from tokenfleet.security.identity import Identity

log = structlog.get_logger()
DEFAULT_ROOT = "/tokenfleet/v1/"
CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.http2.ping_timeout_ms": 5_000,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2_000,
}
ETCD_ERRORS = (aetcd.ClientError, asyncio.InvalidStateError, asyncio.TimeoutError, OSError)


@dataclass(frozen=True)
class KeyEvent:
    key: str  # relative to the root
    value: bytes | None  # None for a delete


def parse_endpoint(endpoint: str, identity: Identity | None) -> tuple[str, int, bool]:
    """(host, port, tls) of an etcd endpoint (see the module docstring)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        scheme, rest = ("https" if identity is not None else "http"), endpoint
    if scheme not in ("http", "https"):
        raise ValueError(f"etcd endpoint {endpoint!r}: the scheme must be http or https")
    if scheme == "https" and identity is None:
        raise ValueError(f"etcd endpoint {endpoint!r} is TLS, but this process has no certificate (--certs)")
    host, _, port = rest.rstrip("/").rpartition(":")
    return host or "127.0.0.1", int(port), scheme == "https"


class _TlsClient(aetcd.Client):
    """aetcd's client over a mutual-TLS channel (its own ``connect`` opens plaintext only)."""

    def __init__(self, *args: object, identity: Identity, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._identity = identity

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        options = [*self._options.items(), ("grpc.ssl_target_name_override", peer_name("etcd"))]
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._identity.channel_credentials(),
                                               options=options)
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout,
                                              metadata=self.metadata)
        self._connected.set()


class EtcdClient:
    def __init__(self, endpoint: str, root: str = DEFAULT_ROOT, timeout: float = 5.0, identity: Identity | None = None):
        host, port, tls = parse_endpoint(endpoint, identity)
        if identity is not None and not tls:
            log.warning("INSECURE: etcd over plaintext (http:// endpoint) although this process has a certificate",
                        endpoint=endpoint)
        self.endpoint = endpoint
        self.tls = tls
        self.root = root if root.endswith("/") else root + "/"
        self.timeout = timeout
        self._identity = identity if tls else None
        self._address = (host, port)
        self._generation = -1
        self._replaced: set[asyncio.Task] = set()
        self._aetcd: aetcd.Client = self._new_client()

    def _new_client(self) -> aetcd.Client:
        host, port = self._address
        if self._identity is None:
            return aetcd.Client(host=host, port=port, timeout=int(self.timeout), options=CHANNEL_OPTIONS)
        self._generation = self._identity.current().generation
        return _TlsClient(host=host, port=port, timeout=int(self.timeout), options=CHANNEL_OPTIONS,
                          identity=self._identity)

    @property
    def _client(self) -> aetcd.Client:
        """The aetcd client; after this process's certificate changed, a new one (new connection)."""
        if self._identity is not None and self._identity.current().generation != self._generation:
            old, self._aetcd = self._aetcd, self._new_client()
            task = asyncio.get_running_loop().create_task(old.close())
            self._replaced.add(task)
            task.add_done_callback(self._replaced.discard)
        return self._aetcd

    def _key(self, key: str) -> bytes:
        return (self.root + key).encode()

    async def close(self) -> None:
        with contextlib.suppress(*ETCD_ERRORS):
            await self._client.close()

    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        await asyncio.wait_for(self._client.put(self._key(key), value, lease=lease_id), self.timeout)

    async def put_if_absent(self, key: str, value: bytes, lease_id: int | None = None) -> bool:
        """Create ``key`` only if it does not exist (one etcd transaction); False if it did. With ``lease_id`` the key
        goes when the lease does (an election: the holder keeps its lease alive)."""
        k = self._key(key)
        tx = self._client.transactions
        put = tx.put(k, value, lease=lease_id) if lease_id is not None else tx.put(k, value)
        succeeded, _ = await asyncio.wait_for(
            self._client.transaction(compare=[tx.version(k) == 0], success=[put], failure=[]), self.timeout)
        return bool(succeeded)

    async def replace(self, key: str, old: bytes, new: bytes) -> bool:
        """Set ``key`` to ``new`` only if it still holds ``old`` (one etcd transaction); False if it did not."""
        k = self._key(key)
        tx = self._client.transactions
        succeeded, _ = await asyncio.wait_for(
            self._client.transaction(compare=[tx.value(k) == old], success=[tx.put(k, new)], failure=[]),
            self.timeout)
        return bool(succeeded)

    async def get(self, key: str) -> bytes | None:
        result = await asyncio.wait_for(self._client.get(self._key(key)), self.timeout)
        return None if result is None else bytes(result.value)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return (await self.get_prefix_at(prefix))[0]

    async def get_prefix_at(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Everything under ``prefix`` and the store revision it was read at (to watch from)."""
        result = await asyncio.wait_for(self._client.get_prefix(self._key(prefix)), self.timeout)
        listing = {bytes(kv.key).decode()[len(self.root):]: bytes(kv.value) for kv in result}
        return listing, int(result.header.revision)

    async def delete(self, key: str) -> None:
        await asyncio.wait_for(self._client.delete(self._key(key)), self.timeout)

    async def grant_lease(self, ttl: int) -> int:
        lease = await asyncio.wait_for(self._client.lease(ttl), self.timeout)
        return int(lease.id)

    async def refresh_lease(self, lease_id: int) -> int:
        """Returns the remaining TTL; <= 0 means the lease is gone (expired while we were cut off)."""
        responses = await asyncio.wait_for(self._client.refresh_lease(lease_id), self.timeout)
        ttl = 0
        for response in responses if isinstance(responses, list) else [responses]:
            ttl = int(getattr(response, "TTL", 0))
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        with contextlib.suppress(*ETCD_ERRORS):
            await asyncio.wait_for(self._client.revoke_lease(lease_id), self.timeout)

    async def watch_prefix(self, prefix: str, start_revision: int | None = None, resume: bool = True
                           ) -> AsyncIterator[KeyEvent]:
        """Events under ``prefix`` from ``start_revision`` (default: now) forever; with ``resume``,
        errors are retried from the last seen revision + 1 (no event lost or repeated), without it
        they are raised and a closed stream ends the iteration (the caller re-lists)."""
        while True:
            try:
                watch = await self._client.watch_prefix(self._key(prefix), start_revision=start_revision)
                async for event in watch:
                    start_revision = int(event.kv.mod_revision) + 1
                    key = bytes(event.kv.key).decode()[len(self.root):]
                    deleted = event.kind == aetcd.EventKind.DELETE
                    yield KeyEvent(key, None if deleted else bytes(event.kv.value))
                if not resume:
                    return
            except ETCD_ERRORS as e:
                if not resume:
                    raise
                log.warning("etcd watch interrupted; resuming", prefix=prefix, error=str(e))
                await asyncio.sleep(0.5)


async def mirror_prefix(etcd: EtcdClient, prefix: str, reset: Callable[[dict[str, bytes]], None],
                        apply: Callable[[KeyEvent], None]) -> None:
    """Keep a local copy of everything under ``prefix``: ``reset`` with a full listing, then ``apply``
    each watch event. While etcd is unreachable the copy is left as it was (callers serve their last
    view); when it comes back the listing is taken again, which also reconciles anything missed.
    Runs until cancelled.
    """
    while True:
        try:
            listing, revision = await etcd.get_prefix_at(prefix)
            reset(listing)
            # From the listing's revision on: a write between the listing and the watch is not lost.
            # Any interruption re-lists (a resumed watch fails for good once etcd has compacted
            # the revision it would resume from).
            async for event in etcd.watch_prefix(prefix, start_revision=revision + 1, resume=False):
                apply(event)
            await asyncio.sleep(0.1)  # the server closed the stream: list again, without spinning
        except ETCD_ERRORS as e:
            log.warning("etcd unavailable; serving the last view", prefix=prefix, error=str(e))
            await asyncio.sleep(0.5)
