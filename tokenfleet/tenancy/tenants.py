"""Tenants and their API keys.

A key is ``tfk_<key id>_<secret>``: the key id (8 characters) names the key in logs, metrics
and the CLI; the whole key is stored only as its SHA-256 (keys are 190-bit random strings, so
a plain hash is enough and lookups stay one dict access). Keys are never logged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass

TIERS = ("interactive", "batch")
DEFAULT_MAX_CONCURRENT = 64  # a new tenant's open-stream limit unless it says otherwise
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY = re.compile(r"^tfk_([A-Za-z0-9]{8})_([A-Za-z0-9_-]{32})$")


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str = "interactive"
    tokens_per_minute: int = 0  # 0 = unlimited
    requests_per_minute: int = 0  # 0 = unlimited
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # open streams at once; 0 = unlimited (must be said)
    models: tuple[str, ...] = ()  # model names (or aliases) it may use; empty = all
    # Tenants of one cache group share cached prompt prefixes (e.g. one company's keys); "" = its own.
    cache_group: str = ""
    # An operator's or the platform's own tenant: responses name the replica that served them.
    internal: bool = False
    # Pinned versions: a model name or alias it sends -> the ref it gets instead (e.g. a fine-tune's adapter version:
    # ("support-bot", "support-bot@v3")); given as a mapping, kept as sorted pairs.
    pins: tuple[tuple[str, str], ...] = ()
    # Stored responses (the Responses API): kept this many days, at most this many bytes at once (0 = no limit;
    # a response past it is served and not stored).
    response_days: float = 30.0
    response_bytes: int = 0
    # Transcript tokens its conversations may keep retained in the engines' KV cache at once (0 = no limit; past it,
    # a turn is served without retention).
    retention_tokens: int = 0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tenant name {self.name!r}: 1-64 letters, digits, '.', '_' or '-'")
        if self.cache_group and not _NAME.match(self.cache_group):
            raise ValueError(f"cache group {self.cache_group!r}: 1-64 letters, digits, '.', '_' or '-'")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {self.tier!r}")
        if self.response_days <= 0:
            raise ValueError(f"response_days must be > 0, got {self.response_days}")
        for field in ("tokens_per_minute", "requests_per_minute", "max_concurrent", "response_bytes",
                      "retention_tokens"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0")
        object.__setattr__(self, "models", tuple(self.models))
        pins = self.pins.items() if isinstance(self.pins, dict) else self.pins
        object.__setattr__(self, "pins", tuple(sorted((str(k), str(v)) for k, v in pins)))
        for name, ref in self.pins:
            if not name or not ref or "@" in name:
                raise ValueError(f"a pin maps a model name to a ref (NAME=NAME@VERSION), got {name!r} -> {ref!r}")

    def pinned(self, model: str) -> str:
        """The ref this tenant gets when it sends ``model``."""
        return dict(self.pins).get(model, model)

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def to_json(self) -> bytes:
        return json.dumps({**dataclasses.asdict(self), "pins": dict(self.pins)}, sort_keys=True).encode()

    @classmethod
    def from_dict(cls, data: dict) -> Tenant:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, raw: bytes) -> Tenant:
        return cls.from_dict(json.loads(raw))


@dataclass(frozen=True)
class ApiKey:
    key_hash: str  # sha256 hex of the whole key
    key_id: str
    tenant: str
    created_at: float = 0.0
    revoked: bool = False

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ApiKey:
        data = json.loads(raw)
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}})


def new_key(tenant: str, now: float | None = None) -> tuple[str, ApiKey]:
    """A fresh key (shown once) and its stored record."""
    key_id = secrets.token_hex(4)
    secret = secrets.token_urlsafe(24)[:32].ljust(32, "x")
    key = f"tfk_{key_id}_{secret}"
    return key, ApiKey(hash_key(key), key_id, tenant, time.time() if now is None else now)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str | None:
    """The id part of a well-formed key (for logs), or None."""
    match = _KEY.match(key)
    return match.group(1) if match else None


class Directory:
    """Tenants and keys as a gateway sees them (from etcd or a file); lookups by key hash."""

    def __init__(self, tenants: dict[str, Tenant] | None = None, keys: dict[str, ApiKey] | None = None):
        self.tenants = dict(tenants or {})
        self.keys = dict(keys or {})  # key hash -> record

    def authenticate(self, key: str | None) -> tuple[Tenant, ApiKey]:
        """The key's tenant; AuthError (-> 401) for a missing, malformed, unknown or revoked key."""
        if not key:
            raise AuthError("You didn't provide an API key. Pass it as 'Authorization: Bearer tfk_...'.")
        record = self.keys.get(hash_key(key))
        if record is None or record.revoked:
            hint = key_id_of(key)
            raise AuthError("Incorrect API key provided" + (f" (key id {hint})." if hint else "."))
        tenant = self.tenants.get(record.tenant)
        if tenant is None:
            raise AuthError(f"The API key's tenant {record.tenant!r} no longer exists.")
        return tenant, record


class AuthError(Exception):
    """A missing, unknown or revoked API key (401)."""
