"""Certificates per role (``tokenfleet certs``) and a process's identity: loading, rotation, expiry."""

from __future__ import annotations

import shutil
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from structlog.testing import capture_logs

from tokenfleet.security import certs
from tokenfleet.security.identity import Identity, IdentityError


@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "certs"
    certs.ensure(out)
    return out


def test_ensure_writes_a_ca_and_one_certificate_per_role_naming_it(folder):
    for role in certs.ROLES:
        cert = x509.load_pem_x509_certificate((folder / f"{role}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert certs.peer_name(role) in names.get_values_for_type(x509.DNSName)
        assert stat.S_IMODE((folder / f"{role}.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "ca.key").stat().st_mode) == 0o600
    assert certs.ensure(folder) == []  # nothing missing: nothing rewritten


def test_issue_refuses_an_unknown_role_and_a_folder_without_a_ca(folder, tmp_path):
    with pytest.raises(ValueError, match="unknown role"):
        certs.issue(folder, "root")
    with pytest.raises(FileNotFoundError, match="no CA"):
        certs.issue(tmp_path / "empty", "worker")


def test_identity_loads_and_refuses_inconsistent_sets(folder, tmp_path):
    identity = Identity(folder, "worker")
    assert identity.material.role == "worker" and identity.material.generation == 0
    with pytest.raises(IdentityError, match="not 'router'"):
        Identity(folder, "router", name="worker")  # the worker's files presented as the router's
    mixed = tmp_path / "mixed"
    shutil.copytree(folder, mixed)
    (mixed / "worker.key").write_bytes((folder / "gateway.key").read_bytes())
    with pytest.raises(IdentityError, match="does not belong"):
        Identity(mixed, "worker")
    other = tmp_path / "other"
    certs.ensure(other)
    shutil.copy(other / "worker.pem", mixed / "worker.pem")
    shutil.copy(other / "worker.key", mixed / "worker.key")
    with pytest.raises(IdentityError, match="not issued by the CA"):
        Identity(mixed, "worker")
    with pytest.raises(IdentityError, match="tokenfleet certs"):
        Identity(tmp_path / "nowhere", "worker")


def test_a_rotated_certificate_is_picked_up_and_a_torn_rotation_keeps_the_old_one(folder, tmp_path):
    identity = Identity(folder, "worker", poll_seconds=0)
    first = identity.material
    certs.issue(folder, "worker")
    second = identity.current()
    assert second.generation == first.generation + 1 and second.serial != first.serial
    # Half a rotation: a new key next to the old certificate. Kept: the last good material.
    spare = tmp_path / "spare"
    certs.ensure(spare, roles=("worker",))
    (folder / "worker.key").write_bytes((spare / "worker.key").read_bytes())
    with capture_logs() as logs:
        assert identity.current() is second
    assert any("not usable" in entry["event"] for entry in logs)
    certs.issue(folder, "worker")  # the rotation completes
    assert identity.current().generation == second.generation + 1


def test_expiry_is_warned_about_ahead_of_time(folder):
    certs.issue(folder, "router", days=3)
    with capture_logs() as logs:
        identity = Identity(folder, "router", warn_days=30)
    warning = next(entry for entry in logs if entry["event"] == "certificate expires soon")
    assert warning["log_level"] == "warning" and 2.9 < warning["days_left"] <= 3.0
    gauge = identity._expiry.labels(role="router")._value.get()
    assert 2.9 * 86400 < gauge <= 3 * 86400
    with capture_logs() as logs:
        Identity(folder, "gateway", warn_days=30)  # a year left: no warning
    assert not [entry for entry in logs if "expire" in entry["event"]]
