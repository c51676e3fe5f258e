"""The model registry: versioned model records and aliases, stored in etcd.

Keys (under the etcd root):
- ``models/<name>/<version>`` -> a :class:`ModelRecord` as JSON. Versions are immutable: registering
  the same name@version again with different content is an error; the identical record is a no-op.
- ``aliases/<alias>`` -> ``{"target": "<name>"}`` or ``{"target": "<name>@<version>"}``, optionally with a canary:
  ``"canary": "<name>@<version>", "weight": w`` sends a share w of the alias's conversations there.

A request's ``model`` is resolved by :meth:`RegistryView.resolve`: ``name@version`` exactly, an
alias to its target, a bare name to its newest version. The view is pure (no I/O) so routers,
gateways and the registry service share the same resolution rules and tests need no etcd.

A canary split is sticky per conversation: ``resolve(alias, sticky=key)`` hashes the alias and the key (the
request's ``user``, else its tenant) to a number in [0, 1) and takes the canary below the weight. The number does
not depend on the weight, so raising it only moves conversations onto the canary, never back and forth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import time
from dataclasses import dataclass, field

from tokenfleet.cluster.etcd import EtcdClient, KeyEvent, mirror_prefix

MODELS, ALIASES = "models/", "aliases/"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: resolved by the first worker (models.auto_dtype)
STATUSES = ("ready", "disabled")
TOOL_FORMATS = ("hermes", "generic")  # tokenfleet.api.tools.FORMATS


class UnknownModelError(LookupError):
    """The name, alias or version is not registered."""


class RegistryConflictError(ValueError):
    """A write that would change an immutable version or shadow a model with an alias."""


def check_name(kind: str, value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError(f"{kind} {value!r} must match {NAME_RE.pattern} (no '/', '@' or spaces)")
    return value


def split_ref(ref: str) -> tuple[str, str]:
    """``name@version`` -> (name, version); a bare name -> (name, "")."""
    name, _, version = ref.partition("@")
    return name, version


QUANTIZATIONS = ("", "fp8", "gguf", "int8")  # a model record's weight formats

@dataclass(frozen=True)
class ModelRecord:
    """Everything a worker needs to load a model and a gateway needs to serve it."""

    name: str
    version: str
    path: str  # artifact location: an HF-style folder (config.json, safetensors, tokenizer)
    architecture: str = "llama"
    dtype: str = "auto"  # auto: the first worker's fastest here (models.auto_dtype), pinned in ``numerics``
    # "" (none) | "fp8": FP8 weights (torch engine: models.linear.Fp8Linear; trtllm: its engine) | "gguf": the GGUF
    # file's own quantized tensors (torch engine; ``path`` a folder imported with --keep-quantized) | "int8": int8
    # weights (torch engine; on CPUs int8 activations on decode steps too)
    quantization: str = ""
    backend: str = "torch"  # torch | trtllm
    tensor_parallel_size: int = 1
    tokenizer: str = ""  # folder with the tokenizer and chat template; "" = path
    max_model_len: int = 0  # 0 = the model config's max_position_embeddings
    default_sampling: dict[str, float] = field(default_factory=dict)
    status: str = "ready"
    created_at: float = 0.0
    description: str = ""
    tool_format: str = ""  # tokenfleet.api.tools.FORMATS; "" = the generic fallback
    # JSON in TensorRT-LLM's speculative_config schema ({"decoding_type": ...}): passed to that library (trtllm), or
    # read by the torch engine (decoding_type NGram: engine.spec_decode.SpecConfig.parse)
    speculative_config: str = ""
    # A LoRA adapter (PEFT folder at ``path``) of the model ``base`` (a ref: name or name@version); "" = a model. Its
    # requests run on the base's workers, which load it on first use; it has versions and aliases like any model.
    base: str = ""
    # "" (the weights' dtype) | "fp8": an FP8 e4m3 KV cache with per-token, per-head scales (torch engine:
    # models.kv_fp8; trtllm: its FP8 KV cache, which quantization "fp8" also turns on)
    kv_cache_dtype: str = ""
    # dtype "auto" resolved once for the whole fleet: the JSON of models.auto_dtype.DtypeChoice (dtype, reason,
    # measured rates, machine) that the first worker to load this version pinned (ModelRegistry.pin_numerics); every
    # other worker serves that dtype, so replicas agree on answers and KV layout. "" until then; not part of the
    # record's content (registering the same settings again is a no-op)
    numerics: str = ""

    def __post_init__(self) -> None:
        check_name("model name", self.name)
        check_name("version", self.version)
        if not self.path:
            raise ValueError("a model record needs a path")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.numerics:
            try:
                pinned = json.loads(self.numerics)
            except ValueError as e:
                raise ValueError(f"numerics is not JSON: {e}") from e
            if not isinstance(pinned, dict) or pinned.get("dtype") not in DTYPES[1:]:
                raise ValueError(f"numerics must pin one of {', '.join(DTYPES[1:])}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not one of '', {', '.join(QUANTIZATIONS[1:])}")
        if self.quantization in ("gguf", "int8") and self.backend != "torch":
            raise ValueError(f"{self.quantization} weights are served by the torch engine")
        if self.quantization == "fp8" and self.dtype == "float32":
            raise ValueError("fp8 weights run with bfloat16 or float16 activations, not float32")
        if self.kv_cache_dtype not in ("", "fp8"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of '', fp8")
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        if self.tool_format and self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format {self.tool_format!r} is not one of {', '.join(TOOL_FORMATS)}")
        if self.speculative_config:
            try:
                spec = json.loads(self.speculative_config)
            except ValueError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from e
            if not isinstance(spec, dict) or "decoding_type" not in spec:
                raise ValueError("speculative_config must be a JSON object with a decoding_type")
            if self.backend == "torch":  # the torch engine's own speculation (NGram): refused here, not at load
                from tokenfleet.engine.spec_decode import SpecConfig

                SpecConfig.parse(spec)
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.base:
            base_name, base_version = split_ref(self.base)
            check_name("base model", base_name)
            if base_version:
                check_name("base version", base_version)
            if self.backend != "torch" or self.quantization:
                raise ValueError("a LoRA adapter record has no backend or quantization of its own: its matrices "
                                 "are served by the torch engine in the base's dtype (over a gguf or int8 base too)")

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def key(self) -> str:
        return f"{MODELS}{self.name}/{self.version}"

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> ModelRecord:
        data = json.loads(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # newer writers may add fields

    def same_content(self, other: ModelRecord) -> bool:
        return dataclasses.replace(self, created_at=0.0, numerics="") == \
            dataclasses.replace(other, created_at=0.0, numerics="")

    @property
    def pinned_dtype(self) -> str:
        """The dtype the fleet serves: the record's own, else the pin's ("" while "auto" is not pinned yet)."""
        if self.dtype != "auto":
            return self.dtype
        return str(json.loads(self.numerics)["dtype"]) if self.numerics else ""


@dataclass
class RegistryView:
    """An in-memory copy of the registry keys with the resolution rules."""

    models: dict[tuple[str, str], ModelRecord] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    canaries: dict[str, tuple[str, float]] = field(default_factory=dict)  # alias -> (canary ref, its weight)
    routes: dict[str, str] = field(default_factory=dict)  # routing alias -> its RoutePolicy JSON (routing.model_router)
    revision: int = 0  # bumped on every change, so watchers can tell a new view from an old one

    def reset(self, listing: dict[str, bytes], prefixes: tuple[str, ...] = (MODELS, ALIASES)) -> None:
        """Replace the parts under ``prefixes`` with a fresh etcd listing."""
        if MODELS in prefixes:
            self.models.clear()
        if ALIASES in prefixes:
            self.aliases.clear()
            self.canaries.clear()
            self.routes.clear()
        for key, raw in listing.items():
            self._apply(key, raw)
        self.revision += 1

    def apply(self, event: KeyEvent) -> None:
        self._apply(event.key, event.value)
        self.revision += 1

    def _apply(self, key: str, raw: bytes | None) -> None:
        if key.startswith(MODELS):
            name, _, version = key[len(MODELS):].partition("/")
            if raw is None:
                self.models.pop((name, version), None)
            else:
                self.models[(name, version)] = ModelRecord.from_json(raw)
        elif key.startswith(ALIASES):
            alias = key[len(ALIASES):]
            self.canaries.pop(alias, None)
            self.routes.pop(alias, None)
            if raw is None:
                self.aliases.pop(alias, None)
            else:
                value = json.loads(raw)
                self.aliases[alias] = value["target"]
                if value.get("canary"):
                    self.canaries[alias] = (value["canary"], float(value.get("weight", 0.0)))
                if value.get("route"):
                    self.routes[alias] = json.dumps(value["route"], sort_keys=True)

    def versions(self, name: str) -> list[ModelRecord]:
        """A model's versions, oldest first."""
        return sorted((r for (n, _), r in self.models.items() if n == name), key=lambda r: (r.created_at, r.version))

    def resolve(self, ref: str, sticky: str = "") -> ModelRecord:
        """``name@version`` | alias | name (newest ready version) -> the record; UnknownModelError otherwise.
        ``sticky``: the conversation's key, which picks a side of an alias's canary split."""
        seen: set[str] = set()
        while ref in self.aliases and "@" not in ref:
            if ref in seen:
                raise UnknownModelError(f"alias loop at {ref!r}")
            seen.add(ref)
            canary = self.canaries.get(ref)
            ref = canary[0] if canary is not None and canary_bucket(ref, sticky) < canary[1] else self.aliases[ref]
        name, version = split_ref(ref)
        if version:
            record = self.models.get((name, version))
            if record is None:
                raise UnknownModelError(f"model {ref!r} is not registered")
            return record
        ready = [r for r in self.versions(name) if r.status == "ready"]
        if not ready:
            raise UnknownModelError(f"model {name!r} is not registered")
        return ready[-1]

    def names(self) -> list[str]:
        """Every name a client may send: model names and aliases (versions are reachable as name@version)."""
        return sorted({n for n, _ in self.models} | set(self.aliases))


def canary_bucket(alias: str, sticky: str) -> float:
    """A conversation's fixed place in [0, 1) for ``alias``'s canary split."""
    digest = hashlib.sha256(f"{alias}\x00{sticky}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


async def follow_registry(etcd: EtcdClient, view: RegistryView) -> None:
    """Keep ``view`` in sync with etcd until cancelled (keeps the last view through outages)."""
    await asyncio.gather(
        mirror_prefix(etcd, MODELS, lambda listing: view.reset(listing, (MODELS,)), view.apply),
        mirror_prefix(etcd, ALIASES, lambda listing: view.reset(listing, (ALIASES,)), view.apply),
    )


class ModelRegistry:
    """Registry reads and writes against etcd (used by the registry service)."""

    def __init__(self, etcd: EtcdClient):
        self.etcd = etcd

    async def load(self) -> RegistryView:
        view = RegistryView()
        view.reset({**await self.etcd.get_prefix(MODELS), **await self.etcd.get_prefix(ALIASES)})
        return view

    async def register(self, record: ModelRecord) -> tuple[ModelRecord, bool]:
        """Store a new version; returns (stored record, created). Same content again is a no-op. An adapter's base
        must be registered, and be a model (not itself an adapter)."""
        if record.base:
            view = await self.load()
            base = view.resolve(record.base)  # UnknownModelError: no such base
            if base.base:
                raise ValueError(f"{record.base!r} is itself an adapter; an adapter's base is a model")
            if split_ref(record.base)[0] == record.name:
                raise ValueError("an adapter cannot be its own base")
        if not record.created_at:
            record = dataclasses.replace(record, created_at=time.time())
        if await self.etcd.put_if_absent(record.key, record.to_json()):
            return record, True
        raw = await self.etcd.get(record.key)
        existing = ModelRecord.from_json(raw) if raw is not None else None
        if existing is not None and existing.same_content(record):
            return existing, False
        raise RegistryConflictError(f"{record.ref} is already registered with different settings; "
                                    "versions are immutable: register a new version")

    async def pin_numerics(self, ref: str, numerics: str) -> ModelRecord:
        """Pin ``numerics`` (a DtypeChoice's JSON) on the record ``ref`` resolves to, unless one is pinned already:
        the first worker's choice stands (compare-and-set on the record's key). Returns the record as stored. A
        record whose dtype is not "auto" keeps its own dtype and gets no pin."""
        if not numerics:
            raise ValueError("numerics: a dtype choice's JSON is required")
        key = (await self.load()).resolve(ref).key  # the alias or bare name resolved once; then only that key
        for _ in range(8):  # another writer (a status change) between the read and the write: read again
            raw = await self.etcd.get(key)
            if raw is None:
                raise UnknownModelError(f"model {ref!r} is not registered")
            record = ModelRecord.from_json(raw)
            if record.dtype != "auto" or record.numerics:
                return record
            pinned = dataclasses.replace(record, numerics=numerics)
            if await self.etcd.replace(key, raw, pinned.to_json()):
                return pinned
        raise RegistryConflictError(f"{ref}: the record kept changing while its numerics were pinned")

    async def set_status(self, ref: str, status: str) -> ModelRecord:
        view = await self.load()
        record = dataclasses.replace(view.resolve(ref), status=status)
        await self.etcd.put(record.key, record.to_json())
        return record

    async def set_alias(self, alias: str, target: str, canary: str = "", weight: float = 0.0, route: str = "") -> None:
        """Point ``alias`` at ``target``; with ``canary``, a share ``weight`` of its conversations goes there; with
        ``route`` (a RoutePolicy's JSON), a routing alias: each request to its small or big model (``target``)."""
        check_name("alias", alias)
        policy = None
        if route:
            from tokenfleet.routing.model_router import RoutePolicy

            policy = RoutePolicy.from_json(route)  # ValueError: a bad policy
            if canary:
                raise ValueError("a routing alias cannot also have a canary (give its models aliases with canaries)")
            if split_ref(policy.big) != split_ref(target):
                raise ValueError(f"a routing alias's target is its big model ({policy.big!r}), got {target!r}")
        if not 0.0 <= weight <= 1.0:  # also NaN
            raise ValueError(f"a canary weight is in [0, 1], got {weight}")
        if weight and not canary:
            raise ValueError("a canary weight needs a canary")
        view = await self.load()
        if any(n == alias for n, _ in view.models):
            raise RegistryConflictError(f"alias {alias!r} would shadow the model of that name")
        value = {}
        for key, ref in (("target", target), ("canary", canary)):
            if not ref:
                continue
            view.resolve(ref)  # the target (and the canary) must exist now
            name, version = split_ref(ref)
            if name in view.aliases:
                raise RegistryConflictError(f"alias {key} {ref!r} is itself an alias; point at a model")
            value[key] = f"{name}@{version}" if version else name
        if canary:
            value["weight"] = weight  # type: ignore[assignment]
        if policy is not None:
            for ref in (policy.small, policy.big):
                view.resolve(ref)  # both models must exist now
                if split_ref(ref)[0] in view.aliases:
                    raise RegistryConflictError(f"a route names {ref!r}, itself an alias; point at a model")
            value["route"] = json.loads(policy.to_json())  # type: ignore[assignment]
        await self.etcd.put(f"{ALIASES}{alias}", json.dumps(value).encode())

    async def delete_alias(self, alias: str) -> bool:
        view = await self.load()
        if alias not in view.aliases:
            return False
        await self.etcd.delete(f"{ALIASES}{alias}")
        return True
