"""`tokenfleet tenants add|list|revoke|rotate` (etcd, or a YAML file) and `tokenfleet usage` (the ledger)."""

from __future__ import annotations

import argparse
import asyncio
from datetime import UTC, datetime


def add_commands(sub: argparse._SubParsersAction) -> None:
    tenants = sub.add_parser("tenants", help="manage tenants and API keys").add_subparsers(title="tenants commands")
    add = tenants.add_parser("add", help="create a tenant and print its first API key (shown once)")
    add.add_argument("name")
    add.add_argument("--tier", choices=["interactive", "batch"], default="interactive")
    add.add_argument("--tokens-per-minute", type=int, default=0, help="0 = unlimited")
    add.add_argument("--requests-per-minute", type=int, default=0, help="0 = unlimited")
    add.add_argument("--max-concurrent", type=int, default=0, help="open streams at once; 0 = unlimited")
    add.add_argument("--models", default="", help="comma-separated models it may use (default: all)")
    add.add_argument("--update", action="store_true", help="change an existing tenant's settings (no new key)")
    add.add_argument("--if-missing", action="store_true", help="do nothing (exit 0) when the tenant exists")
    add.set_defaults(func=_cmd_add)
    lst = tenants.add_parser("list", help="tenants and their keys (ids only; keys are stored hashed)")
    lst.set_defaults(func=_cmd_list)
    rev = tenants.add_parser("revoke", help="revoke an API key by its id (the 8 characters after tfk_)")
    rev.add_argument("key_id")
    rev.set_defaults(func=_cmd_revoke)
    rot = tenants.add_parser("rotate", help="issue a new key for the key's tenant and revoke the old one")
    rot.add_argument("key_id")
    rot.set_defaults(func=_cmd_rotate)
    for p in (add, lst, rev, rot):
        where = p.add_mutually_exclusive_group()
        where.add_argument("--etcd", help="etcd host:port (default: the `tokenfleet up` cluster's)")
        where.add_argument("--file", help="a YAML tenants file (gateway --tenants-file) instead of etcd")
        p.add_argument("--etcd-root", default="/tokenfleet/v1/")

    usage = sub.add_parser("usage", help="usage per tenant, model and day from the gateway's ledger")
    usage.add_argument("--ledger", help="SQLite ledger (default: the gateway's default)")
    usage.add_argument("--since", help="YYYY-MM-DD (UTC); default: everything")
    usage.add_argument("--tenant")
    usage.add_argument("--format", choices=["table", "csv"], default="table")
    usage.set_defaults(func=_cmd_usage)


def _tenant(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tokenfleet.tenancy.tenants import Tenant

    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    return Tenant(args.name, args.tier, args.tokens_per_minute, args.requests_per_minute, args.max_concurrent, models)


def _run(args: argparse.Namespace, operation):  # type: ignore[no-untyped-def]
    """``operation(store)`` on etcd, or on the YAML file (loaded, changed, saved)."""
    if args.file:
        return operation(_FileStore(args.file))
    from tokenfleet import launcher
    from tokenfleet.cluster.etcd import EtcdClient
    from tokenfleet.cluster.tenants import TenantStore

    endpoint = args.etcd or launcher.cluster_state().get("etcd")
    if not endpoint:
        raise ConnectionError("no --etcd or --file given and no `tokenfleet up` cluster is running")

    async def run():  # type: ignore[no-untyped-def]
        client = EtcdClient(endpoint, args.etcd_root)
        try:
            return await operation(TenantStore(client))  # TenantStore's methods are coroutines
        finally:
            await client.close()

    return asyncio.run(run())


class _FileStore:
    """TenantStore's operations on a YAML file (synchronous results wrapped for one code path)."""

    def __init__(self, path: str):
        from pathlib import Path

        from tokenfleet.cluster.tenants import load_file
        from tokenfleet.tenancy.tenants import Directory

        self.path = path
        self.dir = load_file(path) if Path(path).exists() else Directory()

    def _save(self) -> None:
        from tokenfleet.cluster.tenants import save_file

        save_file(self.path, self.dir)

    def add(self, tenant, update=False):  # type: ignore[no-untyped-def]
        if update:
            if tenant.name not in self.dir.tenants:
                raise LookupError(f"no tenant {tenant.name!r}")
            self.dir.tenants[tenant.name] = tenant
            self._save()
            return None
        if tenant.name in self.dir.tenants:
            raise ValueError(f"tenant {tenant.name!r} exists (use --update to change it)")
        self.dir.tenants[tenant.name] = tenant
        return self.issue_key(tenant.name)

    def issue_key(self, tenant):  # type: ignore[no-untyped-def]
        from tokenfleet.tenancy.tenants import new_key

        key, record = new_key(tenant)
        self.dir.keys[record.key_hash] = record
        self._save()
        return key

    def directory(self):  # type: ignore[no-untyped-def]
        return self.dir

    def revoke(self, key_id):  # type: ignore[no-untyped-def]
        import dataclasses

        record = self._find(key_id)
        self.dir.keys[record.key_hash] = dataclasses.replace(record, revoked=True)
        self._save()
        return self.dir.keys[record.key_hash]

    def rotate(self, key_id):  # type: ignore[no-untyped-def]
        record = self._find(key_id)
        key = self.issue_key(record.tenant)
        self.revoke(key_id)
        return key

    def _find(self, key_id):  # type: ignore[no-untyped-def]
        for record in self.dir.keys.values():
            if record.key_id == key_id:
                return record
        raise LookupError(f"no API key with id {key_id!r}")


def _cmd_add(args: argparse.Namespace) -> int:
    tenant = _tenant(args)
    try:
        key = _run(args, lambda store: store.add(tenant, args.update))
    except ValueError as e:
        if args.if_missing and "exists" in str(e):
            print(f"tenant {tenant.name} exists; nothing to do")
            return 0
        raise
    if key is None:
        print(f"updated tenant {tenant.name}")
    else:
        print(f"tenant {tenant.name} ({tenant.tier}); API key (shown once, store it now):\n{key}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    directory = _run(args, lambda store: store.directory())
    for name, t in sorted(directory.tenants.items()):
        limits = f"tpm={t.tokens_per_minute or '-'} rpm={t.requests_per_minute or '-'} streams={t.max_concurrent or '-'}"
        models = ",".join(t.models) or "all models"
        keys = [k for k in directory.keys.values() if k.tenant == name]
        key_text = ", ".join(f"{k.key_id}{' (revoked)' if k.revoked else ''}" for k in keys) or "no keys"
        print(f"{name}\t{t.tier}\t{limits}\t{models}\tkeys: {key_text}")
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    record = _run(args, lambda store: store.revoke(args.key_id))
    print(f"revoked key {record.key_id} of tenant {record.tenant}")
    return 0


def _cmd_rotate(args: argparse.Namespace) -> int:
    key = _run(args, lambda store: store.rotate(args.key_id))
    print(f"revoked key {args.key_id}; new API key (shown once, store it now):\n{key}")
    return 0


def _cmd_usage(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfleet import envs
    from tokenfleet.ledger import format_report, report

    path = Path(args.ledger or envs.cache_dir() / "ledger.sqlite3")
    if not path.exists():
        raise FileNotFoundError(f"no ledger at {path}")
    since = datetime.strptime(args.since, "%Y-%m-%d").replace(tzinfo=UTC).timestamp() if args.since else 0.0
    print(format_report(report(path, since, args.tenant), args.format), end="")
    return 0


