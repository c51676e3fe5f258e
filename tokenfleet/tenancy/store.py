"""Tenants and API keys in etcd (``tenants/<name>``, ``apikeys/<key hash>``) or in a YAML file: the
admin operations over either (``TenantStore``), and a directory that gateways keep current with a
watch (a revoked key stops working on every gateway as soon as the watch delivers the change: well
under a second on a healthy etcd)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
from collections.abc import Iterator
from pathlib import Path

import yaml

from tokenfleet.cluster.etcd import EtcdClient, KeyEvent, mirror_prefix
from tokenfleet.files import write_atomically
from tokenfleet.tenancy.tenants import ApiKey, Directory, Tenant, new_key

TENANTS, KEYS = "tenants/", "apikeys/"


def _tenants(listing: dict[str, bytes]) -> dict[str, Tenant]:
    return {k.removeprefix(TENANTS): Tenant.from_json(v) for k, v in listing.items()}


def _keys(listing: dict[str, bytes]) -> dict[str, ApiKey]:
    return {k.removeprefix(KEYS): ApiKey.from_json(v) for k, v in listing.items()}


class TenantStore:
    """The admin operations of `tokenfleet tenants`, written once; subclasses store the records
    (etcd for a fleet, a YAML file for small setups)."""

    async def directory(self) -> Directory:
        raise NotImplementedError

    async def _has_tenant(self, name: str) -> bool:
        return name in (await self.directory()).tenants

    async def _create_tenant(self, tenant: Tenant) -> bool:
        """Store a new tenant; False if one of that name exists."""
        raise NotImplementedError

    async def _put_tenant(self, tenant: Tenant) -> None:
        raise NotImplementedError

    async def _put_key(self, record: ApiKey) -> None:
        raise NotImplementedError

    async def add(self, tenant: Tenant, update: bool = False) -> str | None:
        """Create the tenant and its first key (returned, shown once). ``update``: replace an existing
        tenant's settings and issue no key. ValueError if it exists (and not ``update``)."""
        if update:
            if not await self._has_tenant(tenant.name):
                raise LookupError(f"no tenant {tenant.name!r}")
            await self._put_tenant(tenant)
            return None
        if not await self._create_tenant(tenant):
            raise ValueError(f"tenant {tenant.name!r} exists (use --update to change it)")
        return await self.issue_key(tenant.name)

    async def issue_key(self, tenant: str) -> str:
        if not await self._has_tenant(tenant):
            raise LookupError(f"no tenant {tenant!r}")
        key, record = new_key(tenant)
        await self._put_key(record)
        return key

    async def revoke(self, key_id: str) -> ApiKey:
        revoked = dataclasses.replace(await self._find(key_id), revoked=True)
        await self._put_key(revoked)
        return revoked

    async def rotate(self, key_id: str) -> str:
        """A new key for the same tenant; the old one is revoked."""
        record = await self._find(key_id)
        key = await self.issue_key(record.tenant)
        await self.revoke(key_id)
        return key

    async def _find(self, key_id: str) -> ApiKey:
        matches = [r for r in (await self.directory()).keys.values() if r.key_id == key_id]
        if not matches:
            raise LookupError(f"no API key with id {key_id!r}")
        return matches[0]


class EtcdTenantStore(TenantStore):
    def __init__(self, etcd: EtcdClient):
        self.etcd = etcd

    async def directory(self) -> Directory:
        return Directory(_tenants(await self.etcd.get_prefix(TENANTS)), _keys(await self.etcd.get_prefix(KEYS)))

    async def _has_tenant(self, name: str) -> bool:
        return await self.etcd.get(TENANTS + name) is not None

    async def _create_tenant(self, tenant: Tenant) -> bool:
        return await self.etcd.put_if_absent(TENANTS + tenant.name, tenant.to_json())

    async def _put_tenant(self, tenant: Tenant) -> None:
        await self.etcd.put(TENANTS + tenant.name, tenant.to_json())

    async def _put_key(self, record: ApiKey) -> None:
        await self.etcd.put(KEYS + record.key_hash, record.to_json())


class FileTenantStore(TenantStore):
    """A YAML file. Every change holds an exclusive lock on ``<file>.lock``, re-reads the file, applies
    itself and replaces the file atomically: two editors at once never lose each other's changes (a
    revocation, say), and a gateway re-reading it never sees half a file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._directory = load_file(self.path) if self.path.exists() else Directory()

    async def directory(self) -> Directory:
        """The file as it is now (another editor may have changed it since this store opened it)."""
        self._directory = load_file(self.path) if self.path.exists() else Directory()
        return self._directory

    @contextlib.contextmanager
    def _editing(self) -> Iterator[Directory]:
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._directory = load_file(self.path) if self.path.exists() else Directory()
                yield self._directory
                save_file(self.path, self._directory)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    async def _create_tenant(self, tenant: Tenant) -> bool:
        with self._editing() as directory:
            if tenant.name in directory.tenants:
                return False
            directory.tenants[tenant.name] = tenant
        return True

    async def _put_tenant(self, tenant: Tenant) -> None:
        with self._editing() as directory:
            directory.tenants[tenant.name] = tenant

    async def _put_key(self, record: ApiKey) -> None:
        with self._editing() as directory:
            directory.keys[record.key_hash] = record


async def follow_directory(etcd: EtcdClient, directory: Directory, synced: asyncio.Event | None = None) -> None:
    """Keep ``directory`` equal to etcd's tenants and keys (runs until cancelled)."""

    def reset_tenants(listing: dict[str, bytes]) -> None:
        directory.tenants = _tenants(listing)

    def on_tenant(event: KeyEvent) -> None:
        name = event.key.removeprefix(TENANTS)
        if event.value is None:
            directory.tenants.pop(name, None)
        else:
            directory.tenants[name] = Tenant.from_json(event.value)

    def reset_keys(listing: dict[str, bytes]) -> None:
        directory.keys = _keys(listing)
        if synced is not None:
            synced.set()

    def on_key(event: KeyEvent) -> None:
        key_hash = event.key.removeprefix(KEYS)
        if event.value is None:
            directory.keys.pop(key_hash, None)
        else:
            directory.keys[key_hash] = ApiKey.from_json(event.value)

    await asyncio.gather(mirror_prefix(etcd, TENANTS, reset_tenants, on_tenant),
                         mirror_prefix(etcd, KEYS, reset_keys, on_key))


# ---- a static YAML file (small setups) ------------------------------------------------------------
def load_file(path: str | Path) -> Directory:
    """``tenants: {name: {tier, tokens_per_minute, ...}}`` and ``keys: [{key_hash, key_id, tenant, revoked}]``."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    tenants = {name: Tenant.from_dict({**(fields or {}), "name": name}) for name, fields in
               (data.get("tenants") or {}).items()}
    keys = {}
    for entry in data.get("keys") or []:
        record = ApiKey(**{k: v for k, v in entry.items() if k in {f.name for f in dataclasses.fields(ApiKey)}})
        keys[record.key_hash] = record
    return Directory(tenants, keys)


def save_file(path: str | Path, directory: Directory) -> None:
    data = {"tenants": {name: {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(t).items()
                               if k != "name"} for name, t in sorted(directory.tenants.items())},
            "keys": [dataclasses.asdict(k) for k in directory.keys.values()]}
    write_atomically(Path(path), yaml.safe_dump(data, sort_keys=False).encode(), 0o600)  # key hashes: owner only
