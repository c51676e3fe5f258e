"""`tokenfleet tenants add|list|revoke|rotate` (etcd, or a YAML file) and `tokenfleet usage` (the ledger)."""

from __future__ import annotations

import argparse
import asyncio
from datetime import UTC, datetime

from tokenfleet.tenancy.tenants import DEFAULT_MAX_CONCURRENT


def add_commands(sub: argparse._SubParsersAction) -> None:
    tenants = sub.add_parser("tenants", help="manage tenants and API keys").add_subparsers(title="tenants commands")
    add = tenants.add_parser("add", help="create a tenant and print its first API key (shown once)")
    add.add_argument("name")
    add.add_argument("--tier", choices=["interactive", "batch"], default="interactive")
    add.add_argument("--tokens-per-minute", type=int, default=0, help="0 = unlimited")
    add.add_argument("--requests-per-minute", type=int, default=0, help="0 = unlimited")
    add.add_argument("--max-concurrent", type=int, default=DEFAULT_MAX_CONCURRENT,
                     help=f"open streams at once, split between gateways (default {DEFAULT_MAX_CONCURRENT}); 0 = unlimited")
    add.add_argument("--models", default="", help="comma-separated models it may use (default: all)")
    add.add_argument("--cache-group", default="", help="tenants of one group share cached prompt prefixes (e.g. one "
                     "company's keys); default: the tenant alone")
    add.add_argument("--pin", action="append", default=[], metavar="NAME=REF",
                     help="pin a model or adapter version: requests for NAME get REF (e.g. support-bot=support-bot@v3); "
                     "repeat for several")
    add.add_argument("--internal", action="store_true",
                     help="an operator's tenant: responses name the replica that served them (x-tokenfleet-replica)")
    add.add_argument("--response-days", type=float, default=30.0,
                     help="stored responses (the Responses API) are kept this many days (default 30)")
    add.add_argument("--response-bytes", type=int, default=0,
                     help="bytes of stored responses at once; a response past it is served, not stored (0 = no limit)")
    add.add_argument("--retention-tokens", type=int, default=0,
                     help="transcript tokens its conversations may keep retained in the engines' KV cache at once; "
                     "past it a turn is served without retention (0 = no limit)")
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
        where.add_argument("--etcd", help="etcd endpoint, https://host:port or http://host:port (default: the "
                           "`tokenfleet up` cluster's)")
        where.add_argument("--file", help="a YAML tenants file (gateway --tenants-file) instead of etcd")
        p.add_argument("--etcd-root", default="/tokenfleet/v1/")
        p.add_argument("--certs", help="certificates folder with operator.pem, for etcd over TLS (default: the "
                       "`tokenfleet up` cluster's, else $TOKENFLEET_CERTS or ~/.cache/tokenfleet/certs)")
        p.add_argument("--insecure", action="store_true", help="plaintext etcd without a certificate")

    usage = sub.add_parser("usage", help="usage per tenant, model and day from the gateway's ledger")
    usage.add_argument("--ledger", help="SQLite ledger (default: the gateway's default)")
    usage.add_argument("--since", help="YYYY-MM-DD (UTC); default: everything")
    usage.add_argument("--tenant")
    usage.add_argument("--format", choices=["table", "csv"], default="table")
    usage.add_argument("--pricing", help="pricing file for the usd column (tokenfleet.tenancy.pricing; default "
                       "$TOKENFLEET_PRICING, else $2/GPU-hour at placeholder throughputs)")
    usage.set_defaults(func=_cmd_usage)


def _tenant(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tokenfleet.tenancy.tenants import Tenant

    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    pins = {}
    for spec in args.pin:
        name, sep, ref = spec.partition("=")
        if not sep:
            raise ValueError(f"--pin takes NAME=REF, got {spec!r}")
        pins[name.strip()] = ref.strip()
    return Tenant(args.name, args.tier, args.tokens_per_minute, args.requests_per_minute, args.max_concurrent, models,
                  cache_group=args.cache_group, internal=args.internal, pins=tuple(pins.items()),
                  response_days=args.response_days, response_bytes=args.response_bytes,
                  retention_tokens=args.retention_tokens)


def _run(args: argparse.Namespace, operation):  # type: ignore[no-untyped-def]
    """``await operation(store)`` on the YAML file (``--file``) or on etcd."""
    from tokenfleet.tenancy.store import EtcdTenantStore, FileTenantStore

    if args.file:
        return asyncio.run(operation(FileTenantStore(args.file)))
    from tokenfleet.cli.context import cluster_context
    from tokenfleet.cluster.etcd import EtcdClient

    context = cluster_context(etcd=args.etcd, certs=args.certs, insecure=args.insecure)
    endpoint = context.require_etcd("--etcd or --file")
    identity = context.etcd_identity()

    async def run():  # type: ignore[no-untyped-def]
        client = EtcdClient(endpoint, args.etcd_root, identity=identity)
        try:
            return await operation(EtcdTenantStore(client))
        finally:
            await client.close()

    return asyncio.run(run())


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
    from tokenfleet.responses.store import usage as responses_usage
    from tokenfleet.tenancy.ledger import format_report, report
    from tokenfleet.tenancy.pricing import Pricing

    path = Path(args.ledger or envs.cache_dir() / "ledger.sqlite3")
    if not path.exists():
        raise FileNotFoundError(f"no ledger at {path}")
    since = datetime.strptime(args.since, "%Y-%m-%d").replace(tzinfo=UTC).timestamp() if args.since else 0.0
    print(format_report(report(path, since, args.tenant, Pricing.load(args.pricing)), args.format), end="")
    stored = {t: u for t, u in responses_usage(path).items() if args.tenant in (None, t)}
    if stored and args.format == "table":
        print("\nstored responses and retained conversations (now)\n"
              "tenant\tresponses\tbytes\tretained KV tokens\tretained KV bytes")
        for tenant, u in sorted(stored.items()):
            print(f"{tenant}\t{u['responses']}\t{u['bytes']}\t{u['retained_tokens']}\t{u['retained_bytes']}")
    return 0


