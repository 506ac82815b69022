"""Certificates for mutual TLS between daemons (``decentctl certs``).

One private CA per cluster signs one certificate per daemon. A node certificate serves both
ends of a link (serverAuth and clientAuth) and names its owner in a URI SAN,
``decent://<cluster_id>/rank/<rank>`` (the cluster id percent-encoded), which
:func:`identity_of` reads back from the peer's certificate after a handshake. Keys are EC
P-256, signatures SHA-256, all made by the ``cryptography`` package.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: the default of ``NodeConfig.cluster_id`` in daemon/service/config.py
DEFAULT_CLUSTER_ID = "decent"
#: slack for clocks that run behind: certificates are valid from this long before issuance
CLOCK_SKEW = dt.timedelta(minutes=5)

_URI = re.compile(r"decent://([A-Za-z0-9._~%-]+)/rank/(0|[1-9][0-9]{0,8})")
_DNS = re.compile(r"(\*\.)?[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?"
                  r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?")
_NODE_FILE = re.compile(r"node-(0|[1-9][0-9]*)\.(crt|key)")
_LOOPBACK: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]


class CertError(ValueError):
    """Arguments that cannot make a valid set of certificates."""


@dataclass(frozen=True)
class Issued:
    """A private key and the certificate for it."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def rank_uri(cluster_id: str, rank: int) -> str:
    """The URI SAN naming ``rank`` of ``cluster_id``: ``decent://<cluster_id>/rank/<rank>``."""
    if not cluster_id:
        raise CertError("the cluster id is empty")
    if rank < 0:
        raise CertError(f"rank {rank} is negative")
    return f"decent://{quote(cluster_id, safe='')}/rank/{rank}"


def identity_of(cert_der: bytes) -> tuple[str, int] | None:
    """``(cluster_id, rank)`` from a DER certificate's ``decent://`` URI SAN; None when the
    certificate does not parse or has no such URI, more than one, or a malformed one."""
    try:
        cert = x509.load_der_x509_certificate(cert_der)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound, x509.DuplicateExtension,
            x509.UnsupportedGeneralNameType):
        return None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u[:7].lower() == "decent:"]
    match = _URI.fullmatch(uris[0]) if len(uris) == 1 else None
    if match is None:
        return None
    try:
        cluster_id = unquote(match[1], errors="strict")
    except UnicodeDecodeError:
        return None
    if not cluster_id or quote(cluster_id, safe="") != match[1]:
        return None  # only the one spelling rank_uri writes
    return cluster_id, int(match[2])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_usage(*allowed: str) -> x509.KeyUsage:
    fields = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
              "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{f: f in allowed for f in fields})


def _validity(builder: x509.CertificateBuilder, days: int,
              now: dt.datetime | None) -> x509.CertificateBuilder:
    start = now or dt.datetime.now(dt.UTC)
    return (builder.not_valid_before(start - CLOCK_SKEW)
            .not_valid_after(start + dt.timedelta(days=days))
            .serial_number(x509.random_serial_number()))


def new_ca(cluster_id: str, days: int, now: dt.datetime | None = None) -> Issued:
    """A self-signed CA for ``cluster_id``, valid ``days`` from ``now`` (default: the clock)."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"decent CA {cluster_id}"[:64])])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(_key_usage("key_cert_sign", "crl_sign"), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False))
    return Issued(key, _validity(builder, days, now).sign(key, hashes.SHA256()))


def node_names(cluster_id: str, rank: int, host: str | None = None,
               dns_pattern: str | None = None) -> list[x509.GeneralName]:
    """The SANs of ``rank``'s certificate: its URI, ``dns_pattern`` formatted with ``i=rank``,
    ``host`` (an IP address or a DNS name), then ``localhost`` and 127.0.0.1, without repeats."""
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(rank_uri(cluster_id, rank))]
    if dns_pattern:
        try:
            names.append(_dns(dns_pattern.format(i=rank)))
        except (KeyError, IndexError, ValueError) as exc:
            raise CertError(f"bad --dns-pattern {dns_pattern!r}: use {{i}} for the rank "
                            f"({exc})") from exc
    if host:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(_dns(host))
    names += _LOOPBACK
    return [n for i, n in enumerate(names) if n not in names[:i]]


def _dns(name: str) -> x509.DNSName:
    if not name.isascii() or len(name) > 253 or not _DNS.fullmatch(name):
        raise CertError(f"{name!r} is neither an IP address nor a DNS name")
    return x509.DNSName(name)


def new_node(ca: Issued, rank: int, names: Sequence[x509.GeneralName], days: int,
             now: dt.datetime | None = None) -> Issued:
    """A certificate for ``rank`` signed by ``ca``: CN ``decent rank <rank>``, SANs ``names``,
    for both ends of a TLS link."""
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"decent rank {rank}")])
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.cert.subject)
               .public_key(key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_key_usage("digital_signature"), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False)
               .add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                   ca_ski), critical=False))
    return Issued(key, _validity(builder, days, now).sign(ca.key, hashes.SHA256()))


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with exactly ``mode``: a new file made 0600 from the start
    (never wider) is filled, chmod'ed, then renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _existing(out: Path) -> list[Path]:
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir()
                  if p.name in ("ca.crt", "ca.key") or _NODE_FILE.fullmatch(p.name))


def write_cluster(out: Path, nodes: int, cluster_id: str, hosts: list[str] | None,
                  dns_pattern: str | None, days: int, force: bool) -> list[Path]:
    """Make a CA and ``nodes`` node certificates in ``out`` (``ca.crt``, ``ca.key``,
    ``node-<i>.crt``, ``node-<i>.key``); return the files written. Raises CertError for bad
    arguments, FileExistsError when ``out`` already holds certificates and not ``force`` (with
    ``force``, node files of ranks >= ``nodes`` are removed: they belong to the old CA)."""
    if nodes < 1:
        raise CertError(f"--nodes must be at least 1, got {nodes}")
    if days < 1:
        raise CertError(f"--days must be at least 1, got {days}")
    if hosts is not None and len(hosts) != nodes:
        raise CertError(f"--hosts lists {len(hosts)} hosts but --nodes is {nodes}: give one "
                        "host per node, in rank order")
    if hosts is not None and not all(h and h.strip() == h for h in hosts):
        raise CertError(f"--hosts has an empty or padded entry: {','.join(hosts)!r}")
    if dns_pattern and nodes > 1 and "{i}" not in dns_pattern:
        raise CertError(f"--dns-pattern {dns_pattern!r} has no {{i}}: every node would get "
                        "the same name")
    names = [node_names(cluster_id, i, hosts[i] if hosts else None, dns_pattern)
             for i in range(nodes)]  # every argument is checked before anything is written
    old = _existing(out)
    if old and not force:
        raise FileExistsError(f"{out} already holds {', '.join(p.name for p in old)}; "
                              "refusing to overwrite (use --force)")
    out.mkdir(parents=True, exist_ok=True)
    ca = new_ca(cluster_id, days)
    written = [out / "ca.crt", out / "ca.key"]
    write_file(written[0], ca.cert.public_bytes(serialization.Encoding.PEM), 0o644)
    write_file(written[1], _pem_key(ca.key), 0o600)
    for i, sans in enumerate(names):
        node = new_node(ca, i, sans, days)
        crt, key = out / f"node-{i}.crt", out / f"node-{i}.key"
        write_file(key, _pem_key(node.key), 0o600)
        write_file(crt, node.cert.public_bytes(serialization.Encoding.PEM), 0o644)
        written += [crt, key]
    for stale in set(old) - set(written):
        stale.unlink(missing_ok=True)
    return written


def _rank_of(path: Path) -> int:
    match = _NODE_FILE.fullmatch(path.name)
    return int(match[1]) if match else -1


def _san_text(cert: x509.Certificate) -> str:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "-"
    return ",".join(f"{'dns' if isinstance(n, x509.DNSName) else 'ip'}:{n.value}" for n in san
                    if isinstance(n, x509.DNSName | x509.IPAddress)) or "-"


def _problems(path: Path, cert: x509.Certificate, ca: x509.Certificate,
              now: dt.datetime) -> list[str]:
    problems = []
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        problems.append("does not verify against ca.crt")
    if now >= cert.not_valid_after_utc:
        problems.append("expired")
    if now < cert.not_valid_before_utc:
        problems.append("not valid yet")
    rank = _rank_of(path)
    if rank >= 0:
        identity = identity_of(cert.public_bytes(serialization.Encoding.DER))
        if identity is None:
            problems.append("no decent:// rank URI")
        elif identity[1] != rank:
            problems.append(f"names rank {identity[1]}, not {rank}")
        if not _key_matches(path.with_suffix(".key"), cert):
            problems.append(f"{path.with_suffix('.key').name} is not its key")
    return problems


def _key_matches(key_path: Path, cert: x509.Certificate) -> bool:
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return True  # missing or unreadable here (e.g. another user's): nothing to compare
    return key.public_key() == cert.public_key()


def _line(path: Path, ca: x509.Certificate, now: dt.datetime) -> tuple[str, bool]:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        return f"{path.name}: cannot read a PEM certificate ({exc}): FAIL", False
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = str(cns[0].value) if cns else "-"
    identity = identity_of(cert.public_bytes(serialization.Encoding.DER))
    who = f"rank {identity[1]} cluster {identity[0]!r}" if identity else "no rank"
    who = "CA" if path.name == "ca.crt" else who
    after = cert.not_valid_after_utc
    left = -((now - after) // dt.timedelta(days=1))  # rounded up: a day begun is a day left
    problems = _problems(path, cert, ca, now)
    status = "FAIL: " + "; ".join(problems) if problems else "ok"
    return (f"{path.name}: CN={cn}  {who}  SAN {_san_text(cert)}  "
            f"not after {after:%Y-%m-%d %H:%M}Z ({left} days left)  {status}"), not problems


def _key_warnings(path: Path) -> list[str]:
    warnings = []
    for key in sorted(path.glob("*.key"), key=lambda p: (_rank_of(p), p.name)):
        try:
            mode = key.stat().st_mode & 0o777
        except OSError:  # a dangling link: nothing to warn about
            continue
        if mode & 0o077:
            warnings.append(f"warning: {key.name} is readable by group/others (mode "
                            f"{mode:04o}): chmod 600 {key}")
    return warnings


def check_dir(path: Path | str) -> tuple[list[str], bool]:
    """Check the certificates of ``path`` (``ca.crt``, then ``node-<i>.crt`` by rank): one line
    each, then warnings for keys readable by group or others. ``all_ok``: every certificate
    verifies against ``ca.crt``, none expired or misnamed, and there is at least ``ca.crt``."""
    path = Path(path)
    try:
        ca = x509.load_pem_x509_certificate((path / "ca.crt").read_bytes())
    except (OSError, ValueError) as exc:
        return [f"ca.crt: cannot read a PEM certificate in {path} ({exc}): FAIL"], False
    now = dt.datetime.now(dt.UTC)
    nodes = sorted((p for p in path.glob("node-*.crt") if _rank_of(p) >= 0), key=_rank_of)
    lines, all_ok = [], True
    for cert_path in [path / "ca.crt", *nodes]:
        line, ok = _line(cert_path, ca, now)
        lines.append(line)
        all_ok &= ok
    return lines + _key_warnings(path), all_ok
