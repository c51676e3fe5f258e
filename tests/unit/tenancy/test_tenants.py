"""Tenants, key format, hashed lookup and the 401 cases."""

from __future__ import annotations

import pytest

from tokenfleet.tenancy.tenants import ApiKey, AuthError, Directory, Tenant, hash_key, key_id_of, new_key


def test_keys_are_random_well_formed_and_stored_only_hashed():
    key, record = new_key("acme", now=5.0)
    other, _ = new_key("acme")
    assert key != other and key.startswith("tfk_") and len(key) == 4 + 8 + 1 + 32
    assert key_id_of(key) == record.key_id and record.key_hash == hash_key(key) and key not in record.to_json().decode()
    assert ApiKey.from_json(record.to_json()) == record


def test_authenticate_missing_unknown_revoked_and_orphaned_keys():
    key, record = new_key("acme")
    directory = Directory({"acme": Tenant("acme")}, {record.key_hash: record})
    assert directory.authenticate(key)[0].name == "acme"
    with pytest.raises(AuthError, match="didn't provide"):
        directory.authenticate(None)
    with pytest.raises(AuthError, match="Incorrect API key"):
        directory.authenticate("sk-not-ours")
    with pytest.raises(AuthError, match=f"key id {record.key_id}"):
        directory.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B"))
    directory.keys[record.key_hash] = ApiKey(record.key_hash, record.key_id, "acme", revoked=True)
    with pytest.raises(AuthError, match="Incorrect API key"):
        directory.authenticate(key)
    directory.keys[record.key_hash] = record
    del directory.tenants["acme"]
    with pytest.raises(AuthError, match="no longer exists"):
        directory.authenticate(key)


def test_tenant_validation_and_allowed_models():
    t = Tenant("acme", "batch", 1000, 10, 2, ("smol",))
    assert t.allows("smol") and not t.allows("other") and Tenant("x").allows("anything")
    assert Tenant.from_json(t.to_json()) == t
    for bad in ({"name": "a/b"}, {"name": "x", "tier": "gold"}, {"name": "x", "tokens_per_minute": -1}):
        with pytest.raises(ValueError):
            Tenant(**bad)


def test_concurrent_editors_of_a_tenants_file_lose_no_change(tmp_path):
    """Two stores opened on one file before either edits (two CLI runs at once): both changes survive,
    and the file is replaced whole (mode 0600: it holds key hashes)."""
    import asyncio
    import stat

    from tokenfleet.tenancy.store import FileTenantStore, load_file

    path = tmp_path / "tenants.yaml"
    first, second = FileTenantStore(path), FileTenantStore(path)
    key = asyncio.run(first.add(Tenant("acme")))
    asyncio.run(second.add(Tenant("globex")))  # opened before acme existed
    assert key is not None
    asyncio.run(second.revoke(key.split("_")[1]))  # revokes acme's key, which it never loaded itself
    directory = load_file(path)
    assert set(directory.tenants) == {"acme", "globex"}
    assert [k.revoked for k in directory.keys.values() if k.tenant == "acme"] == [True]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(tmp_path.glob(".tenants.yaml.*.tmp"))


def test_pins_map_names_to_refs_and_survive_json():
    import json

    t = Tenant("acme", pins={"bot": "bot@v3", "m": "m@v1"})
    assert t.pinned("bot") == "bot@v3" and t.pinned("other") == "other"
    assert Tenant.from_json(t.to_json()) == t
    assert json.loads(t.to_json())["pins"] == {"bot": "bot@v3", "m": "m@v1"}
    with pytest.raises(ValueError, match="pin"):
        Tenant("acme", pins={"bot@v1": "bot@v2"})
