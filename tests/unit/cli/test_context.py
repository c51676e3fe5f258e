"""The cluster a command talks to: its flags over the running `tokenfleet up` cluster's state file."""

from __future__ import annotations

import json

import pytest

from tokenfleet.cli.context import cluster_context, state_file
from tokenfleet.security.identity import IdentityError


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """A state file as `tokenfleet up --insecure` writes it."""
    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", str(tmp_path))
    state = {"registry": "127.0.0.1:5001", "etcd": "http://127.0.0.1:2379", "certs": "", "insecure": True}
    state_file().write_text(json.dumps(state))
    return state


def test_the_running_cluster_fills_in_what_the_flags_leave_out(recorded):
    context = cluster_context()
    assert (context.require_registry(), context.require_etcd()) == ("127.0.0.1:5001", "http://127.0.0.1:2379")
    assert context.plane.identity is None  # the recorded cluster is plaintext
    assert cluster_context(registry="r:1", etcd="https://e:2", insecure=True).require_etcd() == "https://e:2"
    assert cluster_context(registry="r:1").require_registry() == "r:1"


def test_no_cluster_and_no_flag_names_the_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", str(tmp_path))
    context = cluster_context()
    with pytest.raises(ConnectionError, match="no --registry given"):
        context.require_registry()
    with pytest.raises(ConnectionError, match="no --etcd or --file given"):
        context.require_etcd("--etcd or --file")


def test_etcd_sees_no_certificate_over_http_or_a_plaintext_plane(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", str(tmp_path))
    missing = str(tmp_path / "no-certs")  # reading these would fail: neither case reads them
    assert cluster_context(etcd="http://e:2379", certs=missing).etcd_identity() is None
    assert cluster_context(etcd="https://e:2379", certs=missing, insecure=True).etcd_identity() is None
    with pytest.raises(IdentityError, match="certificate files"):
        cluster_context(etcd="https://e:2379", certs=missing).etcd_identity()
