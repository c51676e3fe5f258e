"""This process's certificate: read from files, re-read when they change, warned about before it expires.

``Identity.current()`` stats the three files (CA, certificate, key) at most once a second and, when
one changed, loads them again, but only a consistent set: the certificate must parse, match the
key and chain to the CA in the folder. A half-written or mismatched set keeps the previous
material (and is retried), so a rotation in progress never breaks the service. Each accepted load
bumps ``generation``: servers hand the new material to the next handshake (``grpc``'s dynamic
server credentials), client channel pools rebuild their channels (``plane.Channels``).

Expiry: each load (and ``watch``, hourly) logs a warning when the certificate expires within
``warn_days`` and sets the ``tokenfleet_tls_certificate_expiry_seconds`` gauge.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenfleet.security.certs import CertPaths

log = structlog.get_logger()
DEFAULT_WARN_DAYS = 30.0


@dataclass(frozen=True)
class Material:
    ca: bytes
    cert: bytes
    key: bytes
    role: str  # the certificate's CN
    serial: int
    not_after: datetime.datetime
    generation: int

    def seconds_left(self) -> float:
        return (self.not_after - datetime.datetime.now(datetime.UTC)).total_seconds()


class IdentityError(ValueError):
    """The certificate files are missing or do not form a usable set."""


def _check(ca: bytes, cert_pem: bytes, key_pem: bytes, expected_role: str) -> tuple[str, int, datetime.datetime]:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca_cert = x509.load_pem_x509_certificate(ca)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as e:
        raise IdentityError(f"unreadable certificate, key or CA: {e}") from e
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        raise IdentityError("the key does not belong to the certificate")
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (InvalidSignature, ValueError, TypeError) as e:
        raise IdentityError(f"the certificate was not issued by the CA in the folder: {e}") from e
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    role = str(cn[0].value) if cn else ""
    if role != expected_role:
        raise IdentityError(f"the certificate is {role!r}'s, not {expected_role!r}'s")
    return role, cert.serial_number, cert.not_valid_after_utc


class Identity:
    """``folder``/ca.pem and ``folder``/<name>.pem/.key, for a process of ``role``."""

    def __init__(self, folder: Path, role: str, name: str | None = None, warn_days: float = DEFAULT_WARN_DAYS,
                 registry: CollectorRegistry | None = None, poll_seconds: float = 1.0):
        self.folder = Path(folder)
        self.role = role
        self.paths = CertPaths.of(self.folder, name or role)
        self.ca_path = self.folder / "ca.pem"
        self.warn_days = warn_days
        self.poll_seconds = poll_seconds
        self._lock = threading.Lock()  # grpc calls the server's fetcher from its own threads
        self._stamp: tuple[float, ...] = ()
        self._checked = 0.0
        registry = registry if registry is not None else CollectorRegistry()  # a private one: never exported
        self._expiry = Gauge("tokenfleet_tls_certificate_expiry_seconds",
                             "Seconds until this process's internal-plane certificate expires", ["role"],
                             registry=registry)
        self._reloads = Counter("tokenfleet_tls_certificate_reloads_total",
                                "Certificate files re-read after they changed", ["role"], registry=registry)
        self.material = self._load(generation=0)  # IdentityError if the files are not usable now

    def _stamps(self) -> tuple[float, ...]:
        return tuple(p.stat().st_mtime_ns for p in (self.ca_path, self.paths.cert, self.paths.key))

    def _load(self, generation: int) -> Material:
        try:
            stamp = self._stamps()
            ca, cert, key = self.ca_path.read_bytes(), self.paths.cert.read_bytes(), self.paths.key.read_bytes()
        except OSError as e:
            raise IdentityError(f"certificate files for {self.role!r} in {self.folder}: {e}; `tokenfleet certs "
                                f"--out {self.folder}` creates them (or run with --insecure, plaintext)") from e
        role, serial, not_after = _check(ca, cert, key, self.role)
        self._stamp = stamp
        material = Material(ca, cert, key, role, serial, not_after, generation)
        self.warn_if_expiring(material)  # and sets the expiry gauge
        return material

    def current(self) -> Material:
        """The material to use now, re-read first if a file changed (checked at most every ``poll_seconds``)."""
        now = time.monotonic()
        if now - self._checked < self.poll_seconds:
            return self.material
        with self._lock:
            self._checked = now
            try:
                if self._stamps() == self._stamp:
                    return self.material
                material = self._load(self.material.generation + 1)
            except (IdentityError, OSError) as e:
                log.warning("certificate files changed but are not usable (yet); keeping the loaded ones",
                            role=self.role, folder=str(self.folder), error=str(e))
                return self.material
            self.material = material
            self._reloads.labels(role=self.role).inc()
            log.info("certificate reloaded", role=self.role, serial=f"{material.serial:x}",
                     not_after=material.not_after.isoformat())
            return material

    def warn_if_expiring(self, material: Material | None = None) -> None:
        material = material or self.material
        left = material.seconds_left()
        self._expiry.labels(role=self.role).set(left)
        if left < self.warn_days * 86400:
            log.warning("certificate expires soon" if left > 0 else "certificate has expired", role=self.role,
                        path=str(self.paths.cert), not_after=material.not_after.isoformat(),
                        days_left=round(left / 86400, 1))

    # ---- gRPC credentials --------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS for a server: clients must present a certificate from the folder's CA. A new
        handshake after the files changed uses the new material, without a restart."""
        served = [self.material.generation]

        def config(material: Material) -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration([(material.key, material.cert)],
                                                             root_certificates=material.ca)

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            material = self.current()
            if material.generation == served[0]:
                return None  # unchanged
            served[0] = material.generation
            return config(material)

        return grpc.dynamic_ssl_server_credentials(config(self.material), fetch, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        material = self.current()
        return grpc.ssl_channel_credentials(root_certificates=material.ca, private_key=material.key,
                                            certificate_chain=material.cert)

    async def watch(self, interval: float = 5.0, warn_every: float = 3600.0) -> None:
        """Re-read changed files every ``interval`` even when nothing connects, and repeat the expiry
        warning every ``warn_every`` seconds. Runs until cancelled."""
        warned = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            self.current()
            if time.monotonic() - warned >= warn_every:
                warned = time.monotonic()
                self.warn_if_expiring()
