"""ModelRecord <-> registry.proto messages (shared by the service, workers, gateways and the CLI)."""

from __future__ import annotations

from tokenfleet.cluster.registry import ModelRecord, RegistryView
from tokenfleet.v1 import registry_pb2

_STATUS = {"ready": registry_pb2.MODEL_STATUS_READY, "disabled": registry_pb2.MODEL_STATUS_DISABLED}
_STATUS_NAME = {v: k for k, v in _STATUS.items()}


def status_name(status: int) -> str:
    if status not in _STATUS_NAME:
        raise ValueError(f"model status must be READY or DISABLED, got {status}")
    return _STATUS_NAME[status]


def record_to_proto(r: ModelRecord) -> registry_pb2.ModelRecord:
    return registry_pb2.ModelRecord(
        name=r.name, version=r.version, path=r.path, architecture=r.architecture, dtype=r.dtype,
        quantization=r.quantization, backend=r.backend, tensor_parallel_size=r.tensor_parallel_size,
        tokenizer=r.tokenizer, max_model_len=r.max_model_len, default_sampling=r.default_sampling,
        status=_STATUS[r.status], created_at=r.created_at, description=r.description,
        tool_format=r.tool_format, speculative_config=r.speculative_config, base=r.base,
        kv_cache_dtype=r.kv_cache_dtype, numerics=r.numerics,
    )


def record_from_proto(m: registry_pb2.ModelRecord) -> ModelRecord:
    """Unset fields take the record's defaults; invalid values raise ValueError."""
    return ModelRecord(
        name=m.name, version=m.version, path=m.path, architecture=m.architecture or "llama",
        dtype=m.dtype or "auto", quantization=m.quantization, backend=m.backend or "torch",
        tensor_parallel_size=m.tensor_parallel_size or 1, tokenizer=m.tokenizer, max_model_len=m.max_model_len,
        default_sampling=dict(m.default_sampling),
        status=status_name(m.status) if m.status else "ready", created_at=m.created_at, description=m.description,
        tool_format=m.tool_format, speculative_config=m.speculative_config, base=m.base,
        kv_cache_dtype=m.kv_cache_dtype, numerics=m.numerics,
    )


def snapshot_to_proto(view: RegistryView) -> registry_pb2.RegistrySnapshot:
    records = sorted(view.models.values(), key=lambda r: (r.name, r.created_at, r.version))
    return registry_pb2.RegistrySnapshot(
        models=[record_to_proto(r) for r in records],
        aliases=[registry_pb2.Alias(alias=a, target=t, canary=view.canaries.get(a, ("", 0.0))[0],
                                    canary_weight=view.canaries.get(a, ("", 0.0))[1], route=view.routes.get(a, ""))
                 for a, t in sorted(view.aliases.items())],
    )


def view_from_snapshot(snapshot: registry_pb2.RegistrySnapshot) -> RegistryView:
    view = RegistryView()
    for m in snapshot.models:
        record = record_from_proto(m)
        view.models[(record.name, record.version)] = record
    view.aliases = {a.alias: a.target for a in snapshot.aliases}
    view.canaries = {a.alias: (a.canary, a.canary_weight) for a in snapshot.aliases if a.canary}
    view.routes = {a.alias: a.route for a in snapshot.aliases if a.route}
    return view
