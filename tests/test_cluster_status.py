"""``decentctl status --cluster`` (issue 25): every daemon in one table, asked through the local
daemon over the peers' authenticated channels; a peer that is down is listed with its error, and
a stranger cannot read a daemon's status through the peer port."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster import Cluster, until, until_state
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.security.auth import PeerAuth, new_nonce, read_secret, write_secret

pytestmark = pytest.mark.slow

SECRET = ("--security-mode", "secret", "--secret-file")


def decentctl(*args: str) -> subprocess.CompletedProcess[str]:
    """``decentctl ARGS`` as users run it."""
    return subprocess.run([sys.executable, "-m", "decentd.tools.ctl", *args], capture_output=True,
                          text=True, timeout=60)


def cluster_json(sock: str) -> tuple[int, list[dict[str, Any]]]:
    """(exit code, every daemon's line) of ``decentctl status --cluster --json``."""
    out = decentctl("status", "--cluster", "--json", "--daemon", f"unix://{sock}")
    return out.returncode, json.loads(out.stdout)["daemons"]


def test_every_daemon_is_one_line_and_a_dead_one_says_why(tmp_path: Path) -> None:
    secret = str(write_secret(tmp_path / "secret"))
    c = Cluster(3, "ring", *SECRET, secret)
    try:
        c.connect(job="status")
        code, lines = cluster_json(c.sockets[1])
        first = lines
        assert code == 0, lines
        assert [line["rank"] for line in lines] == [0, 1, 2]
        assert [line["address"] for line in lines] == c.peers
        assert all(line["security"] == "secret" and line["workers"] == 1 and line["version"]
                   and "error" not in line for line in lines), lines
        assert all(line["live"] == "0,1,2" for line in lines), lines  # issue 26: the view
        table = decentctl("status", "--cluster", "--daemon", f"unix://{c.sockets[0]}")
        assert table.returncode == 0 and all(p in table.stdout for p in c.peers), table.stdout

        c.disconnect()
        c.procs[2].terminate()
        assert c.procs[2].wait(timeout=30) == 0
        code, lines = cluster_json(c.sockets[0])
        assert code == 1
        assert [line["rank"] for line in lines] == [0, 1, 2]
        assert "error" in lines[2] and "PEER_UNAVAILABLE" in lines[2]["error"], lines[2]
        assert "error" not in lines[0] and "error" not in lines[1]
        # the survivors' view leaves rank 2 out, at a later epoch than before
        until(lambda: [ln.get("live") for ln in cluster_json(c.sockets[0])[1][:2]] ==
              ["0,1", "0,1"], "the survivors to leave rank 2 out of their view")
        lines = cluster_json(c.sockets[0])[1]
        assert all(int(lines[i]["epoch"]) > int(first[i]["epoch"]) for i in (0, 1))
        table = decentctl("status", "--cluster", "--daemon", f"unix://{c.sockets[0]}")
        assert "live daemons [0, 1]" in table.stdout.replace("\n", " "), table.stdout
        until_state(c, 0, 2, "down")  # reconnecting first, down after dead_after
        one = decentctl("status", "--daemon", f"unix://{c.sockets[0]}")
        assert "live daemons [0, 1]" in one.stdout and "down" in one.stdout, one.stdout
    finally:
        c.stop()


def test_the_peer_port_tells_its_status_only_to_proven_peers(tmp_path: Path) -> None:
    secret = str(write_secret(tmp_path / "secret"))
    c = Cluster(2, "ring", *SECRET, secret)
    try:
        c.connect(job="status-auth")
        with grpc.insecure_channel(c.peers[0]) as channel:
            stub = pb_grpc.PeerStub(channel)
            bare = stub.Status(pb.PeerStatusRequest(cluster_id="decent", from_rank=1,
                                                    to_rank=0), timeout=30)
            assert bare.error.code == pb.UNAUTHENTICATED and not bare.peers, bare
            for holder, admitted in ((PeerAuth("secret", "decent", b"a guess"), False),
                                     (PeerAuth("secret", "decent", read_secret(secret)), True)):
                nonce = new_nonce()
                challenge = stub.Challenge(pb.ChallengeRequest(
                    cluster_id="decent", from_rank=1, to_rank=0, client_nonce=nonce), timeout=30)
                request = pb.PeerStatusRequest(
                    cluster_id="decent", from_rank=1, to_rank=0,
                    server_nonce=challenge.server_nonce,
                    proof=holder.status_proof(1, 0, nonce, challenge.server_nonce))
                reply = stub.Status(request, timeout=30)
                assert (reply.error.code == pb.OK) == admitted, reply.error
                assert (reply.workers == 1) == admitted
                if admitted:  # a challenge answers one request only
                    again = stub.Status(request, timeout=30)
                    assert again.error.code == pb.UNAUTHENTICATED
    finally:
        c.stop()
