"""A worker's replica id, advertised address and tier folder, derived from its container when asked
(services/worker/identity.py): `hostname`, `auto`, `{replica}`; explicit values used as written."""

from __future__ import annotations

import socket

import pytest
from tokenfleet.services.worker import identity
from tokenfleet.services.worker.identity import derive_identity, expand_kv_tier, worker_identity
from tokenfleet.services.worker.main import parse_args


def resolve_to(ip: str, asked: list[str] | None = None):
    def resolve(name: str) -> str:
        if asked is not None:
            asked.append(name)
        return ip

    return resolve


def must_not_resolve(name: str) -> str:
    raise AssertionError(f"resolved {name!r}: only `auto` resolves")


def test_replica_id_hostname_is_the_host_name() -> None:
    assert derive_identity("hostname", None, "0.0.0.0:50061", "3f2a9c1b7e4d", must_not_resolve) == (
        "3f2a9c1b7e4d", "0.0.0.0:50061")


def test_advertise_hostname_is_the_host_name_with_the_given_port() -> None:
    assert derive_identity(None, "hostname:50061", "0.0.0.0:50061", "3f2a9c1b7e4d", must_not_resolve) == (
        "3f2a9c1b7e4d-50061", "3f2a9c1b7e4d:50061")


def test_advertise_auto_is_the_address_the_host_name_resolves_to() -> None:
    asked: list[str] = []
    replica_id, address = derive_identity("hostname", "auto:50061", "0.0.0.0:50061", "3f2a9c1b7e4d",
                                          resolve_to("172.18.0.7", asked))
    assert (replica_id, address) == ("3f2a9c1b7e4d", "172.18.0.7:50061")
    assert asked == ["3f2a9c1b7e4d"]


@pytest.mark.parametrize(("replica_id", "advertise"), [
    ("decode-1", "decode-1:50061"),
    ("autoscaled-7", "autoscaler:50061"),  # names that merely start like the keywords
    ("hostnames", "hostname.example:50061"),
    ("w", "10.0.0.4:50061"),
])
def test_explicit_values_are_used_as_written(replica_id: str, advertise: str) -> None:
    assert derive_identity(replica_id, advertise, "0.0.0.0:50061", "box", must_not_resolve) == (replica_id, advertise)


def test_without_flags_the_bound_address_and_hostname_port() -> None:
    assert derive_identity(None, None, "127.0.0.1:41234", "box", must_not_resolve) == ("box-41234", "127.0.0.1:41234")
    assert derive_identity(None, "", "127.0.0.1:41234", "box", must_not_resolve) == ("box-41234", "127.0.0.1:41234")


@pytest.mark.parametrize("loopback", ["127.0.0.1", "127.0.1.1", "::1"])
def test_auto_refuses_a_loopback_address(loopback: str) -> None:
    with pytest.raises(ValueError, match=r"resolves to .*loopback.*pass --advertise-address HOST:50061"):
        derive_identity("hostname", "auto:50061", "0.0.0.0:50061", "box", resolve_to(loopback))


def test_auto_refuses_a_name_that_does_not_resolve() -> None:
    def fail(name: str) -> str:
        raise socket.gaierror(-2, "Name or service not known")

    with pytest.raises(ValueError, match=r"'box' does not resolve .*pass --advertise-address HOST:50061"):
        derive_identity(None, "auto:50061", "0.0.0.0:50061", "box", fail)


@pytest.mark.parametrize("advertise", ["auto", "auto:", "hostname:port"])
def test_the_keywords_need_a_port(advertise: str) -> None:
    with pytest.raises(ValueError, match=r":PORT"):
        derive_identity(None, advertise, "0.0.0.0:50061", "box", resolve_to("10.0.0.2"))


def test_worker_identity_exits_2_and_says_what_to_pass(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(identity.socket, "gethostname", lambda: "box")
    monkeypatch.setattr(identity.socket, "gethostbyname", resolve_to("127.0.1.1"))
    with pytest.raises(SystemExit) as exited:
        worker_identity("hostname", "auto:50061", "0.0.0.0:50061")
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert "127.0.1.1" in stderr and "loopback" in stderr and "--advertise-address HOST:50061" in stderr
    monkeypatch.setattr(identity.socket, "gethostbyname", resolve_to("172.18.0.9"))
    assert worker_identity("hostname", "auto:50061", "0.0.0.0:50061") == ("box", "172.18.0.9:50061")


def test_kv_tier_takes_the_replica_id() -> None:
    assert expand_kv_tier("disk:/cache/kv-tier/{replica}", "hostname", "3f2a9c1b7e4d") == "disk:/cache/kv-tier/3f2a9c1b7e4d"
    assert expand_kv_tier("disk:/cache/kv-tier/{replica}", "decode-1", "box") == "disk:/cache/kv-tier/decode-1"
    assert expand_kv_tier("disk:/cache/kv-tier/prefill-1", None, "box") == "disk:/cache/kv-tier/prefill-1"
    assert expand_kv_tier("memory", None, "box") == "memory"
    assert expand_kv_tier("", None, "box") == ""


def test_kv_tier_replica_field_needs_a_replica_id() -> None:
    with pytest.raises(ValueError, match=r"\{replica\} needs --replica-id"):
        expand_kv_tier("disk:/cache/kv-tier/{replica}", None, "box")


def test_the_worker_parser_expands_the_tier_or_exits_2(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    args = parse_args(["--replica-id", "hostname", "--kv-tier", f"disk:{tmp_path}/{{replica}}"], default_role="decode")
    assert args.kv_tier == f"disk:{tmp_path}/{socket.gethostname()}"
    assert args.replica_id == "hostname"  # resolved with the address, once bound
    with pytest.raises(SystemExit) as exited:
        parse_args(["--kv-tier", f"disk:{tmp_path}/{{replica}}"], default_role="decode")
    assert exited.value.code == 2
    assert "{replica} needs --replica-id" in capsys.readouterr().err
