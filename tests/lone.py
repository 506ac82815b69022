"""A lone secret-mode daemon for tests of what reaches a daemon before its peers do: rank 0
of a two-daemon cluster whose rank 1 is not up, as an attacker finds it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch
from hostspeed import scaled

from cluster import free_ports
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.security.auth import write_secret

__all__ = ["LoneDaemon", "closed_by_peer", "secret_args", "secret_file", "wait_for"]


def secret_file(tmp_path: Path, name: str = "secret") -> str:
    """A new cluster secret in ``tmp_path``; its path."""
    return str(write_secret(tmp_path / name))


def secret_args(path: str) -> tuple[str, ...]:
    """decentd's arguments for secret mode with the secret at ``path``."""
    return ("--security-mode", "secret", "--secret-file", path)


def wait_for(predicate: object, what: str, timeout: float = 60) -> None:
    """Poll ``predicate`` (a callable) until it holds: an event another process causes (within
    ``timeout`` s on a quiet host, :func:`hostspeed.scaled`)."""
    deadline = time.monotonic() + scaled(timeout)
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def closed_by_peer(sock: socket.socket) -> bool:
    """Block until the daemon closes ``sock`` (True), or it sends something (False)."""
    sock.settimeout(60)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class LoneDaemon:
    """Rank 0 of a two-daemon secret-mode cluster whose rank 1 is not up: what an attacker
    reaches before the real peer connects."""

    def __init__(self, tmp_path: Path, *extra: str, **popen: Any) -> None:
        """Start it with ``extra`` arguments (``popen``: more for ``subprocess.Popen``)."""
        self.secret = secret_file(tmp_path)
        self.grpc_port, self.data_port = free_ports(2)
        self.peer_port = free_ports(1)[0]
        self.peers = f"127.0.0.1:{self.grpc_port},127.0.0.1:{self.peer_port}"
        self.log = tmp_path / "rank0.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "decentd", "--rank", "0", "--peers", self.peers,
                 "--socket", str(tmp_path / "r0.sock"), "--set", "timeouts.start=120",
                 "--set", f"transport.data_port={self.data_port}",
                 *secret_args(self.secret), *extra], stdout=log, stderr=subprocess.STDOUT, **popen)
        wait_for(lambda: self._listening(self.data_port) and self._listening(self.grpc_port),
                 "rank 0 never listened")

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def bulk(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.data_port), timeout=60)

    def stub(self) -> tuple[grpc.Channel, pb_grpc.PeerStub]:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        return channel, pb_grpc.PeerStub(channel)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def start_peer(self, tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
        """The real rank 1 (its log: ``rank1.log``; its socket: ``r1.sock``)."""
        with (tmp_path / "rank1.log").open("ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "decentd", "--rank", "1", "--peers", self.peers,
                 "--socket", str(tmp_path / "r1.sock"), *secret_args(self.secret), *extra],
                stdout=log, stderr=subprocess.STDOUT)

    def average_with_peer(self, tmp_path: Path, job: str) -> bool:
        """Connect a worker to this daemon and one to the real rank 1 (:meth:`start_peer`),
        allreduce their ranks once, close them; whether both got the exact mean."""
        import decent.torch as dt

        clients = [dt.connect(f"unix://{tmp_path / f'r{i}.sock'}", 60, job=job)
                   for i in (0, 1)]
        try:
            with ThreadPoolExecutor(2) as pool:
                got = list(pool.map(lambda cl: cl.allreduce(
                    torch.full((2,), float(cl.rank)), name=f"{job}.avg"), clients))
        finally:
            for cl in clients:
                cl.close()
        return all(torch.equal(g, torch.full((2,), 0.5)) for g in got)
