"""``decentctl certs`` and daemon/security/certs.py: the files, their SANs, --check, and a real TLS
1.3 mutual handshake between two node certificates."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from decentd.security import certs


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    """The real ``decentctl`` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "decentd.tools.ctl", "certs", *args],
                          capture_output=True, text=True, timeout=60)


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def der(path: Path) -> bytes:
    return load(path).public_bytes(serialization.Encoding.DER)


def self_signed(sans: list[x509.GeneralName] | None) -> bytes:
    """A throwaway self-signed certificate with these SANs (None: no SAN extension), DER."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t")])
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
         .public_key(key.public_key()).serial_number(1).not_valid_before(now)
         .not_valid_after(now + dt.timedelta(days=1)))
    if sans is not None:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two nodes of cluster "c1", made once for the read-only tests."""
    out = tmp_path_factory.mktemp("certs") / "c1"
    certs.write_cluster(out, 2, "c1", None, None, 30, False)
    return out


def test_files_modes_and_extensions(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    old = os.umask(0)  # the modes must not depend on the umask: keys are never wider than 0600
    try:
        written = certs.write_cluster(out, 3, "job-7", ["10.1.2.3", "b.example", "::1"],
                                      "decent-{i}.decent.default.svc", 10, False)
    finally:
        os.umask(old)
    names = ["ca.crt", "ca.key"] + [f"node-{i}.{e}" for i in range(3) for e in ("crt", "key")]
    assert sorted(p.name for p in written) == sorted(names)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temporary files left
    for p in written:
        assert stat.S_IMODE(p.stat().st_mode) == (0o600 if p.suffix == ".key" else 0o644), p
    ca = load(out / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    node = load(out / "node-0.crt")
    assert node.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "decent rank 0"
    assert not node.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert list(node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert isinstance(node.signature_hash_algorithm, hashes.SHA256)
    key = serialization.load_pem_private_key((out / "node-0.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    node.verify_directly_issued_by(ca)


def test_san_contents_exact(tmp_path: Path) -> None:
    certs.write_cluster(tmp_path, 3, "job-7", ["10.1.2.3", "b.example", "127.0.0.1"],
                        "decent-{i}.decent.default.svc", 10, False)
    ip = ipaddress.ip_address
    loopback = [x509.DNSName("localhost"), x509.IPAddress(ip("127.0.0.1"))]
    want = [
        [x509.UniformResourceIdentifier("decent://job-7/rank/0"),
         x509.DNSName("decent-0.decent.default.svc"), x509.IPAddress(ip("10.1.2.3")), *loopback],
        [x509.UniformResourceIdentifier("decent://job-7/rank/1"),
         x509.DNSName("decent-1.decent.default.svc"), x509.DNSName("b.example"), *loopback],
        [x509.UniformResourceIdentifier("decent://job-7/rank/2"),  # 127.0.0.1 once, first
         x509.DNSName("decent-2.decent.default.svc"), *reversed(loopback)],
    ]
    for i, names in enumerate(want):
        san = load(tmp_path / f"node-{i}.crt").extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
        assert list(san) == names


def test_identity_round_trip(cluster: Path) -> None:
    assert certs.rank_uri("c1", 1) == "decent://c1/rank/1"
    assert [certs.identity_of(der(cluster / f"node-{i}.crt")) for i in range(2)] == [
        ("c1", 0), ("c1", 1)]
    assert certs.identity_of(der(cluster / "ca.crt")) is None
    for cluster_id in ("decent", "my cluster/ü", "100%", "a.b_c~d-e"):
        uri = x509.UniformResourceIdentifier(certs.rank_uri(cluster_id, 12))
        assert certs.identity_of(self_signed([uri])) == (cluster_id, 12)


@pytest.mark.parametrize("uris", [
    [], ["decent://c/rank/1", "decent://c/rank/2"], ["decent://c/rank/x"],
    ["decent://c/rank/01"], ["decent://c/rank/-1"], ["decent:///rank/1"], ["decent://c/rank/1/"],
    ["decent://c/node/1"], ["decent://a%2/rank/1"], ["decent://%ff/rank/1"],
    ["decent://a b/rank/1"], ["DECENT://c/rank/1", "decent://c/rank/2"],
])
def test_identity_of_rejects(uris: list[str]) -> None:
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    assert certs.identity_of(self_signed([*sans, x509.DNSName("localhost")])) is None


def test_identity_of_without_san_or_garbage() -> None:
    assert certs.identity_of(self_signed(None)) is None
    assert certs.identity_of(b"not a certificate") is None
    ok = self_signed([x509.UniformResourceIdentifier("https://x/"),
                      x509.UniformResourceIdentifier("decent://c/rank/3")])
    assert certs.identity_of(ok) == ("c", 3)  # other URIs do not count


@pytest.mark.slow
def test_cli_writes_and_checks(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    made = ctl("--out", str(out), "--nodes", "2", "--cluster-id", "k8s",
               "--dns-pattern", "decent-{i}.decent.default.svc")
    assert made.returncode == 0, made.stderr
    checked = ctl("--check", str(out))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["ca.crt", "node-0.crt", "node-1.crt"]
    assert "rank 1 cluster 'k8s'" in lines[2] and "dns:decent-1.decent.default.svc" in lines[2]
    assert all(line.endswith("  ok") for line in lines)
    assert "(365 days left)" in lines[1]


@pytest.mark.slow
def test_cli_hosts_count_mismatch(tmp_path: Path) -> None:
    proc = ctl("--out", str(tmp_path / "x"), "--nodes", "3", "--hosts", "a,b")
    assert proc.returncode == 2
    assert "--hosts lists 2 hosts but --nodes is 3" in proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_cli_no_overwrite_without_force(tmp_path: Path) -> None:
    assert ctl("--out", str(tmp_path), "--nodes", "3").returncode == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    again = ctl("--out", str(tmp_path), "--nodes", "1")
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert ctl("--out", str(tmp_path), "--nodes", "1", "--force").returncode == 0
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(after) == ["ca.crt", "ca.key", "node-0.crt", "node-0.key"]  # 1, 2: old CA
    assert after["ca.key"] != before["ca.key"]


@pytest.mark.slow
def test_cli_check_fails_for_another_ca(tmp_path: Path) -> None:
    for name in ("a", "b"):
        certs.write_cluster(tmp_path / name, 2, "c1", None, None, 30, False)
    for suffix in (".crt", ".key"):
        shutil.copy(tmp_path / "b" / f"node-1{suffix}", tmp_path / "a" / f"node-1{suffix}")
    proc = ctl("--check", str(tmp_path / "a"))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[1].endswith("  ok")
    assert lines[2].startswith("node-1.crt") and "does not verify against ca.crt" in lines[2]


@pytest.mark.slow
def test_check_reports_expired_and_misnamed(tmp_path: Path) -> None:
    certs.write_cluster(tmp_path, 2, "c1", None, None, 30, False)
    ca_key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = certs.Issued(ca_key, load(tmp_path / "ca.crt"))
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=40)
    old = certs.new_node(ca, 0, certs.node_names("c1", 0), 30, now=past)  # ended 10 days ago
    certs.write_file(tmp_path / "node-0.key", old.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()), 0o600)
    certs.write_file(tmp_path / "node-0.crt", old.cert.public_bytes(serialization.Encoding.PEM),
                     0o644)
    lines, ok = certs.check_dir(tmp_path)
    assert not ok
    assert "FAIL: expired" in lines[1] and "(-10 days left)" in lines[1]
    assert lines[2].endswith("  ok")
    proc = ctl("--check", str(tmp_path))
    assert proc.returncode == 1 and "expired" in proc.stdout
    shutil.copy(tmp_path / "node-1.crt", tmp_path / "node-0.crt")  # rank 1's certificate
    lines, ok = certs.check_dir(tmp_path)
    assert not ok and "names rank 1, not 0" in lines[1] and "node-0.key is not its key" in lines[1]


def test_check_warns_on_readable_key(cluster: Path, tmp_path: Path) -> None:
    copy = tmp_path / "c"
    shutil.copytree(cluster, copy)
    (copy / "node-1.key").chmod(0o640)
    lines, ok = certs.check_dir(copy)
    assert ok  # a warning, not a failure
    assert lines[-1].startswith("warning: node-1.key is readable by group/others (mode 0640)")
    assert not any("warning" in line for line in certs.check_dir(cluster)[0])


def test_check_without_ca(tmp_path: Path) -> None:
    lines, ok = certs.check_dir(tmp_path)
    assert not ok and lines[0].startswith("ca.crt: cannot read")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(certs.CertError, match="no \\{i\\}"):
        certs.write_cluster(tmp_path, 2, "c", None, "decent.svc", 1, False)
    with pytest.raises(certs.CertError, match="neither an IP address nor a DNS name"):
        certs.write_cluster(tmp_path, 1, "c", ["host:9000"], None, 1, False)
    with pytest.raises(certs.CertError, match="empty"):
        certs.write_cluster(tmp_path, 2, "c", ["a", ""], None, 1, False)
    with pytest.raises(certs.CertError, match="--days"):
        certs.write_cluster(tmp_path, 1, "c", None, None, 0, False)
    assert list(tmp_path.iterdir()) == []


def tls_context(server: bool, d: Path, rank: int, ca: Path) -> ssl.SSLContext:
    """Node ``rank`` of directory ``d``'s end of a TLS 1.3 link that trusts ``ca`` only."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(d / f"node-{rank}.crt", d / f"node-{rank}.key")
    ctx.load_verify_locations(ca)
    return ctx


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
              hostname: str) -> tuple[object, object]:
    """A mutual handshake over a socketpair; each side's peer identity, or its exception."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    got: dict[str, object] = {}

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                got["server"] = certs.identity_of(s.getpeercert(binary_form=True) or b"")
                s.sendall(b"k")
        except (OSError, ssl.SSLError) as exc:
            got["server"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=hostname) as c:
            assert c.version() == "TLSv1.3"
            got["client"] = certs.identity_of(c.getpeercert(binary_form=True) or b"")
            got["read"] = c.recv(1)
    except (OSError, ssl.SSLError) as exc:
        got.setdefault("client", exc)
    finally:
        t.join(10)
        a.close()
    return got["server"], got["client"]


@pytest.mark.parametrize("hostname", ["localhost", "127.0.0.1"])
def test_mutual_tls13_handshake(cluster: Path, hostname: str) -> None:
    server = tls_context(True, cluster, 0, cluster / "ca.crt")
    client = tls_context(False, cluster, 1, cluster / "ca.crt")
    assert client.check_hostname
    assert handshake(server, client, hostname) == (("c1", 1), ("c1", 0))


def test_tls_rejects_a_client_of_another_ca(cluster: Path, tmp_path: Path) -> None:
    certs.write_cluster(tmp_path, 2, "c1", None, None, 30, False)
    server = tls_context(True, cluster, 0, cluster / "ca.crt")
    client = tls_context(False, tmp_path, 1, cluster / "ca.crt")
    on_server, _ = handshake(server, client, "localhost")
    assert isinstance(on_server, ssl.SSLCertVerificationError)
