"""Mutual TLS between daemons (``security.mode: mtls``): the gRPC credentials, the bulk path's
TLS contexts, and who a peer's certificate says it is.

Every daemon holds the cluster's CA, its own certificate and key (``decentctl certs``). Both
ends of every connection present a certificate the CA signed; the callee of a handshake reads
the caller's ``decent://<cluster_id>/rank/<n>`` URI SAN and refuses a certificate that names
another rank or cluster, and the caller checks the callee's certificate against the address it
dialed (its IP or DNS SAN). TLS comes from Python's :mod:`ssl` and gRPC's own stack.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from decentd.security.certs import identity_of


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"security.{what}: cannot read {path}: {exc.strerror}") from None


def identity_in_pem(pem: bytes) -> tuple[str, int] | None:
    """(cluster id, rank) that a PEM certificate names (None: none, or not a certificate)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    return identity_of(cert.public_bytes(serialization.Encoding.DER))


def peer_identity(auth_context: Mapping[str, Iterable[bytes]]) -> tuple[str, int] | None:
    """(cluster id, rank) of a gRPC caller's client certificate (None without one)."""
    pems = list(auth_context.get("x509_pem_cert") or [])
    return identity_in_pem(pems[0]) if pems else None


@dataclass(frozen=True)
class Tls:
    """One daemon's TLS material."""

    ca_path: str
    cert_path: str
    key_path: str
    ca: bytes
    cert: bytes
    key: bytes
    #: TLS on the bulk data connections too (else an HMAC binds them to the handshake)
    encrypt_bulk: bool

    @classmethod
    def load(cls, ca: str, cert: str, key: str, encrypt_bulk: bool) -> Tls:
        """Read the files; ValueError says which one is wrong and why."""
        tls = cls(ca, cert, key, _read(ca, "ca"), _read(cert, "cert"), _read(key, "key"),
                  encrypt_bulk)
        if Path(key).stat().st_mode & 0o077:
            raise ValueError(f"security.key: {key} is readable by others; chmod 600 it")
        tls.server_context()  # the files must make a context: say so at start, not later
        return tls

    def identity(self) -> tuple[str, int] | None:
        """(cluster id, rank) this daemon's own certificate names."""
        return identity_in_pem(self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        """The peer gRPC service's credentials: callers must present a certificate."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Our credentials when we call a peer."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=self.ca_path)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.cert_path, self.key_path)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """The bulk listener's context (TLS 1.3, client certificates required)."""
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        """Our bulk connections' context (TLS 1.3; the peer's certificate must match the
        address we dial)."""
        return self._context(ssl.Purpose.SERVER_AUTH)
