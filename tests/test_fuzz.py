"""Fuzzing every door of a running daemon (issue 24): at least 10,000 malformed or adversarial
messages on the peer gRPC service, the bulk port before and after authentication, the worker
data channel and the memory socket, while two real workers average exactly.

The generator and driver are ``scripts/fuzz.py`` (``make fuzz`` runs a longer campaign with the
same code): a cluster of daemons 0 and 1 in secret mode and this process as rank 2, which holds
the secret, so that it also attacks the bulk path after a proven HELLO. Each bug the fuzzer found
is reproduced on its own below, as a regression test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest

from decent.core import Client, NumpyCodec
from decent_wire import framing
from decent_wire.errors import DecentError
from decent_wire.protocol import PROTOCOL_VERSION
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _load_fuzz() -> ModuleType:
    """``scripts/fuzz.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("fuzz", REPO / "scripts" / "fuzz.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzz()

#: messages of the campaign, and its seed (fixed: the same messages every run)
COUNT = 12_000
SEED = 24
#: the whole campaign must end within this (seconds; it takes about 10 on two cores)
BUDGET = 45.0


@pytest.fixture
def fuzz_cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Daemons 0 and 1, their real workers connected, and this process as rank 2. Their logs
    are kept (and named) when the test fails."""
    failed = request.session.testsfailed
    cluster = fuzz.FuzzCluster()
    try:
        cluster.connect()
        yield cluster
    finally:
        cluster.stop()
        if request.session.testsfailed == failed:
            shutil.rmtree(cluster.dir, ignore_errors=True)
        else:
            print(f"\ndaemon logs kept in {cluster.dir}")


@pytest.mark.serial
def test_ten_thousand_hostile_messages_leave_the_daemons_up_and_every_op_exact(
        fuzz_cluster: Any) -> None:
    start = time.monotonic()
    out = fuzz.run_campaign(fuzz_cluster, COUNT, SEED, BUDGET)
    elapsed = time.monotonic() - start
    counts = out.tally.as_dict()["targets"]
    summary = {t: counts[t]["messages"] for t in fuzz.TARGETS}
    print(f"\nfuzz: {out.tally.total()} messages in {out.tally.seconds:.1f} s {summary}; "
          f"{out.ops} exact ops; RSS {[(b >> 20, a >> 20) for b, a in out.rss]} MiB; "
          f"fds {out.fds}")
    assert fuzz.verdict(out) == []  # alive, exact, no violation, RSS/fds bounded, clean logs
    assert out.tally.total() >= 10_000 and elapsed < 60, (out.tally.total(), elapsed)
    for target, quota in fuzz.quotas(COUNT).items():
        assert summary[target] >= quota, (target, summary[target], quota)
    # the hostile frames after a proven HELLO reached the daemons' frame handling
    proven = counts["bulk-auth"]["kinds"].get("HELLO as rank 2", 0)
    assert proven >= 100, counts["bulk-auth"]
    assert sum(fuzz_cluster.log(i).count("bulk connection from rank 2:") for i in (0, 1)) \
        >= proven // 2
    assert out.ops >= 100  # exact ops ran all along
    assert fuzz_cluster.stop() == [0, 0]  # and the daemons still stop cleanly


# ---------------------------------------------------------------------------- found by fuzzing


def test_a_window_write_of_an_unknown_dtype_closes_only_its_connection(fuzz_cluster: Any) -> None:
    """Found by the fuzzer (fixed since): an early window write of dtype 0 left a window of
    that dtype behind, and every Status call after it failed with KeyError."""
    with fuzz_cluster.as_rank2(0) as s:
        part = pb.Part(name="fz\x1fw\x1e0", op=pb.WIN_PUT, tag=0, src=fuzz.FAKE_RANK,
                       meta=pb.TensorMeta(dtype=pb.DTYPE_UNSPECIFIED, shape=[4]))
        s.sendall(framing.encode(pb.BulkHeader(kind=pb.DATA, message_id=1, parts=[part])))
        assert fuzz.wait_closed(s, 10)
    assert fuzz_cluster.status(0).rss_bytes > 0  # Status still answers
    _exact_pair(fuzz_cluster)
    assert fuzz.log_problems(fuzz_cluster.log(0)) == []


def test_undecodable_peer_requests_leave_no_traceback_in_the_log(fuzz_cluster: Any) -> None:
    # found by the fuzzer (fixed since): grpc logged a DecodeError traceback per request
    with grpc.insecure_channel(f"127.0.0.1:{fuzz_cluster.grpc_ports[0]}") as channel:
        for method, reply in (("/decent.v1.Peer/Challenge", pb.ChallengeReply),
                              ("/decent.v1.Peer/Handshake", pb.HandshakeReply)):
            call = channel.unary_unary(method, request_serializer=_raw, response_deserializer=_raw)
            # not a ChallengeRequest, nor a HandshakeRequest: refused like an empty one
            answer = reply.FromString(call(b"\xff\xff", timeout=30))
            assert answer.error.code == pb.UNAUTHENTICATED, answer
    assert fuzz.TRACEBACK not in fuzz_cluster.log(0)


def test_a_broadcast_into_a_small_output_region_is_an_arena_error(fuzz_cluster: Any) -> None:
    w = fuzz_cluster.attach(0, "fz-broadcast")
    with w.data:
        w.data.sendall(framing.encode(pb.SubmitRequest(
            request_id=1, timeout_s=10, broadcast=pb.Broadcast(root=1), tensors=[pb.TensorRef(
                name="x", meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=[1024]), offset=0,
                nbytes=4096, out_offset=8192, out_capacity=8)])))
        bodies, _ = fuzz.read_frames_until(w.data, 1, 30)
    done = framing.decode(pb.Completion, bodies[0])
    # as every other op says: "result of 4096 bytes does not fit the 8-byte output region"
    assert done.error.code == pb.ARENA_ERROR, done.error
    assert fuzz.TRACEBACK not in fuzz_cluster.log(0)


def _refused_beside(cluster: Any, job: str, theirs: Callable[[Client, str], Any]
                    ) -> tuple[pb.Error, DecentError]:
    """Daemon 0's worker submits an allreduce of ``x`` into an 8-byte output region (its
    daemon cannot run it) while daemon 1's calls ``theirs(client, "x")``: both errors, checked
    to come long before the 30 s timeout."""
    w = cluster.attach(0, job)
    peer = Client(NumpyCodec(), f"unix://{cluster.sockets[1]}", 60, job=job)
    try:
        with w.data:
            began = time.monotonic()
            w.data.sendall(framing.encode(pb.SubmitRequest(
                request_id=1, timeout_s=30, allreduce=pb.Allreduce(), tensors=[pb.TensorRef(
                    name="x", meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=[16]), offset=0,
                    nbytes=64, out_offset=8192, out_capacity=8)])))
            with pytest.raises(DecentError) as caught:
                theirs(peer, "x")
            bodies, _ = fuzz.read_frames_until(w.data, 1, 30)
        assert time.monotonic() - began < 20  # nobody waited for data that never comes
    finally:
        peer.close()
    return framing.decode(pb.Completion, bodies[0]).error, caught.value


def test_an_allreduce_into_a_small_output_region_fails_every_rank_alike(
        fuzz_cluster: Any) -> None:
    """A direct allreduce among two daemons agrees in its own exchange: the daemon whose worker
    gave too small an output region sends its description alone, and both ranks fail at once
    with the same verdict."""
    mine, theirs = _refused_beside(fuzz_cluster, "fz-allreduce", lambda cl, name: cl.allreduce(
        np.ones(16, np.float32), name=name, timeout=30))
    assert mine.code == pb.ARENA_ERROR == theirs.code, (mine, theirs)
    assert mine.message == theirs.message, (mine, theirs)
    assert "rank 0 cannot run it: " in mine.message
    assert "does not fit the 8-byte output region" in mine.message
    _exact_pair(fuzz_cluster)


def test_a_refused_allreduce_and_a_broadcast_under_its_name_fail_alike_at_once(
        fuzz_cluster: Any) -> None:
    """The daemon that cannot run its allreduce sends its descriptions where an agreement
    takes them: the broadcast's daemon, which agrees beside its op, fails with the same
    verdict at once, not at its timeout."""
    mine, theirs = _refused_beside(fuzz_cluster, "fz-refused", lambda cl, name: cl.broadcast(
        np.ones(16, np.float32), root=1, name=name, timeout=30))
    assert mine.code == pb.ARENA_ERROR == theirs.code, (mine, theirs)
    assert mine.message == theirs.message, (mine, theirs)
    assert "rank 0 cannot run it: " in mine.message


def test_a_worker_that_sent_past_the_window_leaves_no_arena_behind(fuzz_cluster: Any) -> None:
    pid = fuzz_cluster.procs[0].pid

    def arenas() -> int:  # shared-memory arenas mapped by daemon 0
        with open(f"/proc/{pid}/maps") as f:
            return sum("/memfd:decent-" in line for line in f)

    before = arenas()
    clients = [Client(NumpyCodec(), f"unix://{s}", 60, job="fz-leak")
               for s in fuzz_cluster.sockets]
    x = np.ones(600_000, np.float32)  # 2.4 MB: past the 2 MiB window, so RTS, CTS, PAYLOAD
    sent = clients[0].neighbor_allreduce_async(x, name="big", self_weight=1.0, src_weights={},
                                               dst_weights={1: 1.0})
    got = clients[1].neighbor_allreduce_async(x, name="big", self_weight=0.5,
                                              src_weights={0: 0.5}, dst_weights={})
    assert np.array_equal(sent.wait(timeout=60), x) and np.array_equal(got.wait(timeout=60), x)
    for c in clients:
        c.close()
    deadline = time.monotonic() + 5
    while arenas() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert arenas() == before  # the sender's arena is unmapped once its worker left


def test_text_from_a_local_worker_is_cut_in_the_log(fuzz_cluster: Any) -> None:
    long = "\x1b" * 5000
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(fuzz_cluster.sockets[0] + ".data")
        s.sendall(framing.encode(pb.WorkerHello(worker_id=long)))
        assert fuzz.wait_closed(s, 10)
    with grpc.insecure_channel(f"unix://{fuzz_cluster.sockets[0]}") as channel:
        reply = pb_grpc.WorkerStub(channel).Register(pb.RegisterRequest(
            protocol_version=PROTOCOL_VERSION, pid=1, framework=long, job=long), timeout=30)
    if reply.error.code == pb.OK:  # attach and leave at once
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(fuzz_cluster.sockets[0] + ".data")
            s.sendall(framing.encode(pb.WorkerHello(worker_id=reply.worker_id)))
            fuzz.read_frames_until(s, 1, 10)
    longest = max(len(line) for line in fuzz_cluster.log(0).splitlines())
    assert longest <= fuzz.LONG_LINE, longest


def test_a_memory_connection_pins_few_descriptors(fuzz_cluster: Any) -> None:
    base = fuzz_cluster.open_fds(0)
    memfd = os.memfd_create("fz")
    held = 0
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(fuzz_cluster.sockets[0] + ".mem")
            s.sendall((1 << 20).to_bytes(4, "little"))  # a frame of 1 MiB, sent a byte at a time
            with contextlib.suppress(OSError):  # the daemon may close the connection
                for _ in range(500):
                    socket.send_fds(s, [b"\0"], [memfd] * 4)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and held <= 64:
                held = fuzz_cluster.open_fds(0) - base
                time.sleep(0.05)
    finally:
        os.close(memfd)
    assert held <= 64, f"one connection pins {held} descriptors in the daemon"


def _raw(b: bytes) -> bytes:
    return b


def _exact_pair(cluster: Any) -> None:
    """One exact pairwise average between the real workers."""
    fuzz.PairOps(cluster.clients).step(1)


@pytest.mark.parametrize("op", [
    dict(allreduce=pb.Allreduce()),
    dict(neighbor_allreduce=pb.NeighborAllreduce(  # sends its tensor: it must be there
        self_weight=0.0, src_weights=pb.RankWeights(), dst_weights=pb.RankWeights(weights={1: 1}))),
    dict(neighbor_allreduce=pb.NeighborAllreduce(  # keeps half of its own
        self_weight=0.5, src_weights=pb.RankWeights(), dst_weights=pb.RankWeights())),
], ids=["allreduce", "nar sending", "nar keeping half"])
def test_a_request_that_leaves_out_an_input_it_reads_is_refused(fuzz_cluster: Any,
                                                                  op: dict) -> None:
    w = fuzz_cluster.attach(0, "fz-blank")
    with w.data:
        w.data.sendall(framing.encode(pb.SubmitRequest(
            request_id=1, timeout_s=10, tensors=[pb.TensorRef(
                name="x", meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=[1024]), offset=0,
                nbytes=4096, out_offset=0, out_capacity=4096, blank=True)], **op)))
        bodies, _ = fuzz.read_frames_until(w.data, 1, 30)
    done = framing.decode(pb.Completion, bodies[0])
    assert done.error.code == pb.INVALID_ARGUMENT, done.error
    assert re.search(r"tensor 'x'|'x' round 0", done.error.message), done.error
    assert re.search(r"input (was )?left out|leave its input out", done.error.message)
    _exact_pair(fuzz_cluster)
