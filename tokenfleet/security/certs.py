"""A local certificate authority and one certificate per role: what ``tokenfleet certs`` writes.

A certs folder holds ``ca.pem`` / ``ca.key`` and, per role, ``<role>.pem`` / ``<role>.key``. Each
role certificate says its role twice: subject ``CN=<role>`` (what a server reads to authorize its
caller, ``authz``) and the DNS name ``<role>.tokenfleet`` (what a client checks the server's
certificate against, so a gateway talks only to a real router, a decode worker pulls KV only from
a real worker). The hosts given are added as further names (loopback and the compose service
names by default) for tools that verify by address, such as etcd's own clients. Every role
certificate serves both sides of TLS (serverAuth and clientAuth): each service is a client too.

Keys are ECDSA P-256 (fast to create and to handshake), written with mode 0600 in a 0700 folder;
files are replaced atomically, key before certificate, so a process re-reading them never sees a
torn file (and ``identity`` refuses a certificate whose key does not match yet).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tokenfleet.files import write_atomically

# Services and people: gateway, router, registry, worker (both engine roles), operator (people and
# the CLI/launcher), autoscaler; etcd is the server certificate of the etcd cluster.
ROLES = ("gateway", "router", "registry", "worker", "operator", "autoscaler", "etcd")
NAME_SUFFIX = ".tokenfleet"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1", "etcd", "registry", "router", "gateway", "decode", "prefill")
DEFAULT_DAYS = 365
CA_DAYS = 3650
ORGANIZATION = "tokenfleet"


def peer_name(role: str) -> str:
    """The DNS name every certificate of ``role`` carries, and that clients of ``role`` verify."""
    return f"{role}{NAME_SUFFIX}"


@dataclass(frozen=True)
class CertPaths:
    cert: Path
    key: Path

    @classmethod
    def of(cls, folder: Path, name: str) -> CertPaths:
        return cls(folder / f"{name}.pem", folder / f"{name}.key")

    def exist(self) -> bool:
        return self.cert.exists() and self.key.exists()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _save(paths: CertPaths, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    write_atomically(paths.key, _key_pem(key), 0o600)
    write_atomically(paths.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _folder(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    return out


def create_ca(out: Path, name: str = "tokenfleet local CA", days: int = CA_DAYS) -> CertPaths:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    paths = CertPaths.of(_folder(out), "ca")
    _save(paths, key, cert)
    return paths


def _load_ca(out: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    paths = CertPaths.of(out, "ca")
    if not paths.exist():
        raise FileNotFoundError(f"no CA in {out} (ca.pem, ca.key): `tokenfleet certs --out {out}` creates one")
    key = serialization.load_pem_private_key(paths.key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{paths.key}: not an EC key")
    return key, x509.load_pem_x509_certificate(paths.cert.read_bytes())


def _san(role: str, hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName(peer_name(role))]
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(out: Path, role: str, hosts: Sequence[str] = DEFAULT_HOSTS, days: float = DEFAULT_DAYS,
          name: str | None = None) -> CertPaths:
    """(Re)issue ``role``'s certificate, signed by the folder's CA; written as ``<name>.pem/.key``
    (``name`` defaults to the role). Replacing the files of a running service rotates its
    certificate: it re-reads them (``identity``)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    ca_key, ca_cert = _load_ca(out)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                         x509.NameAttribute(NameOID.COMMON_NAME, role)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(not_after)
            .add_extension(_san(role, hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, data_encipherment=False,
                                         key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = CertPaths.of(_folder(out), name or role)
    _save(paths, key, cert)
    return paths


def ensure(out: Path, roles: Sequence[str] = ROLES, hosts: Sequence[str] = DEFAULT_HOSTS,
           days: float = DEFAULT_DAYS) -> list[str]:
    """A CA and every role's certificate in ``out``, creating only what is missing. Returns what it created."""
    created = []
    if not CertPaths.of(out, "ca").exist():
        create_ca(out)
        created.append("ca")
    for role in roles:
        if not CertPaths.of(out, role).exist():
            issue(out, role, hosts, days)
            created.append(role)
    return created


def describe(path: Path) -> tuple[str, int, datetime.datetime]:
    """(subject CN, serial number, expiry) of a certificate file."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return (str(cn[0].value) if cn else "", cert.serial_number, cert.not_valid_after_utc)
