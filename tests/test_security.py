"""Who may talk to a daemon: secret mode end to end, refused secrets, spoofed and replayed
handshakes, spoofed bulk HELLOs, what an unauthenticated connection can hold, and where a
daemon listens."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from lone import LoneDaemon, closed_by_peer, secret_args, secret_file, wait_for

from cluster import Cluster, free_ports
from decent_wire import framing
from decent_wire.protocol import PROTOCOL_VERSION
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.security.auth import NONCE_BYTES, PeerAuth, new_nonce

pytestmark = pytest.mark.slow


def test_secret_mode_gives_exact_results(tmp_path: Path) -> None:
    c = Cluster(3, "ring", *secret_args(secret_file(tmp_path)))
    try:
        c.connect()
        got = c.run(lambda cl: (cl.neighbor_allreduce(torch.full((5,), float(cl.rank)),
                                                      name="sec.nar"),
                                cl.allreduce(torch.full((3,), float(cl.rank)), name="sec.avg")))
        for r, (nar, avg) in enumerate(got):
            left, right = (r - 1) % 3, (r + 1) % 3
            assert torch.equal(nar, torch.full((5,), (r + left + right) / 3))
            assert torch.equal(avg, torch.full((3,), 1.0))
        assert "security: secret" in c.log(0)
    finally:
        c.kill()


def test_a_daemon_with_another_secret_is_refused(tmp_path: Path) -> None:
    lone = LoneDaemon(tmp_path)  # rank 0, waiting for its rank 1
    try:
        other = secret_file(tmp_path, "other")
        out = subprocess.run([sys.executable, "-m", "decentd", "--rank", "1", "--peers",
                              lone.peers, "--socket", str(tmp_path / "r1.sock"),
                              "--set", "timeouts.start=5", *secret_args(other)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out
        assert "does not hold this cluster's secret" in out.stderr, out.stderr
        assert lone.proc.poll() is None  # rank 0 goes on waiting for the real rank 1
    finally:
        lone.close()


def test_a_spoofed_hello_is_closed_and_the_real_peer_still_gets_in(tmp_path: Path) -> None:
    lone = LoneDaemon(tmp_path)
    try:
        for proof in (b"", os.urandom(32)):
            with lone.bulk() as s:
                s.sendall(framing.encode(pb.BulkHeader(kind=pb.HELLO, cluster_id="decent",
                                                       from_rank=1, proof=proof)))
                s.sendall(framing.encode(pb.BulkHeader(kind=pb.DATA, payload_bytes=4)) +
                          b"\x00" * 4)
                assert closed_by_peer(s)
        assert "HELLO as rank 1 without a valid proof" in lone.text()
        # the real rank 1 connects afterwards: nothing was bound to its rank
        real = lone.start_peer(tmp_path)
        try:
            assert lone.average_with_peer(tmp_path, "spoof")
        finally:
            real.kill()
            real.wait()
    finally:
        lone.close()


def test_handshakes_without_the_secret_or_replayed_are_refused(tmp_path: Path) -> None:
    lone = LoneDaemon(tmp_path)
    channel, stub = lone.stub()
    try:
        nonce = new_nonce()
        ch = stub.Challenge(pb.ChallengeRequest(cluster_id="decent", from_rank=1, to_rank=0,
                                                client_nonce=nonce), timeout=30)
        assert ch.error.code == pb.OK and len(ch.server_nonce) == NONCE_BYTES
        # the daemon proved it holds the secret; a guessed proof is refused
        wrong = PeerAuth("secret", "decent", b"not the cluster secret at all")
        proof, _ = wrong.client_proof(1, 0, nonce, ch.server_nonce)
        hs = pb.HandshakeRequest(cluster_id="decent", protocol_version=PROTOCOL_VERSION,
                                 from_rank=1, to_rank=0, server_nonce=ch.server_nonce,
                                 proof=proof)
        reply = stub.Handshake(hs, timeout=30)
        assert reply.error.code == pb.UNAUTHENTICATED, reply
        assert "secret" in reply.error.message and reply.data_port == 0
        # the right proof for a challenge already answered: a replay
        right = PeerAuth("secret", "decent", Path(lone.secret).read_bytes().strip())
        hs.proof, _ = right.client_proof(1, 0, nonce, ch.server_nonce)
        reply = stub.Handshake(hs, timeout=30)
        assert reply.error.code == pb.UNAUTHENTICATED and "replayed" in reply.error.message
        # no challenge at all
        hs.server_nonce = new_nonce()
        assert stub.Handshake(hs, timeout=30).error.code == pb.UNAUTHENTICATED
        # a short nonce, a long cluster id: refused, and the log line stays short
        bad = stub.Challenge(pb.ChallengeRequest(cluster_id="x" * 60_000, from_rank=1,
                                                 to_rank=0, client_nonce=b"1"), timeout=30)
        assert bad.error.code != pb.OK
        with pytest.raises(grpc.RpcError) as huge:  # past the peer server's 64 KiB limit
            stub.Challenge(pb.ChallengeRequest(cluster_id="x" * 100_000), timeout=30)
        assert huge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert max(len(line) for line in lone.text().splitlines()) < 600
    finally:
        channel.close()
        lone.close()


def test_unauthenticated_bulk_connections_hold_little_and_not_for_long(
        tmp_path: Path) -> None:
    lone = LoneDaemon(tmp_path, "--set", "timeouts.auth=2")
    try:
        with lone.bulk() as s:  # a header far larger than a HELLO, before any HELLO
            s.sendall((16 << 20).to_bytes(framing.LENGTH, "little") + b"\x00" * 1024)
            assert closed_by_peer(s)
        with lone.bulk() as s:  # silent: closed once timeouts.auth passes
            assert closed_by_peer(s)
        assert "did not authenticate" in lone.text()
        assert lone.proc.poll() is None
    finally:
        lone.close()


def test_a_listen_address_off_loopback_needs_a_security_mode(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    base = [sys.executable, "-m", "decentd", "--peers", f"127.0.0.1:{port}",
            "--listen", f"0.0.0.0:{port}", "--socket", str(tmp_path / "d.sock")]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused  # a config error: systemd does not retry it
    assert "off loopback, with no security" in refused.stderr
    assert "security.mode" in refused.stderr and "secret_file" in refused.stderr
    with (tmp_path / "insecure.log").open("wb") as log:
        proc = subprocess.Popen([*base, "--security-mode", "insecure"], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "ready" in (tmp_path / "insecure.log").read_text(), "never ready")
        assert "WARNING" in (tmp_path / "insecure.log").read_text()
        assert "insecure" in (tmp_path / "insecure.log").read_text()
    finally:
        proc.terminate()
        proc.wait()


def test_the_default_socket_is_in_a_directory_of_the_users_own(tmp_path: Path) -> None:
    # $XDG_RUNTIME_DIR when set; else decentd-<uid> in the temporary directory, made 0700, and
    # refused when someone else made it first (anyone may create names in /tmp)
    runtime, tmp = tmp_path / "run", tmp_path / "tmp"
    runtime.mkdir(mode=0o700)
    tmp.mkdir()
    daemon = [sys.executable, "-m", "decentd", "--peers", f"127.0.0.1:{free_ports(1)[0]}"]
    mine = tmp / f"decentd-{os.getuid()}"
    for given, folder in (({"XDG_RUNTIME_DIR": str(runtime)}, runtime),
                          ({"XDG_RUNTIME_DIR": "", "TMPDIR": str(tmp)}, mine)):
        env = {**os.environ, **given}
        with (tmp_path / "d.log").open("wb") as log:
            proc = subprocess.Popen(daemon, stdout=log, stderr=subprocess.STDOUT, env=env)
        sock = folder / "decentd.sock"
        try:
            wait_for(sock.exists, "no socket")
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
            address = subprocess.run(
                [sys.executable, "-c", "from decent.core import default_address; "
                 "print(default_address())"], env=env, capture_output=True, text=True,
                check=True).stdout.strip()
            assert address == f"unix://{sock}"
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0
    if os.geteuid() == 0:  # squatted by another user: refused, saying why
        squatted = tmp_path / "tmp2"
        (squatted / f"decentd-{os.getuid()}").mkdir(parents=True)
        os.chown(squatted / f"decentd-{os.getuid()}", OTHER_UID, OTHER_UID)
        out = subprocess.run(daemon, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "XDG_RUNTIME_DIR": "", "TMPDIR": str(squatted)})
        assert out.returncode != 0 and "someone else made it" in out.stderr, out


def test_a_loopback_daemon_listens_on_loopback_only(tmp_path: Path) -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True,
                             check=True).stdout
        mine = [line.split()[3] for line in out.splitlines()
                if any(f"pid={p.pid}," in line for p in c.procs)]
        assert len(mine) == 4, out  # gRPC and bulk, per daemon
        # gRPC binds an IPv6 socket to the IPv4-mapped loopback address
        assert all(addr.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for addr in mine), mine
    finally:
        c.kill()


@pytest.mark.parametrize("bad", ["--set=listen=127.0.0.1:99999", "--set=timeouts.heartbeat=1e-6"])
def test_config_values_out_of_range_are_refused(tmp_path: Path, bad: str) -> None:
    out = subprocess.run([sys.executable, "-m", "decentd", bad, "--socket",
                          str(tmp_path / "d.sock")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "config error" in out.stderr, out


def test_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        out = subprocess.run([sys.executable, "-m", "decentd", "--peers",
                              f"127.0.0.1:{port}", "--socket", str(tmp_path / "d.sock")],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"cannot listen for peers on 127.0.0.1:{port}" in out.stderr


OTHER_UID = 65534  # nobody
PROBE = """
import socket, sys
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except PermissionError:
        print("denied", path)
        continue
    s.settimeout(60)
    try:
        s.sendall(b"\\x00\\x00\\x00\\x00")
        print("closed" if s.recv(1) == b"" else "answered", path)
    except (ConnectionResetError, BrokenPipeError):
        print("closed", path)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another uid (setpriv) "
                    "needs root")
def test_another_uid_is_refused_on_the_worker_sockets() -> None:
    c = Cluster(1, "ring")
    try:
        c.connect()
        sock = c.sockets[0]
        paths = [sock, f"{sock}.data", f"{sock}.mem"]
        assert {p: stat.S_IMODE(os.stat(p).st_mode) for p in paths} == dict.fromkeys(paths, 0o600)
        maps = Path(f"/proc/{c.procs[0].pid}/map_files")  # the arenas: memfds, mapped
        arenas = [m for m in maps.iterdir() if "/memfd:decent-" in os.readlink(m)]
        assert arenas and all(stat.S_IMODE(fd.stat().st_mode) == 0o600 for fd in arenas)
        os.chmod(c.dir, 0o755)  # the directory is no obstacle: the sockets' modes are
        probe = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                 "/usr/bin/python3", "-I", "-c", PROBE]
        out = subprocess.run([*probe, *paths[1:]], capture_output=True, text=True, timeout=60)
        assert out.stdout.split("\n")[:2] == [f"denied {p}" for p in paths[1:]], out
        for p in paths[1:]:  # opened by hand: the daemon still checks who connects
            os.chmod(p, 0o666)
        out = subprocess.run([*probe, *paths[1:]], capture_output=True, text=True, timeout=60)
        assert out.stdout.split("\n")[:2] == [f"closed {p}" for p in paths[1:]], out
        wait_for(lambda: c.log(0).count(f"runs as uid {OTHER_UID}") >= 2, "no refusal logged")
        got = c.run(lambda cl: cl.allreduce(torch.ones(2), name="sec.uid"))  # others go on
        assert torch.equal(got[0], torch.ones(2))
    finally:
        c.kill()


def make_certs(tmp_path: Path, nodes: int, name: str = "pki") -> Path:
    """A CA and ``nodes`` node certificates (``decentctl certs``)."""
    from decentd.security.certs import write_cluster
    out = tmp_path / name
    write_cluster(out, nodes, "decent", None, None, 30, False)
    return out


def mtls_args(pki: Path, rank: int, *, cert_rank: int | None = None, encrypt: bool = True
              ) -> tuple[str, ...]:
    who = rank if cert_rank is None else cert_rank
    return ("--security-mode", "mtls", "--ca", str(pki / "ca.crt"), "--cert",
            str(pki / f"node-{who}.crt"), "--key", str(pki / f"node-{who}.key"),
            "--encrypt-bulk" if encrypt else "--no-encrypt-bulk")


class PerRankCluster(Cluster):
    """A cluster whose daemons get per-rank flags (their own certificates)."""

    def __init__(self, n: int, flags: list[tuple[str, ...]]) -> None:
        self._flags = flags
        super().__init__(n, "ring")

    def spawn(self, i: int, topology: str, *extra: str) -> subprocess.Popen[bytes]:
        return super().spawn(i, topology, *extra, *self._flags[i])


@pytest.mark.parametrize("encrypt", [True, False], ids=["bulk-tls", "bulk-hmac"])
def test_mtls_gives_exact_results(tmp_path: Path, encrypt: bool) -> None:
    pki = make_certs(tmp_path, 3)
    c = PerRankCluster(3, [mtls_args(pki, r, encrypt=encrypt) for r in range(3)])
    try:
        c.connect()
        big = 1 << 20  # 4 MiB: the bulk path's large-message handling, over TLS too
        got = c.run(lambda cl: (cl.neighbor_allreduce(torch.full((big,), float(cl.rank)),
                                                      name="mtls.nar"),
                                cl.allreduce(torch.full((3,), float(cl.rank)), name="mtls.avg")))
        for r, (nar, avg) in enumerate(got):
            left, right = (r - 1) % 3, (r + 1) % 3
            assert torch.equal(nar, torch.full((big,), (r + left + right) / 3))
            assert torch.equal(avg, torch.full((3,), 1.0))
        assert "security: mtls" in c.log(0)
        assert ("bulk over TLS" if encrypt else "bulk in clear") in c.log(0)
    finally:
        c.kill()


def _refused_pair(tmp_path: Path, flags: list[tuple[str, ...]]) -> list[str]:
    """Two daemons with ``flags``, which must both fail to start: their stderr."""
    ports = free_ports(2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "decentd", "--rank", str(i), "--peers", peers,
         "--socket", str(tmp_path / f"m{i}.sock"), "--set", "timeouts.start=5", *flags[i]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1, err
        errs.append(err)
    return errs


def test_a_certificate_of_another_ca_is_refused(tmp_path: Path) -> None:
    ours, theirs = make_certs(tmp_path, 2, "ours"), make_certs(tmp_path, 2, "theirs")
    errs = _refused_pair(tmp_path, [mtls_args(ours, 0), mtls_args(theirs, 1)])
    assert all("peers not reachable" in e or "refused" in e for e in errs), errs


def test_a_valid_certificate_claiming_another_rank_is_refused(tmp_path: Path) -> None:
    pki = make_certs(tmp_path, 3)
    ports = free_ports(3)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    # a daemon given another rank's certificate does not start
    wrong = subprocess.run([sys.executable, "-m", "decentd", "--rank", "1", "--peers", peers,
                            "--socket", str(tmp_path / "w.sock"), *mtls_args(pki, 1, cert_rank=0)],
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "names ('decent', 0)" in wrong.stderr, wrong.stderr
    # a caller that skips that check: rank 2's valid certificate, claiming rank 1
    with (tmp_path / "rank0.log").open("ab") as log:
        lone = subprocess.Popen([sys.executable, "-m", "decentd", "--rank", "0", "--peers",
                                 peers, "--socket", str(tmp_path / "m0.sock"),
                                 "--set", "timeouts.start=120", *mtls_args(pki, 0)],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: LoneDaemon._listening(ports[0]), "rank 0 never listened")
        creds = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(),
                                             (pki / "node-2.key").read_bytes(),
                                             (pki / "node-2.crt").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{ports[0]}", creds) as channel:
            stub = pb_grpc.PeerStub(channel)
            reply = stub.Handshake(pb.HandshakeRequest(
                cluster_id="decent", protocol_version=PROTOCOL_VERSION, from_rank=1, to_rank=0,
                workers_per_node=1), timeout=30)
        assert reply.error.code == pb.UNAUTHENTICATED, reply
        assert "certificate names rank 2" in reply.error.message, reply.error.message
        assert not reply.bulk_key and reply.data_port == 0
    finally:
        lone.kill()
        lone.wait()


def test_plain_tcp_on_the_tls_ports_gets_nothing(tmp_path: Path) -> None:
    pki = make_certs(tmp_path, 2)
    c = PerRankCluster(2, [mtls_args(pki, r) for r in range(2)])
    try:
        c.connect()
        grpc_port = int(c.peers[0].rsplit(":", 1)[1])
        hello = framing.encode(pb.BulkHeader(kind=pb.HELLO, cluster_id="decent", from_rank=1))
        for port in (grpc_port, _data_port(c, 0)):
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(hello + b"\x00" * 64)
                got = b""
                with contextlib.suppress(ConnectionResetError, socket.timeout):
                    while chunk := s.recv(4096):
                        got += chunk
                # at most a TLS alert record (content type 21): no decent or HTTP/2 byte
                assert got == b"" or got[0] == 21, got[:32]
        sums = c.run(lambda cl: cl.allreduce(torch.full((2,), float(cl.rank)), name="mtls.ok"))
        assert all(torch.equal(t, torch.full((2,), 0.5)) for t in sums)
    finally:
        c.kill()


def _data_port(c: Cluster, rank: int) -> int:
    """Daemon ``rank``'s bulk port, from its log."""
    found = re.search(r"bulk data on port (\d+)", c.log(rank))
    assert found, "no bulk port in the log"
    return int(found.group(1))
