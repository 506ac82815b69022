"""Failure paths found in review: each would hang, leak or corrupt without its fix."""

from __future__ import annotations

import functools
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import decent.torch as dt
from cluster import Cluster, until
from conftest import ClusterFactory
from decent.core import Client, DecentError
from decent_wire.v1 import decent_pb2 as pb

pytestmark = pytest.mark.slow


def _aborts_from(cl: Client[torch.Tensor], peer: int) -> int:
    """ABORT frames ``cl``'s daemon has received from ``peer``."""
    (link,) = [p for p in cl.status().peers if p.rank == peer]
    return int(link.aborts_received)


def _await_abort(cl: Client[torch.Tensor], peer: int, before: int) -> None:
    """Wait until ``cl``'s daemon has an ABORT from ``peer`` it did not have before (at most
    60 s: then fail, naming what did not come)."""
    until(lambda: _aborts_from(cl, peer) != before, f"an ABORT from rank {peer}", timeout=60)


def test_abort_that_arrives_before_the_local_submit_fails_the_op_at_once(
        cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    a, b = c.clients
    before = _aborts_from(a, 1)
    with pytest.raises(DecentError, match="timed out"):
        b.neighbor_allreduce(torch.zeros(3), name="late", timeout=1)  # rank 0 not there yet
    _await_abort(a, 1, before)  # rank 1's ABORT is at rank 0 before rank 0 submits
    with pytest.raises(DecentError) as info:
        a.neighbor_allreduce(torch.zeros(3), name="late", timeout=60)
    # rank 1's failure, not this op's own 60 s timeout
    assert "timed out after 1s on rank 1" in info.value.message, info.value.message
    assert "'late'" in info.value.message
    assert a.status().ops_in_flight == 0


def test_op_aborted_before_it_starts_tells_its_other_peers(cluster: ClusterFactory) -> None:
    # chain 0 -> 1 -> 2: rank 0 gives up, aborting rank 1's op before rank 1 has submitted it;
    # when rank 1 does, it fails at once and must pass that on to rank 2, which waits for it
    c = cluster(3, "ring")
    r0, r1, r2 = c.clients
    h2 = r2.neighbor_allreduce_async(torch.zeros(2), name="chain", self_weight=0.5,
                                     src_weights={1: 0.5}, dst_weights=[], timeout=60)
    before = _aborts_from(r1, 0)
    with pytest.raises(DecentError, match="timed out"):
        r0.neighbor_allreduce(torch.zeros(2), name="chain", self_weight=1.0, src_weights={},
                              dst_weights=[1], timeout=1)
    _await_abort(r1, 0, before)
    with pytest.raises(DecentError) as failed:
        r1.neighbor_allreduce(torch.zeros(2), name="chain", self_weight=0.5,
                              src_weights={0: 0.5}, dst_weights=[2], timeout=60)
    assert "timed out after 1s on rank 0" in failed.value.message  # rank 0's, not its own
    with pytest.raises(DecentError) as info:
        h2.wait(timeout=90)
    # passed on from rank 0 through rank 1, not rank 2's own 60 s timeout
    assert "timed out after 1s on rank 0" in info.value.message, info.value.message


def test_failure_before_peers_are_known_still_tells_them(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    a, b = c.clients
    hb = b.neighbor_allreduce_async(torch.zeros(3), name="badarg", timeout=30)
    with pytest.raises(DecentError, match="self_weight"):
        a.neighbor_allreduce(torch.zeros(3), name="badarg", src_weights={1: 0.5})
    with pytest.raises(DecentError) as info:
        hb.wait(timeout=60)
    # rank 0's refusal reached rank 1: not its own timeout (that would be TIMEOUT)
    assert info.value.code_name == "INVALID_ARGUMENT" and "rank 0" in info.value.message


def test_refused_argument_does_not_spend_a_round(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    a = c.clients[0]
    free = a.arena.free_bytes
    with pytest.raises(ValueError, match="'spent'"):
        a.neighbor_allreduce(torch.zeros(3), name="spent", self_weight=0.5,
                             src_weights={2**40: 0.5}, dst_weights=[1])
    with pytest.raises(ValueError, match="timeout"):
        a.neighbor_allreduce(torch.zeros(3), name="spent", timeout=float("nan"))
    assert a.arena.free_bytes == free
    got = c.run(lambda cl: cl.neighbor_allreduce(torch.full((3,), 2.0 * cl.rank), name="spent"))
    assert torch.equal(got[0], torch.ones(3))  # both ranks on round 0


def test_orphan_send_does_not_pin_receiver_memory(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    a, b = c.clients
    with pytest.raises(DecentError, match="timed out"):
        a.neighbor_allreduce(torch.zeros(1 << 18), name="orphan", self_weight=1.0,
                             src_weights={}, dst_weights=[1], timeout=1)
    deadline = time.monotonic() + 10
    while b.status().early_arrival_bytes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert b.status().early_arrival_bytes == 0


def test_receive_window_bounds_early_data_and_nothing_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a sender cannot push more than the receiver's window of data nobody asked for yet: the
    # rest waits (RTS) until the receiving ops run, and then everything completes exactly
    monkeypatch.setenv("DECENT_FUSION_THRESHOLD", "0")  # one message per op
    c = Cluster(2, "ring", "--set", "memory.early_arrival_bytes=1048576")
    try:
        c.connect()
        a, b = c.clients
        n = 1 << 18  # 1 MiB of float32
        hs = [a.neighbor_allreduce_async(torch.full((n,), float(i)), name=f"push{i}",
                                         self_weight=1.0, src_weights={}, dst_weights=[1],
                                         timeout=60)
              for i in range(6)]
        deadline = time.monotonic() + 30
        while not b.status().early_arrival_bytes and time.monotonic() < deadline:
            time.sleep(0.05)  # the sender pushes what the receiver's window takes
        time.sleep(0.5)  # and would push more now without the bound
        assert 0 < b.status().early_arrival_bytes <= 1 << 20
        assert not any(h.done() for h in hs)
        for i in reversed(range(6)):  # the last pushed first: its data was held back
            got = b.neighbor_allreduce(torch.ones(n), name=f"push{i}", self_weight=0.5,
                                       src_weights={0: 0.5}, dst_weights=[], timeout=30)
            assert torch.equal(got, torch.full((n,), 0.5 + 0.5 * i))
        for i, h in enumerate(hs):
            assert torch.equal(h.wait(timeout=30), torch.full((n,), float(i)))
        assert b.status().early_arrival_bytes == 0
    finally:
        assert c.stop() == [0, 0]


def _average_w(cl: Client[torch.Tensor], offset: int) -> torch.Tensor:
    return cl.neighbor_allreduce(torch.full((2,), 2.0 * cl.rank + offset), name="w")


@pytest.mark.parametrize("job_ids", [False, True])
def test_new_job_on_long_lived_daemons_reuses_names(job_ids: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # without job ids the daemons forget a job's history when its last worker leaves; with them
    # (decentrun sets $DECENT_JOB per launch) the jobs' messages can never meet at all
    c = Cluster(2, "ring")
    try:
        for job in range(2):
            monkeypatch.setenv("DECENT_JOB", f"job{job}" if job_ids else "")
            c.connect()
            got = c.run(functools.partial(_average_w, offset=job))
            assert torch.equal(got[0], torch.full((2,), 1.0 + job)), job
            for cl in c.clients:
                cl.close()
            # close() returns once the daemon let the worker go: the next job may start now
            assert [c.status(i).workers for i in range(c.n)] == [0, 0]
    finally:
        c.clients = []
        assert c.stop() == [0, 0]


@pytest.mark.parametrize("numel", [8, 1 << 17])  # direct and ring
def test_allreduce_does_not_overflow_narrow_dtypes(cluster: ClusterFactory, numel: int) -> None:
    c = cluster(2, "ring")
    cases = [(torch.float16, 40000.0), (torch.int32, 2_000_000_000)]
    def work(cl: Client[torch.Tensor], d: torch.dtype, v: float) -> torch.Tensor:
        return cl.allreduce(torch.full((numel,), v, dtype=d), name=f"wide{d}{numel}")

    for dtype, value in cases:
        got = c.run(functools.partial(work, d=dtype, v=value))
        want = torch.full((numel,), value, dtype=dtype)
        for out in got:
            assert torch.equal(out, want), (dtype, out[:3])
    big = c.run(lambda cl: cl.allreduce(torch.full((numel,), 1 if cl.rank else 2**53,
                                                    dtype=torch.int64), op="sum",
                                        name=f"i64{numel}"))
    assert int(big[0][0]) == 2**53 + 1  # exact: integers are never summed in floating point
    half = c.run(lambda cl: cl.allreduce(torch.full((numel,), 1 + cl.rank, dtype=torch.int32),
                                         name=f"half{numel}"))
    assert int(half[0][0]) == 2  # (1 + 2) / 2 rounds half up
    huge = c.run(lambda cl: cl.allreduce(torch.full((numel,), 2**61, dtype=torch.int64),
                                         name=f"huge{numel}"))
    assert int(huge[1][0]) == 2**61  # the average of a sum near 2^62 does not overflow


def test_malformed_frame_closes_only_that_connection() -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        script = textwrap.dedent(f"""
            import socket, grpc
            from decent_wire.v1 import decent_pb2 as pb, decent_pb2_grpc as pbg
            stub = pbg.PeerStub(grpc.insecure_channel("{c.peers[0]}"))
            from decent_wire.topology import build_topology
            port = stub.Handshake(pb.HandshakeRequest(
                cluster_id="decent", protocol_version=pb.PROTOCOL_VERSION_CURRENT, from_rank=1,
                to_rank=0, workers_per_node=1,
                machine_topology_digest=build_topology("ring", 2).digest(),
                topology_digest=build_topology("ring", 2).digest())).data_port
            def frame(h):
                body = h.SerializeToString()
                return len(body).to_bytes(4, "little") + body
            tries = {{
                "huge header": b"\\xff\\xff\\xff\\x7f" + b"x" * 64,
                "garbage header": b"\\x08\\x00\\x00\\x00" + b"\\xff" * 8,
                "data before hello": frame(pb.BulkHeader(kind=pb.DATA, payload_bytes=4)) + b"1234",
                "impostor": frame(pb.BulkHeader(kind=pb.HELLO, cluster_id="decent", from_rank=1)),
                "other cluster": frame(pb.BulkHeader(kind=pb.HELLO, cluster_id="x", from_rank=1)),
            }}
            for what, data in tries.items():
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(data)
                s.settimeout(10)
                print(what, "closed" if s.recv(1) == b"" else "open")
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=60)
        assert proc.stdout.count("closed") == 5, proc.stdout + proc.stderr
        assert "malformed frame" in c.log(0)
        assert c.procs[0].poll() is None  # the daemon lives on
        got = c.run(lambda cl: cl.neighbor_allreduce(torch.full((2,), 2.0 * cl.rank),
                                                     name="afterevil", timeout=20))
        assert torch.equal(got[0], torch.ones(2))  # and the real rank 1 is still its peer
    finally:
        c.stop()


def test_an_arena_the_node_cannot_reserve_is_a_clear_error(tmp_path: Path) -> None:
    # a 16 MiB file-size limit stands for a node short of memory: the daemon's 64 MiB arena
    # cannot be reserved, the worker is told why and how to fix it, and the daemon lives on
    sock = str(tmp_path / "d.sock")

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))

    d = subprocess.Popen([sys.executable, "-m", "decentd", "--socket", sock,
                          "--set", "memory.arena_bytes=67108864"], preexec_fn=small_files,
                         stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(DecentError) as refused:
            dt.connect("unix://" + sock, connect_timeout=30)
        assert refused.value.code == pb.RESOURCE_EXHAUSTED, refused.value
        assert "memory.arena_bytes" in refused.value.message, refused.value
        assert d.poll() is None
    finally:
        d.terminate()
        _, err = d.communicate(timeout=30)
    assert d.returncode == 0, err


def test_numpy_codec_roundtrip(cluster: ClusterFactory) -> None:
    from decent.core import NumpyCodec

    c = cluster(2, "ring")
    clients = [Client(NumpyCodec(), f"unix://{s}") for s in c.sockets]
    try:
        xs = [np.arange(5, dtype=np.int32) * (r + 1) for r in range(2)]
        hs = [cl.allreduce_async(xs[cl.rank], op="sum", name="np") for cl in clients]
        for h in hs:
            out = h.wait(timeout=30)
            assert out.dtype == np.int32 and out.tolist() == [0, 3, 6, 9, 12]
    finally:
        for cl in clients:
            cl.close()


def test_failed_ops_free_their_arena_space_for_blocked_submits() -> None:
    c = Cluster(2, "ring", "--set", "memory.arena_bytes=1048576")
    try:
        c.connect()
        a = c.clients[0]
        # rank 1 never joins: the first op fails after 2 s, and the second submit, which did not
        # fit next to it, must then get its space instead of blocking for ever
        first = a.neighbor_allreduce_async(torch.zeros(150_000), name="full1", timeout=2)
        second = a.neighbor_allreduce_async(torch.zeros(150_000), name="full2", timeout=2)
        for h in (first, second):  # a second that never got its space would not time out
            with pytest.raises(DecentError, match="timed out after 2s"):
                h.wait(timeout=30)
    finally:
        c.stop()


def test_ranks_taking_different_paths_fail_fast_with_mismatch(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")

    def roots(cl: Client[torch.Tensor]) -> torch.Tensor:
        return cl.broadcast(torch.zeros(4), root=cl.rank, name="tworoots", timeout=30)

    def sizes(cl: Client[torch.Tensor]) -> torch.Tensor:  # direct on one rank, ring on the other
        return cl.allreduce(torch.zeros(100 if cl.rank == 0 else 100_000), name="paths",
                            timeout=30)

    for fn, words in ((roots, "rank 1 broadcast float32[4] (root: 1)"), (sizes, "float32[100]")):
        errors = c.run_catching(fn)  # MISMATCH at once, not each rank's 30 s TIMEOUT
        assert any(isinstance(e, DecentError) and e.code_name == "MISMATCH" and words in e.message
                   for e in errors), errors
        assert all(isinstance(e, DecentError) for e in errors), errors


def test_allgather_output_sized_by_in_degree(cluster: ClusterFactory) -> None:
    # 5 ranks, 32 MiB arenas: 8 MiB in + 2 in-neighbors x 8 MiB out fits; (size-1) x 8 would not
    c = cluster(5, "ring")
    got = c.run(lambda cl: cl.neighbor_allgather(torch.full((2 << 20,), float(cl.rank)),
                                                 name="agbig"))
    for i, out in enumerate(got):
        assert out.shape == (2, 2 << 20)
        assert float(out[0, 0]) == sorted({(i - 1) % 5, (i + 1) % 5})[0]


def test_bad_memory_registrations_fail_alone(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    cl = c.clients[0]

    def call(req: object, fds: list[int]) -> str:
        body = req if isinstance(req, bytes) else req.SerializeToString()  # type: ignore[attr-defined]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(cl.connection.registration.memory_socket)
            socket.send_fds(s, [len(body).to_bytes(4, "little") + body], fds)
            reply = s.recv(4096)
        err = pb.Error.FromString(reply[4:])
        return f"{pb.ErrorCode.Name(err.code)}: {err.message}"

    def memfd(size: int) -> int:
        fd = os.memfd_create("decent-test")
        os.ftruncate(fd, size)
        return fd

    high = 1 << 50
    fds = [memfd(4096), memfd(4096), memfd(8192), memfd(4096)]
    try:
        got = {
            "garbage": call(b"\xff" * 16, []),
            "unknown worker": call(pb.MemoryRequest(worker_id="nobody", base=high, nbytes=4096),
                                   [fds[0]]),
            "no fd": call(pb.MemoryRequest(worker_id=cl.worker_id, base=high, nbytes=4096), []),
            "file too small": call(pb.MemoryRequest(worker_id=cl.worker_id, base=high,
                                                    nbytes=1 << 20), [fds[0]]),
            "inside the arena": call(pb.MemoryRequest(worker_id=cl.worker_id, base=0,
                                                      nbytes=4096), [fds[1]]),
            "good": call(pb.MemoryRequest(worker_id=cl.worker_id, base=high, nbytes=8192),
                         [fds[2]]),
            "overlap": call(pb.MemoryRequest(worker_id=cl.worker_id, base=high + 4096,
                                             nbytes=4096), [fds[3]]),
        }
    finally:
        for fd in fds:
            os.close(fd)
    assert got["garbage"].startswith("INVALID_ARGUMENT: undecodable"), got
    assert got["unknown worker"].startswith("UNKNOWN_WORKER"), got
    assert got["no fd"].startswith("INVALID_ARGUMENT") and "one file descriptor" in got["no fd"]
    assert "fewer than the 1048576 registered" in got["file too small"], got
    assert "above the" in got["inside the arena"], got
    assert got["good"] == "OK: ", got
    assert "overlaps" in got["overlap"], got
    assert cl.status().registered_bytes >= 8192
    assert c.procs[0].poll() is None
    got2 = c.run(lambda k: k.neighbor_allreduce(torch.full((2,), 2.0 * k.rank), name="aftermem"))
    assert torch.equal(got2[0], torch.ones(2))
    cl.connection.memory_call(pb.MemoryRequest(worker_id=cl.worker_id, release=[high]), None)
