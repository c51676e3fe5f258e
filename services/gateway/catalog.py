"""The models a gateway serves: registered ones (a registry view kept current by a watch) and
static ones, each with its tokenizer, context length and tool-call format."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from tokenfleet.api.openai_schema import APIError
from tokenfleet.cluster.registry import RegistryView, UnknownModelError
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.routing.model_router import RoutePolicy

log = structlog.get_logger("tokenfleet.gateway")

ADAPTER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class ServedModel:
    name: str  # what the client asked for; echoed in responses
    ref: str  # what the router is asked for (name@version when registered)
    tokenizer: Tokenizer
    max_model_len: int
    tool_format: str = ""  # tokenfleet.api.tools.FORMATS key; "" = generic
    adapter: str = ""  # a LoRA adapter the base model's workers load (model "BASE:ADAPTER"); "" = none


def load_served(name: str, ref: str, tokenizer_dir: str, max_model_len: int = 0, tool_format: str = "") -> ServedModel:
    if not max_model_len:
        max_model_len = ModelConfig.from_dir(tokenizer_dir).max_position_embeddings
    return ServedModel(name, ref, Tokenizer(Path(tokenizer_dir)), max_model_len, tool_format)


@dataclass
class ModelCatalog:
    """The models this gateway serves: a registry view (kept current by a watch) and/or static ones."""

    static: dict[str, ServedModel] = field(default_factory=dict)
    view: RegistryView | None = None  # None: no registry; only static models
    _loaded: dict[str, ServedModel] = field(default_factory=dict)  # by record ref (name@version)
    _policies: dict[str, RoutePolicy] = field(default_factory=dict)  # parsed route policies by their JSON

    synced: bool = False  # a registry snapshot has arrived

    @property
    def ready(self) -> bool:
        return self.view is None or self.synced or bool(self.static)

    def names(self) -> list[tuple[str, int]]:
        names = {name: 0 for name in self.static}
        if self.view is not None:
            for name in self.view.names():
                try:
                    names.setdefault(name, int(self.view.resolve(name).created_at))
                except UnknownModelError:
                    continue  # a name whose versions are all disabled
        return sorted(names.items())

    def numerics(self, name: str) -> dict[str, object]:
        """What ``name`` serves (for /v1/models): its record's ref, weight format and dtype, and for dtype "auto" the
        choice the fleet's first worker pinned (dtype, reason, source, measured rates, machine); {} for a static or
        unresolvable name."""
        if self.view is None or name in self.static:
            return {}
        try:
            record = self.view.resolve(name)
        except UnknownModelError:
            return {}
        out: dict[str, object] = {"ref": record.ref, "quantization": record.quantization or "none",
                                  "dtype": record.pinned_dtype or "auto (no worker has loaded it yet)"}
        if record.numerics:
            out["dtype_choice"] = json.loads(record.numerics)
        return out

    def route_policy(self, name: str) -> RoutePolicy | None:
        """The routing policy when ``name`` is a routing alias (the model router), else None."""
        if self.view is None or name in self.static:
            return None
        raw = self.view.routes.get(name)
        if raw is None:
            return None
        policy = self._policies.get(raw)
        if policy is None:
            try:
                policy = RoutePolicy.from_json(raw)
            except ValueError:  # the registry validates what it stores; a bad one serves the big model
                log.warning("unreadable route policy", alias=name)
                return None
            if len(self._policies) > 64:  # replaced policies linger until here
                self._policies.clear()
            self._policies[raw] = policy
        return policy

    async def get(self, name: str, sticky: str = "") -> ServedModel:
        """The model ``name`` serves now; ``sticky`` (the conversation's key) picks a side of a canary split."""
        if name in self.static:
            return self.static[name]
        adapter = ""
        try:
            if self.view is None:
                raise UnknownModelError(name)
            try:
                record = self.view.resolve(name, sticky)
                if record.base:  # a registered LoRA adapter: its base's workers serve it, loading it by its ref
                    adapter = record.ref
                    record = self.view.resolve(record.base, sticky)
            except UnknownModelError:
                base, sep, adapter = name.rpartition(":")  # BASE:ADAPTER, a LoRA adapter its workers load
                if not sep or not base or not ADAPTER_RE.match(adapter):
                    raise
                record = self.view.resolve(base, sticky)
        except UnknownModelError as e:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found") from e
        if record.ref not in self._loaded:  # tokenizer loads once per version, off the event loop
            self._loaded[record.ref] = await asyncio.to_thread(
                load_served, name, record.ref, record.tokenizer_path, record.max_model_len, record.tool_format)
        return dataclasses.replace(self._loaded[record.ref], name=name, adapter=adapter)
