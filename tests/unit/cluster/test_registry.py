"""Registry records and resolution rules (pure; no etcd)."""

from __future__ import annotations

import json

import pytest
from tokenfleet.services.registry.convert import record_from_proto, record_to_proto, snapshot_to_proto, view_from_snapshot

from tokenfleet.cluster.etcd import KeyEvent
from tokenfleet.cluster.registry import ModelRecord, RegistryView, UnknownModelError, split_ref


def rec(name: str = "m", version: str = "v1", created: float = 1.0, **kw) -> ModelRecord:
    return ModelRecord(name=name, version=version, path=f"/models/{name}", created_at=created, **kw)


def view_of(*records: ModelRecord, aliases: dict[str, str] | None = None) -> RegistryView:
    listing = {r.key: r.to_json() for r in records}
    listing |= {f"aliases/{a}": json.dumps({"target": t}).encode() for a, t in (aliases or {}).items()}
    view = RegistryView()
    view.reset(listing)
    return view


def test_bare_name_resolves_to_the_newest_ready_version():
    view = view_of(rec(version="v1", created=1), rec(version="v3", created=3), rec(version="v2", created=2))
    assert view.resolve("m").version == "v3"
    assert view.resolve("m@v1").version == "v1"
    disabled = view_of(rec(version="v1", created=1), rec(version="v2", created=2, status="disabled"))
    assert disabled.resolve("m").version == "v1"
    assert disabled.resolve("m@v2").status == "disabled"  # pinned versions stay reachable


def test_aliases_resolve_to_names_or_pinned_versions():
    view = view_of(rec(version="v1", created=1), rec(version="v2", created=2), aliases={"prod": "m@v1", "latest": "m"})
    assert view.resolve("prod").ref == "m@v1"
    assert view.resolve("latest").ref == "m@v2"
    assert view.names() == ["latest", "m", "prod"]


@pytest.mark.parametrize("ref", ["nope", "m@v9", "nope@v1", ""])
def test_unknown_refs_raise(ref):
    with pytest.raises(UnknownModelError):
        view_of(rec()).resolve(ref)


def test_events_update_the_view():
    view = view_of(rec())
    before = view.revision
    view.apply(KeyEvent(rec(version="v2", created=5).key, rec(version="v2", created=5).to_json()))
    assert view.resolve("m").version == "v2" and view.revision > before
    view.apply(KeyEvent("models/m/v2", None))
    assert view.resolve("m").version == "v1"
    view.apply(KeyEvent("aliases/a", json.dumps({"target": "m"}).encode()))
    assert view.resolve("a").ref == "m@v1"
    view.apply(KeyEvent("aliases/a", None))
    with pytest.raises(UnknownModelError):
        view.resolve("a")


def test_partial_reset_keeps_the_other_prefix():
    view = view_of(rec(), aliases={"a": "m"})
    view.reset({}, ("aliases/",))
    assert view.resolve("m") and "a" not in view.aliases


def test_a_gguf_record_runs_with_float32_activations():
    assert ModelRecord(name="m", version="v1", path="/x", quantization="gguf", dtype="float32").quantization == "gguf"


@pytest.mark.parametrize("kwargs, needle", [
    ({"name": "a/b"}, "model name"), ({"name": "a@b"}, "model name"), ({"version": "v 1"}, "version"),
    ({"dtype": "int3"}, "dtype"), ({"status": "gone"}, "status"), ({"path": ""}, "path"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"), ({"quantization": "int4"}, "quantization"),
    ({"quantization": "fp8", "dtype": "float32"}, "float32"), ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
    ({"quantization": "gguf", "backend": "trtllm"}, "torch engine"),
    ({"quantization": "int8", "backend": "trtllm"}, "torch engine"),
])
def test_invalid_records_are_rejected(kwargs, needle):
    fields = {"name": "m", "version": "v1", "path": "/x", **kwargs}
    with pytest.raises(ValueError, match=needle):
        ModelRecord(**fields)


def test_json_and_proto_round_trips_and_unknown_json_fields():
    r = rec(dtype="float32", default_sampling={"temperature": 0.7}, description="d", max_model_len=2048,
            kv_cache_dtype="fp8")
    assert ModelRecord.from_json(r.to_json()) == r
    assert record_from_proto(record_to_proto(r)) == r
    newer = json.loads(r.to_json()) | {"added_later": 1}
    assert ModelRecord.from_json(json.dumps(newer)) == r
    view = view_of(r, aliases={"a": "m@v1"})
    again = view_from_snapshot(snapshot_to_proto(view))
    assert again.models == view.models and again.aliases == view.aliases


def test_same_content_ignores_registration_time():
    assert rec(created=1).same_content(rec(created=2))
    assert not rec().same_content(rec(dtype="float32"))
    assert split_ref("m@v1") == ("m", "v1") and split_ref("m") == ("m", "")


def test_speculative_config_must_be_a_decoding_config():
    import pytest as _pytest

    assert rec(speculative_config='{"decoding_type": "Eagle", "max_draft_len": 4}', backend="trtllm").speculative_config
    assert rec(speculative_config='{"decoding_type": "NGram", "max_draft_len": 4}').speculative_config  # torch
    for bad in ("{not json", '["Eagle"]', '{"max_draft_len": 4}'):
        with _pytest.raises(ValueError, match="speculative_config"):
            rec(speculative_config=bad)
    with _pytest.raises(ValueError, match="passed to TensorRT-LLM"):  # the torch engine speculates with NGram only
        rec(speculative_config='{"decoding_type": "Eagle", "max_draft_len": 4}')


def test_a_canary_split_is_sticky_per_conversation_and_close_to_its_weight():
    from tokenfleet.cluster.registry import canary_bucket

    view = view_of(rec(version="v1", created=1.0), rec(version="v2", created=2.0))
    view.reset({**{r.key: r.to_json() for r in view.models.values()},
                "aliases/prod": json.dumps({"target": "m@v1", "canary": "m@v2", "weight": 0.2}).encode()})
    users = [f"user-{i}" for i in range(2000)]
    picks = {u: view.resolve("prod", u).version for u in users}
    share = sum(v == "v2" for v in picks.values()) / len(users)
    assert 0.17 < share < 0.23
    assert all(view.resolve("prod", u).version == picks[u] for u in users[:200])  # sticky
    assert view.resolve("m@v1", "user-1").version == "v1"  # a pinned ref ignores splits
    # raising the weight only moves conversations onto the canary
    view.reset({"aliases/prod": json.dumps({"target": "m@v1", "canary": "m@v2", "weight": 0.5}).encode()},
               ("aliases/",))
    assert all(view.resolve("prod", u).version == "v2" for u in users if picks[u] == "v2")
    assert all(0.0 <= canary_bucket("prod", u) < 1.0 for u in users[:50])
    view.reset({"aliases/prod": json.dumps({"target": "m@v1"}).encode()}, ("aliases/",))
    assert not view.canaries and {view.resolve("prod", u).version for u in users[:200]} == {"v1"}


def test_a_canary_split_survives_the_registry_snapshot():
    from tokenfleet.services.registry.convert import snapshot_to_proto, view_from_snapshot

    view = view_of(rec(version="v1"), rec(version="v2", created=2.0))
    view.aliases["prod"] = "m@v1"
    view.canaries["prod"] = ("m@v2", 0.25)
    again = view_from_snapshot(snapshot_to_proto(view))
    assert again.aliases == {"prod": "m@v1"} and again.canaries == {"prod": ("m@v2", 0.25)}


def test_a_workers_engine_takes_the_records_quantization_and_kv_cache_dtype():
    from tokenfleet.services.worker.main import engine_config, parse_args

    args = parse_args([], "decode")
    assert engine_config(args, rec(quantization="fp8")).quantization == "fp8"
    assert engine_config(args, rec()).quantization == ""
    assert engine_config(args, rec(kv_cache_dtype="fp8")).kv_cache_dtype == "fp8"
    assert engine_config(args, rec()).kv_cache_dtype == ""
    # the worker's flag wins over the record, both ways
    assert engine_config(parse_args(["--kv-cache-dtype", ""], "decode"), rec(kv_cache_dtype="fp8")).kv_cache_dtype == ""
    assert engine_config(parse_args(["--kv-cache-dtype", "fp8"], "decode"), rec()).kv_cache_dtype == "fp8"
    assert engine_config(parse_args(["--async-scheduling"], "decode"), rec()).async_scheduling
    assert not engine_config(args, rec()).async_scheduling


def test_a_workers_kv_pool_bytes_and_retention_flags_reach_its_engine():
    from tokenfleet.services.worker.main import engine_config, parse_args

    from tokenfleet.cli.launcher import pool_args

    config = engine_config(parse_args([*pool_args(1 << 20), "--kv-retention-max-s", "30",
                                       "--kv-retention-tenant-blocks", "64", "--kv-retention-tier-max-s", "7200"],
                                      "decode"), rec())
    assert config.kv_cache_bytes == 1 << 20 and config.num_kv_blocks(kv_bytes_per_token=1024) == 64  # 16-token blocks
    assert (config.kv_retention_max_s, config.kv_retention_tenant_blocks) == (30.0, 64)
    assert config.kv_retention_tier_max_s == 7200.0
    default = engine_config(parse_args(pool_args(0), "decode"), rec())  # 0: no flag, the engine's default pool
    assert default.kv_cache_bytes == 1 << 30 and default.kv_retention_max_s == 300.0
    assert default.kv_retention_tier_max_s == 86400.0
    assert default.tpot_slo_ms == 100.0  # the ITL guard's TPOT objective (engine.itl_guard)
    assert engine_config(parse_args(["--tpot-slo-ms", "40"], "decode"), rec()).tpot_slo_ms == 40.0
    assert engine_config(parse_args(["--kv-pool-bytes", "4096", "--num-blocks", "7"], "decode"), rec()
                         ).num_kv_blocks(1024) == 7  # --num-blocks wins


def test_routing_aliases_survive_the_view_and_snapshots():
    from tokenfleet.services.registry.convert import snapshot_to_proto, view_from_snapshot

    from tokenfleet.routing.model_router import RoutePolicy

    policy = {"small": "s", "big": "b", "weights": {"bias_one": 1.0}, "threshold": 0.4}
    view = view_of(rec("s"), rec("b"), aliases={"plain": "b"})
    view.reset({**{r.key: r.to_json() for r in (rec("s"), rec("b"))},
                "aliases/auto": json.dumps({"target": "b", "route": policy}).encode(),
                "aliases/plain": json.dumps({"target": "b"}).encode()})
    assert view.resolve("auto").name == "b"  # without a request's features a routing alias means its big model
    assert set(view.routes) == {"auto"} and RoutePolicy.from_json(view.routes["auto"]).threshold == 0.4
    again = view_from_snapshot(snapshot_to_proto(view))
    assert again.routes == view.routes and again.aliases == view.aliases
    view.reset({"aliases/auto": json.dumps({"target": "b"}).encode()}, ("aliases/",))
    assert view.routes == {}  # the route went with the alias's new value


def test_a_pinned_dtype_is_not_part_of_a_records_content():
    pin = json.dumps({"dtype": "bfloat16", "reason": "measured"})
    pinned = rec(numerics=pin)
    assert pinned.pinned_dtype == "bfloat16" and rec().pinned_dtype == "" and rec(dtype="float32").pinned_dtype == \
        "float32"
    assert pinned.same_content(rec())  # registering the same settings again keeps the pin
    assert record_from_proto(record_to_proto(pinned)).numerics == pin
    for bad in ("not json", "{}", json.dumps({"dtype": "auto"}), "[]"):
        with pytest.raises(ValueError, match="numerics"):
            rec(numerics=bad)
