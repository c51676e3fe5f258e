"""The gateway's model catalog resolves an alias's canary split with the conversation's key: the same key, the
same version; the served name stays the alias the client asked for."""

from __future__ import annotations

import asyncio
import json

from tokenfleet.services.gateway.catalog import ModelCatalog

from tokenfleet.cluster.registry import ModelRecord, RegistryView
from tokenfleet.tenancy.tenants import Tenant


def test_the_catalog_picks_a_canary_side_per_conversation(default_model_dir):
    records = [ModelRecord(name="m", version=v, path=str(default_model_dir), created_at=t) for v, t in (("v1", 1), ("v2", 2))]
    view = RegistryView()
    view.reset({**{r.key: r.to_json() for r in records},
                "aliases/prod": json.dumps({"target": "m@v1", "canary": "m@v2", "weight": 0.5}).encode()})
    catalog = ModelCatalog(view=view, synced=True)

    async def refs(keys):
        return [(await catalog.get("prod", k)).ref for k in keys]

    keys = [f"conversation-{i}" for i in range(40)]
    first, again = asyncio.run(refs(keys)), asyncio.run(refs(keys))
    assert first == again and set(first) == {"m@v1", "m@v2"}
    assert asyncio.run(catalog.get("prod", "x")).name == "prod"


def test_a_registered_adapter_is_served_by_its_base_with_its_ref_as_the_adapter(default_model_dir):
    base = ModelRecord(name="m", version="v1", path=str(default_model_dir), created_at=1)
    bots = [ModelRecord(name="bot", version=v, path=f"/adapters/{v}", base="m", created_at=t) for v, t in (("v1", 2), ("v2", 3))]
    view = RegistryView()
    view.reset({r.key: r.to_json() for r in (base, *bots)})
    catalog = ModelCatalog(view=view, synced=True)
    served = asyncio.run(catalog.get("bot"))
    assert (served.ref, served.adapter, served.name) == ("m@v1", "bot@v2", "bot")  # the newest adapter version
    assert asyncio.run(catalog.get("bot@v1")).adapter == "bot@v1"
    assert asyncio.run(catalog.get("m")).adapter == ""


def test_a_tenants_pin_picks_the_version_before_anything_else(default_model_dir):
    from tokenfleet.services.gateway.pipeline import Gateway

    from tokenfleet.api.openai_schema import ChatCompletionRequest

    records = [ModelRecord(name="m", version=v, path=str(default_model_dir), created_at=t) for v, t in (("v1", 1), ("v2", 2))]
    view = RegistryView()
    view.reset({r.key: r.to_json() for r in records})
    gateway = Gateway([], ModelCatalog(view=view, synced=True))
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert asyncio.run(gateway.prepare_chat(body, Tenant("t"))).model.ref == "m@v2"
    pinned = asyncio.run(gateway.prepare_chat(body, Tenant("t", pins={"m": "m@v1"})))
    assert pinned.model.ref == "m@v1" and pinned.requested_model == "m"  # the ledger names both


def test_models_say_what_dtype_serves_them_and_why(default_model_dir):
    from tokenfleet.models.auto_dtype import DtypeChoice

    pin = DtypeChoice("bfloat16", "AVX512-BF16: bf16 matmul 3.7x", "measured", {"bf16@64": 700.0}, "Xeon").to_json()
    records = [ModelRecord(name="auto", version="v1", path=str(default_model_dir), numerics=pin),
               ModelRecord(name="fresh", version="v1", path=str(default_model_dir)),
               ModelRecord(name="own", version="v1", path=str(default_model_dir), dtype="float32", quantization="int8")]
    view = RegistryView()
    view.reset({**{r.key: r.to_json() for r in records}, "aliases/prod": json.dumps({"target": "auto"}).encode()})
    catalog = ModelCatalog(view=view, synced=True)
    served = catalog.numerics("prod")
    assert (served["ref"], served["dtype"], served["quantization"]) == ("auto@v1", "bfloat16", "none")
    assert served["dtype_choice"]["rates"] == {"bf16@64": 700.0} and served["dtype_choice"]["machine"] == "Xeon"
    assert catalog.numerics("fresh")["dtype"].startswith("auto (no worker")
    assert catalog.numerics("own") == {"ref": "own@v1", "quantization": "int8", "dtype": "float32"}
    assert catalog.numerics("nope") == {}
