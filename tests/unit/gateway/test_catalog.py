"""The gateway's model catalog resolves an alias's canary split with the conversation's key: the same key, the
same version; the served name stays the alias the client asked for."""

from __future__ import annotations

import asyncio
import json

from tokenfleet.services.gateway.catalog import ModelCatalog

from tokenfleet.cluster.registry import ModelRecord, RegistryView


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
