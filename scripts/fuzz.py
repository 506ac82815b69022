"""Adversarial messages at every door of a running daemon, while two real workers average.

    python scripts/fuzz.py --count 200000 [--seed S] [--json FILE]   # `make fuzz`

A cluster of three ranks in ``secret`` mode on loopback: ranks 0 and 1 are real daemons, rank 2
is this process (:class:`FakePeer`: it answers their challenge and handshake with the cluster
secret and drains their bulk connections). Because it holds the secret, the fuzzer can also
authenticate as rank 2 and attack the bulk path *after* the HELLO. The messages go to five
targets, each from its own thread and its own ``random.Random`` (structured generation: every
message is built from the protocol's own messages with hostile field values, so it gets past
the framing into the code behind it):

* ``peer-grpc``: Challenge and Handshake with random and malformed fields, wrong and replayed
  nonces, spoofed ranks, proofs under a wrong secret, huge strings (within gRPC's 16 MiB),
  replays of the fuzzer's own successful handshakes, undecodable request bodies, unknown
  methods, and raw garbage bytes on the gRPC TCP port;
* ``bulk-unauth``: the bulk port before a valid HELLO: random bytes, length prefixes of every
  size, HELLOs with bad proofs, spoofed ranks, other cluster ids, replayed HELLOs, valid-looking
  frames before any HELLO, and a flood past the 64 unproven connections;
* ``bulk-auth``: Challenge, Handshake and HELLO as rank 2 (a fresh session key per connection),
  then hostile frames of every kind (random parts, sizes, ranks, dtypes, shapes, message ids,
  credits, payload_bytes lies, truncated payloads), ended by a frame that makes the daemon close
  the connection;
* ``worker-data``: the worker data channel: garbage, oversized prefixes, hellos with unknown or
  taken worker ids, then, as a registered worker, SubmitRequests with random ops and arguments,
  tensor refs off the arena, bad dtypes and shapes, hostile names and topology specs; spoofed
  registrations (the real job's taken local rank, wrong protocol);
* ``memory-socket``: MemoryRequests with and without descriptors (/dev/null, pipes, a directory,
  a socket, read-only and memfd files, a closed-then-reused number, up to 250 descriptors in one
  message, descriptors spread over many messages), bogus bases and sizes, split and oversized
  frames.

Every message is counted by target and kind. Answers that must be refusals are checked (a
handshake without a valid proof must not be admitted, a bulk connection that sent a complete
frame without proving its HELLO must be closed, a memory registration without exactly one usable
descriptor must fail, ...): any other answer is a *violation*. Meanwhile the real workers run
exact pairwise averages (four in flight per worker, up to 2.4 MB). A campaign passes when the
daemons are alive, every average was exact, nothing was violated, RSS grew by less than 64 MiB,
open descriptors by less than 16, no daemon logged a Python traceback or a line over 1 KiB, and
both stop cleanly at SIGTERM. ``tests/test_fuzz.py`` runs a short campaign, and one regression
test per bug the fuzzer found.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import message_factory

from decent.core import Client, NumpyCodec
from decent_wire import framing
from decent_wire.protocol import PROTOCOL_VERSION
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.security.auth import NONCE_BYTES, PeerAuth, new_nonce, write_secret
from decentd.tools.launcher import free_ports

TARGETS = ("peer-grpc", "bulk-unauth", "bulk-auth", "worker-data", "memory-socket")
#: each target's share of the messages
SHARES = {"peer-grpc": 0.2, "bulk-unauth": 0.25, "bulk-auth": 0.25, "worker-data": 0.2,
          "memory-socket": 0.1}
CLUSTER_ID = "decent"
FAKE_RANK = 2
#: the daemons' bounds, small enough that "RSS stays bounded" means something
DAEMON_SETTINGS = ("memory.arena_bytes=8388608", "memory.early_arrival_bytes=4194304",
                   "memory.pool_bytes=16777216", "memory.window_early_bytes=4194304",
                   "timeouts.op=20", "timeouts.auth=5", "timeouts.start=60",
                   # rank 2 is this process: it reaches the daemons only when it attacks
                   "faults.min_nodes=2")
GRPC_LIMIT = 16 << 20
EDGE_INTS = (0, 1, -1, 2, 3, 7, 255, 256, 4095, 4096, 4097, 65535, 65536, 2**31 - 1, -(2**31),
             2**32 - 1, 2**32, 2**53, 2**63 - 1, -(2**63), 2**64 - 1)
EDGE_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-300, 5e-324, 1e300, 1.7976931348623157e308,
               float("nan"), float("inf"), float("-inf"))
ONE_SIDED = (pb.WIN_PUT, pb.WIN_ACCUMULATE, pb.WIN_GET, pb.WIN_EXCHANGE, pb.GROUP_TRIGGER,
             pb.GROUP_RESULT, pb.WIN_LOCK, pb.WIN_UNLOCK)
SUBMIT_OPS = [f.name for f in pb.SubmitRequest.DESCRIPTOR.oneofs_by_name["op"].fields]
#: bugs this fuzzer found, all fixed, each with a regression test in tests/test_fuzz.py:
#: grpc-undecodable, broadcast-out, rts-arena-leak, worker-text, window-dtype, memory-fds


# ---------------------------------------------------------------------------- bookkeeping


@dataclass
class Tally:
    """Messages sent (by target and kind), outcomes, and violations; shared by the threads."""

    sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, target: str, kind: str, n: int = 1) -> None:
        with self._lock:
            self.sent[(target, kind)] += n

    def outcome(self, target: str, what: str) -> None:
        with self._lock:
            self.outcomes[(target, what)] += 1

    def violation(self, target: str, what: str) -> None:
        with self._lock:
            if len(self.violations) < 200:
                self.violations.append(f"{target}: {what}")

    def total(self, target: str | None = None) -> int:
        with self._lock:
            return sum(n for (t, _), n in self.sent.items() if target in (None, t))

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"seconds": round(self.seconds, 1), "targets": {}}
            for target in TARGETS:
                kinds = {k: n for (t, k), n in sorted(self.sent.items()) if t == target}
                results = {k: n for (t, k), n in sorted(self.outcomes.items()) if t == target}
                out["targets"][target] = {"messages": sum(kinds.values()), "kinds": kinds,
                                          "outcomes": results}
            out["total"] = sum(self.sent.values())
            out["violations"] = list(self.violations)
            return out


# ---------------------------------------------------------------------------- generators


class Gen:
    """Hostile values for protocol fields, from one seeded ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def pick(self, seq: Any) -> Any:
        return self.r.choice(seq)

    def blob(self, most: int = 64) -> bytes:
        return self.r.randbytes(self.r.randint(0, most))

    def int_in(self, lo: int, hi: int) -> int:
        """Mostly edge values within [lo, hi], else uniform."""
        if self.chance(0.6):
            edges = [v for v in EDGE_INTS if lo <= v <= hi]
            if edges:
                return int(self.pick(edges))
        if self.chance(0.5):
            return self.r.randint(max(lo, -8), min(hi, 64))
        return self.r.randint(lo, hi)

    def i32(self) -> int:
        return self.int_in(-(2**31), 2**31 - 1)

    def u32(self) -> int:
        return self.int_in(0, 2**32 - 1)

    def u64(self) -> int:
        return self.int_in(0, 2**64 - 1)

    def real(self) -> float:
        return float(self.pick(EDGE_FLOATS)) if self.chance(0.5) else self.r.uniform(-10, 10)

    def rank(self) -> int:
        return int(self.pick((0, 1, 2, 2, 3, -1, 99, 2**31 - 1, -(2**31)))) \
            if self.chance(0.8) else self.i32()

    def text(self, most: int = 48) -> str:
        """Text of a hostile kind: separators of wire keys, control characters, unicode."""
        n = self.r.randint(0, most)
        alphabet = self.pick(("abcxyz019._-", "\x00\x1b\n\r\t\x1d\x1e\x1f\x7f%s{}'\"\\",
                              "\u00e9\u4e2d\U0001f600\u202e\ufeff\u0301", "\x1e\x1fn0123"))
        return "".join(self.r.choice(alphabet) for _ in range(n))

    def shape(self) -> list[int]:
        if self.chance(0.5):
            return [self.r.randint(0, 8) for _ in range(self.r.randint(0, 3))]
        return [self.int_in(-(2**63), 2**63 - 1) for _ in range(self.r.randint(0, 6))]

    def dtype(self) -> int:
        return self.r.randint(0, 9) if self.chance(0.8) else self.i32()


def u64(n: int) -> int:
    """``n`` clipped into a uint64 field."""
    return max(0, min(n, 2**64 - 1))


def random_message(cls: Any, gen: Gen, depth: int = 0) -> Any:
    """A protobuf message of type ``cls`` with every field set at random (recursively)."""
    msg = cls()
    fd = msg.DESCRIPTOR
    for f in fd.fields:
        if f.containing_oneof is not None or not gen.chance(0.7):
            continue
        try:
            _fill(msg, f, gen, depth)
        except (ValueError, TypeError):  # a value the field rejects: leave it unset
            continue
    for oneof in fd.oneofs:  # a real oneof, or a proto3 optional field's own
        if oneof.fields and gen.chance(0.7):
            with contextlib.suppress(ValueError, TypeError):
                _fill(msg, gen.pick(oneof.fields), gen, depth)
    return msg


def _scalar(f: Any, gen: Gen) -> Any:
    t = f.type
    fdesc = f.__class__
    if t in (fdesc.TYPE_INT32, fdesc.TYPE_SINT32, fdesc.TYPE_SFIXED32, fdesc.TYPE_ENUM):
        return gen.i32()
    if t in (fdesc.TYPE_UINT32, fdesc.TYPE_FIXED32):
        return gen.u32()
    if t in (fdesc.TYPE_INT64, fdesc.TYPE_SINT64, fdesc.TYPE_SFIXED64):
        return gen.int_in(-(2**63), 2**63 - 1)
    if t in (fdesc.TYPE_UINT64, fdesc.TYPE_FIXED64):
        return gen.u64()
    if t in (fdesc.TYPE_DOUBLE, fdesc.TYPE_FLOAT):
        return gen.real()
    if t == fdesc.TYPE_BOOL:
        return gen.chance(0.5)
    if t == fdesc.TYPE_STRING:
        return gen.text()
    if t == fdesc.TYPE_BYTES:
        return gen.blob()
    raise TypeError(f"field type {t}")


def _fill(msg: Any, f: Any, gen: Gen, depth: int) -> None:
    is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
    if is_map:
        key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        for _ in range(gen.r.randint(0, 3)):
            getattr(msg, f.name)[_scalar(key_f, gen)] = _scalar(val_f, gen)
    elif f.message_type is not None:
        if depth > 3:
            return
        cls = message_factory.GetMessageClass(f.message_type)
        if f.is_repeated:
            for _ in range(gen.r.randint(0, 3)):
                getattr(msg, f.name).add().CopyFrom(random_message(cls, gen, depth + 1))
        else:
            getattr(msg, f.name).CopyFrom(random_message(cls, gen, depth + 1))
    elif f.is_repeated:
        getattr(msg, f.name).extend(_scalar(f, gen) for _ in range(gen.r.randint(0, 5)))
    else:
        setattr(msg, f.name, _scalar(f, gen))


# ---------------------------------------------------------------------------- rank 2


class _PeerServicer(pb_grpc.PeerServicer):
    """Rank 2's side of the daemons' handshakes: a daemon that holds the secret."""

    def __init__(self, fake: FakePeer) -> None:
        self.fake = fake

    def Challenge(self, request: pb.ChallengeRequest, context: Any) -> pb.ChallengeReply:
        if request.to_rank != FAKE_RANK or len(request.client_nonce) != NONCE_BYTES:
            return pb.ChallengeReply(error=pb.Error(code=pb.UNAUTHENTICATED, message="no"))
        with self.fake.lock:
            nonce, proof = self.fake.auth.challenge(request.from_rank, FAKE_RANK,
                                                    request.client_nonce)
        return pb.ChallengeReply(server_nonce=nonce, server_proof=proof)

    def Handshake(self, request: pb.HandshakeRequest, context: Any) -> pb.HandshakeReply:
        with self.fake.lock:
            why = self.fake.auth.admit_handshake(request.from_rank, FAKE_RANK,
                                                 request.server_nonce, request.proof)
        if why is not None:
            return pb.HandshakeReply(error=pb.Error(code=pb.UNAUTHENTICATED, message=why))
        self.fake.digests = (request.topology_digest, request.machine_topology_digest)
        return pb.HandshakeReply(rank=FAKE_RANK, data_port=self.fake.drain_port,
                                 window_bytes=1 << 30)


class FakePeer:
    """This process as rank 2: a gRPC Peer service and a bulk port that reads and drops."""

    def __init__(self, secret: bytes, grpc_port: int) -> None:
        self.auth = PeerAuth("secret", CLUSTER_ID, secret)
        self.lock = threading.Lock()
        self.digests: tuple[str, str] | None = None
        self._drain = socket.create_server(("127.0.0.1", 0))
        self.drain_port = int(self._drain.getsockname()[1])
        self._server = grpc.server(ThreadPoolExecutor(4), options=[
            ("grpc.max_receive_message_length", GRPC_LIMIT), ("grpc.so_reuseport", 0)])
        pb_grpc.add_PeerServicer_to_server(_PeerServicer(self), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        self._server.start()
        threading.Thread(target=self._accept, daemon=True, name="fake-drain").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._drain.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while conn.recv(1 << 20):
                pass

    def close(self) -> None:
        self._server.stop(grace=None)
        self._drain.close()


# ---------------------------------------------------------------------------- the cluster


class FuzzCluster:
    """Daemons 0 and 1 (real processes, secret mode) and rank 2 (:class:`FakePeer`)."""

    def __init__(self, workdir: str | None = None, *extra: str) -> None:
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="decent-fuzz-"))
        self.secret_path = write_secret(self.dir / "secret")
        self.secret = self.secret_path.read_bytes().strip()
        ports = free_ports(5)
        self.grpc_ports, self.data_ports = ports[:3], ports[3:]
        self.peers = ",".join(f"127.0.0.1:{p}" for p in self.grpc_ports)
        self.sockets = [str(self.dir / f"rank{i}.sock") for i in (0, 1)]
        self.logs = [self.dir / f"rank{i}.log" for i in (0, 1)]
        self.fake = FakePeer(self.secret, self.grpc_ports[FAKE_RANK])
        self.procs: list[subprocess.Popen[bytes]] = []
        settings = [a for s in DAEMON_SETTINGS for a in ("--set", s)]
        for i in (0, 1):
            cmd = [sys.executable, "-m", "decentd", "--rank", str(i), "--peers", self.peers,
                   "--socket", self.sockets[i], "--topology", "ring", "--security-mode",
                   "secret", "--secret-file", str(self.secret_path), *settings,
                   "--set", f"transport.data_port={self.data_ports[i]}", *extra]
            with self.logs[i].open("ab") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        self.job = f"exact-{os.getpid()}-{random.randrange(1 << 30)}"
        self.clients: list[Client[np.ndarray]] = []

    def connect(self, timeout: float = 60) -> list[Client[np.ndarray]]:
        """The real workers (rank 0 on daemon 0, rank 1 on daemon 1), once both are ready."""
        with ThreadPoolExecutor(2) as pool:
            self.clients = list(pool.map(
                lambda s: Client(NumpyCodec(), f"unix://{s}", timeout, job=self.job),
                self.sockets))
        return self.clients

    def status(self, i: int) -> pb.StatusReply:
        with grpc.insecure_channel(f"unix://{self.sockets[i]}") as channel:
            reply: pb.StatusReply = pb_grpc.WorkerStub(channel).Status(pb.StatusRequest(),
                                                                       timeout=10)
        return reply

    def attach(self, d: int, job: str, stub: pb_grpc.WorkerStub | None = None) -> Worker:
        """A worker of ``job`` registered at daemon ``d``, its data channel open (the
        daemon's hello answered)."""
        with contextlib.ExitStack() as stack:
            if stub is None:
                chan = stack.enter_context(grpc.insecure_channel(f"unix://{self.sockets[d]}"))
                stub = pb_grpc.WorkerStub(chan)
            reply = stub.Register(pb.RegisterRequest(
                protocol_version=PROTOCOL_VERSION, pid=os.getpid(), framework="fuzz", job=job),
                timeout=30)
        if reply.error.code != pb.OK:
            raise OSError(f"registration refused: {reply.error}")
        w = Worker(reply.worker_id, int(reply.arena_bytes))
        w.data = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        w.data.connect(self.sockets[d] + ".data")
        w.data.sendall(framing.encode(pb.WorkerHello(worker_id=w.id)))
        bodies, _ = read_frames_until(w.data, 1, 10)
        if not bodies or framing.decode(pb.Completion, bodies[0]).error.code != pb.OK:
            w.data.close()
            raise OSError(f"worker {w.id} not attached")
        return w

    def as_rank2(self, d: int) -> socket.socket:
        """A bulk connection to daemon ``d`` that proved rank 2's HELLO (challenge, handshake
        and HELLO with the cluster secret), taken by the daemon."""
        auth = PeerAuth("secret", CLUSTER_ID, self.secret)
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_ports[d]}") as chan:
            key, _ = rank2_handshake(self, pb_grpc.PeerStub(chan), auth, d)
        sock = socket.create_connection(("127.0.0.1", self.data_ports[d]), 10)
        sock.sendall(rank2_hello(auth, key, d))
        if not taken(lambda: self.status(d), 10):
            sock.close()
            raise OSError(f"daemon {d} did not take rank 2's HELLO")
        return sock

    def rss(self, i: int) -> int:
        """Daemon ``i``'s resident set size as its Status reports it (from /proc when Status
        fails)."""
        try:
            return int(self.status(i).rss_bytes)
        except grpc.RpcError:
            with open(f"/proc/{self.procs[i].pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def open_fds(self, i: int) -> int:
        return len(os.listdir(f"/proc/{self.procs[i].pid}/fd"))

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def stop(self) -> list[int | None]:
        """Close the workers, SIGTERM the daemons; their exit codes (None: killed)."""
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()
        self.clients = []
        codes: list[int | None] = []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                codes.append(p.wait(30))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
        self.fake.close()
        return codes


# ---------------------------------------------------------------------------- socket helpers


def wait_closed(sock: socket.socket, timeout: float) -> bool:
    """Read (and drop) until the other end closes: True, or False after ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send ``data``; False when the other end closed first (it may, mid-way)."""
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def read_frames(sock: socket.socket, timeout: float, limit: int = 64 << 20
                ) -> tuple[list[bytes], bool]:
    """Frame bodies read until the other end closes (True) or ``timeout`` passes (False)."""
    reader = framing.FrameReader(limit)
    bodies: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(1 << 16)
            if not chunk:
                return bodies, True
            bodies += reader.feed(chunk)
    except (ConnectionResetError, BrokenPipeError):
        return bodies, True
    except (TimeoutError, framing.FrameError):
        return bodies, False
    return bodies, False


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(framing.LENGTH, "little") + body


@dataclass
class Ctx:
    """What the target threads share."""

    cluster: FuzzCluster
    tally: Tally
    deadline: float
    #: the fuzzer's own successful handshakes and HELLOs as rank 2 (replayed by other targets)
    handshakes: list[tuple[int, pb.HandshakeRequest]] = field(default_factory=list)
    hellos: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def remember(self, store: list[Any], item: Any) -> None:
        with self.lock:
            store.append(item)
            del store[:-64]

    def replay(self, store: list[Any], gen: Gen) -> Any:
        with self.lock:
            return gen.pick(store) if store else None

    def addr(self, d: int) -> str:
        return f"127.0.0.1:{self.cluster.grpc_ports[d]}"


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", GRPC_LIMIT + (1 << 20)),
        ("grpc.max_receive_message_length", GRPC_LIMIT)])


def quota_loop(ctx: Ctx, target: str, quota: int, step: Callable[[], None]) -> None:
    """Run ``step`` until ``target`` has sent ``quota`` messages (or time is up); a step that
    raises is counted as an outcome, not a crash of the fuzzer."""
    while ctx.tally.total(target) < quota and not ctx.out_of_time:
        try:
            step()
        except (OSError, grpc.RpcError) as exc:
            ctx.tally.outcome(target, f"client error {type(exc).__name__}")


# ---------------------------------------------------------------------------- (a) peer gRPC


class PeerGrpc:
    """Challenge and Handshake, malformed, spoofed and replayed; garbage on the gRPC port."""

    T = "peer-grpc"

    def __init__(self, ctx: Ctx, gen: Gen) -> None:
        self.ctx, self.g = ctx, gen
        self.channels = [channel(ctx.addr(d)) for d in (0, 1)]
        self.stubs = [pb_grpc.PeerStub(c) for c in self.channels]
        self.wrong = PeerAuth("secret", CLUSTER_ID, b"not the secret of this cluster!!")
        self.auth = PeerAuth("secret", CLUSTER_ID, ctx.cluster.secret)

    def run(self, quota: int) -> None:
        steps = [(self.challenge, 5), (self.handshake, 4), (self.wrong_proof, 3),
                 (self.spoofed, 3), (self.replayed, 3), (self.undecodable, 2), (self.raw, 2),
                 (self.huge, 0.05)]
        funcs, weights = zip(*steps, strict=True)
        try:
            quota_loop(self.ctx, self.T, quota,
                       lambda: self.g.r.choices(funcs, weights)[0](self.g.r.randint(0, 1)))
        finally:
            for c in self.channels:
                c.close()

    def _request(self, d: int, rank: int | None = None) -> pb.HandshakeRequest:
        digest, machine = self.ctx.cluster.fake.digests or ("", "")
        return pb.HandshakeRequest(cluster_id=CLUSTER_ID, protocol_version=PROTOCOL_VERSION,
                                   from_rank=FAKE_RANK if rank is None else rank, to_rank=d,
                                   topology_digest=digest, workers_per_node=1,
                                   machine_topology_digest=machine)

    def _refused(self, reply: pb.HandshakeReply, what: str) -> None:
        self.ctx.tally.outcome(self.T, f"handshake {pb.ErrorCode.Name(reply.error.code)}"
                               if reply.error.code in pb.ErrorCode.values()
                               else "handshake ?")
        if reply.error.code == pb.OK or reply.data_port:
            self.ctx.tally.violation(self.T, f"{what} admitted: {reply}")

    def challenge(self, d: int) -> None:
        g = self.g
        req = random_message(pb.ChallengeRequest, g)
        if g.chance(0.5):
            req.cluster_id = CLUSTER_ID
        if g.chance(0.5):
            req.client_nonce = g.r.randbytes(g.pick((0, 1, 31, 32, 32, 33, 64, 1000)))
        if g.chance(0.4):
            req.from_rank, req.to_rank = g.pick((0, 1, 2)), g.pick((d, d, 1 - d, 2))
        reply = self.stubs[d].Challenge(req, timeout=30)
        self.ctx.tally.count(self.T, "challenge")
        valid = (req.cluster_id == CLUSTER_ID and req.from_rank in (1 - d, 2)
                 and req.to_rank == d and len(req.client_nonce) == NONCE_BYTES)
        issued = reply.error.code == pb.OK
        self.ctx.tally.outcome(self.T, "challenge issued" if issued else "challenge refused")
        if issued and not valid:
            self.ctx.tally.violation(self.T, f"challenge {req} answered")

    def handshake(self, d: int) -> None:
        req = random_message(pb.HandshakeRequest, self.g)
        if self.g.chance(0.5):
            req.MergeFrom(self._request(d, self.g.rank()))
            req.server_nonce = self.g.r.randbytes(self.g.pick((0, 32, 32, 31, 64)))
        self._refused(self.stubs[d].Handshake(req, timeout=30), "a random handshake")
        self.ctx.tally.count(self.T, "handshake random")

    def _challenged(self, d: int, rank: int = FAKE_RANK) -> tuple[bytes, pb.ChallengeReply]:
        nonce = new_nonce()
        reply = self.stubs[d].Challenge(pb.ChallengeRequest(
            cluster_id=CLUSTER_ID, from_rank=rank, to_rank=d, client_nonce=nonce), timeout=30)
        self.ctx.tally.count(self.T, "challenge valid")
        return nonce, reply

    def wrong_proof(self, d: int) -> None:
        nonce, ch = self._challenged(d)
        req = self._request(d)
        req.server_nonce = ch.server_nonce
        how = self.g.pick(("wrong secret", "random", "other ranks", "empty", "server's proof"))
        if how == "wrong secret":
            req.proof, _ = self.wrong.client_proof(FAKE_RANK, d, nonce, ch.server_nonce)
        elif how == "random":
            req.proof = self.g.blob(80)
        elif how == "other ranks":
            req.proof, _ = self.auth.client_proof(FAKE_RANK, 1 - d, nonce, ch.server_nonce)
        elif how == "server's proof":  # reflected back
            req.proof = ch.server_proof
        self._refused(self.stubs[d].Handshake(req, timeout=30), f"a proof ({how})")
        self.ctx.tally.count(self.T, f"handshake {how}")

    def spoofed(self, d: int) -> None:
        """Challenged as rank 2, then a handshake that claims another rank (with a proof for
        either), or rank 2's right proof taken to the other daemon."""
        nonce, ch = self._challenged(d)
        claim = self.g.pick((0, 1, 3, -1, 2**31 - 1))
        where, req = d, self._request(d, claim)
        req.server_nonce = ch.server_nonce
        req.proof, _ = self.auth.client_proof(self.g.pick((FAKE_RANK, claim)), d, nonce,
                                              ch.server_nonce)
        if self.g.chance(0.3):  # right for rank 2 at d, shown to the other daemon
            where, req.from_rank = 1 - d, FAKE_RANK
            req.proof, _ = self.auth.client_proof(FAKE_RANK, d, nonce, ch.server_nonce)
        self._refused(self.stubs[where].Handshake(req, timeout=30), "a spoofed rank")
        self.ctx.tally.count(self.T, "handshake spoofed rank")

    def replayed(self, d: int) -> None:
        """A handshake the fuzzer made as rank 2 earlier (its challenge answered once already),
        to the same daemon or the other one."""
        old = self.ctx.replay(self.ctx.handshakes, self.g)
        if old is None:
            self.challenge(d)
            return
        was, req = old
        where = was if self.g.chance(0.7) else 1 - was
        self._refused(self.stubs[where].Handshake(req, timeout=30), "a replayed handshake")
        self.ctx.tally.count(self.T, "handshake replayed" + (" elsewhere" if where != was
                                                             else ""))

    def undecodable(self, d: int) -> None:
        """Bodies that are not the method's message, and methods that do not exist."""
        methods = ["/decent.v1.Peer/Nope", "/decent.v1.Worker/Register",
                   "/decent.v1.Worker/Status", "/x", "/decent.v1.Peer/Challenge",
                   "/decent.v1.Peer/Handshake"]
        method = self.g.pick(methods)
        call = self.channels[d].unary_unary(method, request_serializer=lambda b: b,
                                            response_deserializer=lambda b: b)
        body = self.g.pick((self.g.blob(200), b"\x0a\xff\xff\xff\xff\x0f", b"\x08" * 20,
                            b"\xff" * 11))
        try:
            call(body, timeout=30)
            self.ctx.tally.outcome(self.T, "raw call answered")
        except grpc.RpcError as exc:
            self.ctx.tally.outcome(self.T, f"raw call {exc.code().name}")
        self.ctx.tally.count(self.T, "raw body to " + ("an unknown method" if "Peer/N" in method
                                                       or method == "/x" else method))

    def raw(self, d: int) -> None:
        """Bytes that are not HTTP/2 (or barely) on the gRPC TCP port."""
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        data = self.g.pick((self.g.blob(3000), preface + self.g.blob(300),
                            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01" + self.g.blob(),
                            preface + b"\x00\x00\x12\x04\x00\x00\x00\x00\x00" + self.g.blob(18),
                            preface + bytes([0xff, 0xff, 0xff, 0x00, 0, 0, 0, 0, 1])))
        with socket.create_connection(("127.0.0.1", self.ctx.cluster.grpc_ports[d]), 10) as s:
            send_quietly(s, data)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
            self.ctx.tally.outcome(self.T, "raw closed" if wait_closed(s, 5) else "raw open")
        self.ctx.tally.count(self.T, "raw bytes on the gRPC port")

    def huge(self, d: int) -> None:
        """Strings from 60 KiB to megabytes (within gRPC's 16 MiB; the daemon may take less)."""
        size = self.g.pick((60 << 10, 1 << 20, 4 << 20, GRPC_LIMIT - 4096))
        try:
            if self.g.chance(0.5):
                reply = self.stubs[d].Challenge(pb.ChallengeRequest(
                    cluster_id="\x1b" * size, from_rank=FAKE_RANK, to_rank=d,
                    client_nonce=new_nonce()), timeout=60)
                self.ctx.tally.outcome(self.T, "huge challenge answered")
                if reply.error.code == pb.OK:
                    self.ctx.tally.violation(self.T, "a challenge of another cluster answered")
            else:
                req = self._request(d)
                req.topology_digest = "y" * size
                req.server_nonce = new_nonce()
                self._refused(self.stubs[d].Handshake(req, timeout=60), "a huge handshake")
        except grpc.RpcError as exc:
            self.ctx.tally.outcome(self.T, f"huge {exc.code().name}")
        self.ctx.tally.count(self.T, "huge string")


# ---------------------------------------------------------------------------- bulk frames


def hostile_part(g: Gen, d: int) -> pb.Part:
    """A part as rank 2 might send it to daemon ``d``: mostly well-addressed (so that it gets
    past the sender check into the mailbox and the window services), with hostile fields."""
    job = g.pick(("fz", "fz" + g.text(6), ""))
    owner = g.pick((str(d), str(d), "n", str(1 - d), "2", "x", ""))
    name = g.pick((f"{job}\x1f{g.text(12)}\x1e{owner}", g.text(24),
                   f"{job}\x1fw{g.r.randint(0, 3)}\x1e{owner}"))
    p = pb.Part(name=name, round=g.u64() if g.chance(0.3) else g.r.randint(0, 3),
                tag=g.pick((0, 0, 1, 2, g.u32())), src=FAKE_RANK if g.chance(0.85) else g.rank(),
                op=g.pick((*ONE_SIDED, g.r.randint(0, 25), g.i32())),
                meta=pb.TensorMeta(dtype=g.dtype(), shape=g.shape()),
                weight=g.real(), step=g.u64(), p=g.real(), topology=g.text(16))
    p.nbytes = g.pick((0, 0, 4, 8, 16, g.r.randint(0, 256), g.u64()))
    return p


def hostile_header(g: Gen, d: int, last_mid: int) -> tuple[pb.BulkHeader, int]:
    """A bulk header and how many payload bytes to actually send after it."""
    kind = g.pick((pb.DATA, pb.DATA, pb.RTS, pb.RTS, pb.PAYLOAD, pb.ACK, pb.ACK, pb.ABORT,
                   pb.CTS, pb.WORKER_LEFT, pb.WORKER_JOINED, pb.HELLO, pb.BULK_UNSPECIFIED,
                   g.pick((10, 99, -1, 2**31 - 1))))
    h = pb.BulkHeader(kind=kind, message_id=g.pick((last_mid, g.u64(), g.r.randint(0, 9))),
                      cluster_id=g.pick(("", CLUSTER_ID, g.text(8))), from_rank=g.rank(),
                      credit=g.pick((0, 0, g.u64())), proof=g.blob(40) if g.chance(0.1) else b"")
    h.parts.extend(hostile_part(g, d) for _ in range(g.pick((0, 1, 1, 1, 2, 3, 17))))
    if kind == pb.ABORT or g.chance(0.1):
        h.error.CopyFrom(pb.Error(code=g.i32(), message=g.text()))
    honest = sum(p.nbytes for p in h.parts)
    if kind in (pb.DATA, pb.PAYLOAD) and honest > 4096:
        for p in h.parts:
            p.nbytes = min(p.nbytes, 64)
        honest = sum(p.nbytes for p in h.parts)
    size = g.pick((honest, honest, honest, g.r.randint(0, 4096), g.pick((1 << 20, 3 << 20))))
    if kind in (pb.DATA, pb.PAYLOAD) or g.chance(0.05):
        h.payload_bytes = min(size, 2**64 - 1)
    return h, min(h.payload_bytes, 65536)


# ---------------------------------------------------------------------------- (b) bulk, unproven


class BulkUnauth:
    """Connections that never prove a HELLO: each complete frame must get them closed."""

    T = "bulk-unauth"

    def __init__(self, ctx: Ctx, gen: Gen) -> None:
        self.ctx, self.g = ctx, gen

    def run(self, quota: int) -> None:
        steps = [(self.random_bytes, 3), (self.prefix, 3), (self.bad_hello, 5),
                 (self.replayed_hello, 2), (self.before_hello, 4), (self.flood, 0.02)]
        funcs, weights = zip(*steps, strict=True)
        quota_loop(self.ctx, self.T, quota,
                   lambda: self.g.r.choices(funcs, weights)[0](self.g.r.randint(0, 1)))

    def _connect(self, d: int) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.ctx.cluster.data_ports[d]), 10)

    def _send(self, d: int, data: bytes, kind: str, complete: bool, frames: int = 1) -> None:
        """One connection: ``data``; when it holds a complete frame (or a prefix past the 4 KiB
        limit) the daemon must close the connection, else this side closes it."""
        with self._connect(d) as s:
            send_quietly(s, data)
            self.ctx.tally.count(self.T, kind, frames)
            if not complete:
                self.ctx.tally.outcome(self.T, "left incomplete")
                return
            if wait_closed(s, 10):
                self.ctx.tally.outcome(self.T, "closed by the daemon")
            else:
                self.ctx.tally.violation(self.T, f"{kind}: not closed after {data[:64]!r}")

    def random_bytes(self, d: int) -> None:
        data = self.g.r.randbytes(self.g.r.randint(0, 5000))
        self._send(d, data, "random bytes", _complete(data))

    def prefix(self, d: int) -> None:
        """A length prefix of any size, with all, part or none of its body."""
        n = self.g.pick((0, 1, 2, 100, 4095, 4096, 4097, 8192, 65536, 16 << 20, (16 << 20) + 1,
                         2**31, 2**32 - 1, self.g.u32()))
        body = self.g.r.randbytes(min(n, 8192)) if self.g.chance(0.5) else b""
        data = n.to_bytes(4, "little") + body[:self.g.pick((len(body), len(body) // 2))]
        self._send(d, data, "length prefix", _complete(data))

    def bad_hello(self, d: int) -> None:
        g = self.g
        h = pb.BulkHeader(kind=pb.HELLO, cluster_id=g.pick((CLUSTER_ID, CLUSTER_ID, "other",
                                                             g.text(), "x" * 4000)),
                          from_rank=g.pick((0, 1, 2, 2, 2, -1, 3, 2**31 - 1)),
                          proof=g.pick((b"", g.blob(32), g.r.randbytes(32), g.blob(200))),
                          stripe=g.pick((0, 0, 0, 1, 5, 64, 2**32 - 1)),
                          stripes=g.pick((0, 1, 1, 3, 64, 65, 2**32 - 1)), bundle=g.u64())
        if g.chance(0.2):  # a proof under a key nobody was given
            h.proof = PeerAuth("secret", CLUSTER_ID, g.r.randbytes(32)).hello_proof(
                g.r.randbytes(32), h.from_rank, d, h)
        if g.chance(0.1):
            h.payload_bytes = g.u64()
        data = framing.encode(h)
        extra = framing.encode(pb.BulkHeader(kind=pb.DATA, payload_bytes=4)) + b"\0" * 4 \
            if g.chance(0.3) else b""
        self._send(d, data + extra, "HELLO bad proof/rank/cluster", True, 2 if extra else 1)

    def replayed_hello(self, d: int) -> None:
        """A HELLO the fuzzer proved earlier as rank 2 (its key is spent)."""
        old = self.ctx.replay(self.ctx.hellos, self.g)
        if old is None:
            self.bad_hello(d)
            return
        self._send(d, old, "HELLO replayed", True)

    def before_hello(self, d: int) -> None:
        h, n = hostile_header(self.g, d, 1)
        if h.kind == pb.HELLO:
            h.kind = pb.DATA
        body = h.SerializeToString()
        data = frame(body) + self.g.r.randbytes(n)
        big = len(body) > 4096
        self._send(d, data, "frame before HELLO", big or len(data) >= 4 + len(body))

    def flood(self, d: int) -> None:
        """More connections at once than the 64 the daemon holds unproven: the rest are closed
        at once."""
        socks = []
        try:
            for _ in range(72):
                socks.append(self._connect(d))
            closed = sum(wait_closed(s, 0.5) for s in socks[-8:])
            self.ctx.tally.outcome(self.T, f"flood: {closed} of the last 8 closed at once")
        finally:
            for s in socks:
                s.close()
        self.ctx.tally.count(self.T, "connection flood (72)", 72)


def _complete(data: bytes) -> bool:
    """Whether an unproven bulk connection that sent ``data`` must be closed by the daemon: a
    prefix past the 4 KiB limit, or one whole frame (and its payload)."""
    if len(data) < 4:
        return False
    n = int.from_bytes(data[:4], "little")
    if n > 4096:
        return True
    if len(data) < 4 + n:
        return False
    header = pb.BulkHeader()
    try:
        header.ParseFromString(data[4:4 + n])
    except Exception:  # undecodable: closed
        return True
    return True  # a payload is refused at its header, before any byte of it is read


# ---------------------------------------------------------------------------- (c) bulk, as rank 2


class BulkAuth:
    """Rank 2's real challenge, handshake and HELLO (the fuzzer holds the secret), then hostile
    frames on the proven connection until the daemon closes it; a fresh handshake each time."""

    T = "bulk-auth"

    def __init__(self, ctx: Ctx, gen: Gen) -> None:
        self.ctx, self.g = ctx, gen
        self.auth = PeerAuth("secret", CLUSTER_ID, ctx.cluster.secret)
        self.channels = [channel(ctx.addr(d)) for d in (0, 1)]
        self.stubs = [pb_grpc.PeerStub(c) for c in self.channels]
        self.status = [pb_grpc.WorkerStub(grpc.insecure_channel(f"unix://{s}"))
                       for s in ctx.cluster.sockets]

    def run(self, quota: int) -> None:
        try:
            quota_loop(self.ctx, self.T, quota, lambda: self.session(self.g.r.randint(0, 1)))
        finally:
            for c in self.channels:
                c.close()

    def handshake(self, d: int) -> bytes:
        """A session key for rank 2 at daemon ``d`` (the handshake kept for replays)."""
        key, req = rank2_handshake(self.ctx.cluster, self.stubs[d], self.auth, d)
        self.ctx.remember(self.ctx.handshakes, (d, req))
        return key

    def _bound(self, d: int) -> bool:
        try:
            return taken(lambda: self.status[d].Status(pb.StatusRequest(), timeout=10), 2)
        except grpc.RpcError:  # Status itself broken (it was, by a bug): assume it was taken
            self.ctx.tally.outcome(self.T, "Status failed")
            return True

    def session(self, d: int) -> None:
        hello = rank2_hello(self.auth, self.handshake(d), d)
        with socket.create_connection(("127.0.0.1", self.ctx.cluster.data_ports[d]), 10) as s:
            s.sendall(hello)
            if not self._bound(d):
                self.ctx.tally.outcome(self.T, "HELLO not taken (previous connection?)")
                return
            self.ctx.remember(self.ctx.hellos, hello)
            data, frames, truncated = self.batch(d)
            send_quietly(s, data)
            self.ctx.tally.count(self.T, "HELLO as rank 2")
            for kind in frames:
                self.ctx.tally.count(self.T, kind)
            if truncated:  # the daemon waits for the rest of a payload: this side ends it
                self.ctx.tally.outcome(self.T, "truncated by the fuzzer")
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_WR)
                wait_closed(s, 10)
                return
            self.ctx.tally.outcome(self.T, "closed by the daemon" if wait_closed(s, 30)
                                   else "still open after 30 s")

    def batch(self, d: int) -> tuple[bytes, list[str], bool]:
        """Hostile frames, ended by one the daemon must close the connection for (a second
        HELLO, a frame of unknown kind, an undecodable header) or by a truncated payload."""
        out, kinds, mid = [], [], 1
        for _ in range(self.g.r.randint(1, 24)):
            h, n = hostile_header(self.g, d, mid)
            if h.kind == pb.RTS:
                mid = h.message_id
            body = h.SerializeToString()
            if n < h.payload_bytes:  # a payload that never comes whole: last in the batch
                out.append(frame(body) + self.g.r.randbytes(n))
                kinds.append("truncated payload")
                return b"".join(out), kinds, True
            out.append(frame(body) + self.g.r.randbytes(h.payload_bytes))
            kinds.append(_kind_name(h.kind))
        end = self.g.pick((framing.encode(pb.BulkHeader(kind=pb.HELLO, from_rank=FAKE_RANK)),
                           framing.encode(pb.BulkHeader(kind=99)), frame(b"\xff\xff"),
                           (64 << 20).to_bytes(4, "little")))
        out.append(end)
        kinds.append("closing frame")
        return b"".join(out), kinds, False


def rank2_handshake(cluster: FuzzCluster, stub: pb_grpc.PeerStub, auth: PeerAuth, d: int
                    ) -> tuple[bytes, pb.HandshakeRequest]:
    """Rank 2's challenge and handshake at daemon ``d``: the session key, and the request."""
    nonce = new_nonce()
    ch = stub.Challenge(pb.ChallengeRequest(cluster_id=CLUSTER_ID, from_rank=FAKE_RANK,
                                            to_rank=d, client_nonce=nonce), timeout=30)
    if not auth.server_proof_ok(FAKE_RANK, d, nonce, ch.server_nonce, ch.server_proof):
        raise OSError(f"daemon {d} did not prove it holds the secret: {ch}")
    digest, machine = cluster.fake.digests or ("", "")
    proof, key = auth.client_proof(FAKE_RANK, d, nonce, ch.server_nonce)
    req = pb.HandshakeRequest(cluster_id=CLUSTER_ID, protocol_version=PROTOCOL_VERSION,
                              from_rank=FAKE_RANK, to_rank=d, topology_digest=digest,
                              workers_per_node=1, machine_topology_digest=machine,
                              server_nonce=ch.server_nonce, proof=proof)
    reply = stub.Handshake(req, timeout=30)
    if reply.error.code != pb.OK:
        raise OSError(f"daemon {d} refused rank 2's handshake: {reply.error}")
    return key, req


def rank2_hello(auth: PeerAuth, key: bytes, d: int) -> bytes:
    """The HELLO frame that proves rank 2's session key at daemon ``d``."""
    hello = pb.BulkHeader(kind=pb.HELLO, cluster_id=CLUSTER_ID, from_rank=FAKE_RANK)
    hello.proof = auth.hello_proof(key, FAKE_RANK, d, hello)
    return framing.encode(hello)


def taken(status: Callable[[], pb.StatusReply], timeout: float) -> bool:
    """Whether the daemon whose ``status`` this is took rank 2's HELLO within ``timeout`` (its
    link to rank 2 reads from a connection: only one that said a valid HELLO counts)."""
    deadline = time.monotonic() + timeout
    while not any(p.rank == FAKE_RANK and p.bytes_received for p in status().peers):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _kind_name(kind: int) -> str:
    return pb.BulkKind.Name(kind) if kind in pb.BulkKind.values() else "unknown kind"


# ---------------------------------------------------------------------------- (d) worker data


@dataclass
class Worker:
    """A worker this process registered (hostile, but registered)."""

    id: str
    arena: int
    data: socket.socket | None = None


class WorkerData:
    """The data channel: before the hello, then as a registered worker; spoofed registrations."""

    T = "worker-data"

    def __init__(self, ctx: Ctx, gen: Gen, tag: str = "wd") -> None:
        self.ctx, self.g, self.tag = ctx, gen, tag
        self.chans = [grpc.insecure_channel(f"unix://{s}") for s in ctx.cluster.sockets]
        self.stubs = [pb_grpc.WorkerStub(c) for c in self.chans]
        self.n = 0

    def run(self, quota: int) -> None:
        steps = [(self.before_hello, 3), (self.submits, 6), (self.register, 1)]
        funcs, weights = zip(*steps, strict=True)
        try:
            quota_loop(self.ctx, self.T, quota,
                       lambda: self.g.r.choices(funcs, weights)[0](self.g.r.randint(0, 1)))
        finally:
            for c in self.chans:
                c.close()

    def attach(self, d: int) -> Worker:
        """Register a worker of a job of its own at daemon ``d`` and open its data channel."""
        self.n += 1
        return self.ctx.cluster.attach(d, f"{self.tag}-{d}-{self.n}", self.stubs[d])

    def before_hello(self, d: int) -> None:
        g = self.g
        how = g.pick(("unknown id", "empty id", "garbage", "oversized prefix", "submit first",
                      "taken id", "truncated hello"))
        w = self.attach(d) if how == "taken id" else None
        try:
            if how == "garbage":
                data = g.r.randbytes(g.r.randint(1, 2000))
            elif how == "oversized prefix":
                data = g.pick(((64 << 20) + 1, 2**32 - 1)).to_bytes(4, "little") + g.blob(100)
            elif how == "submit first":
                data = framing.encode(self.submit_request(1 << 20))
            elif how == "truncated hello":  # then this side closes: the daemon sees EOF
                whole = framing.encode(pb.WorkerHello(worker_id=g.text(40)))
                data = whole[:g.r.randint(1, len(whole) - 1)]
            else:
                long = "\x1b" * 5000 if g.chance(0.2) else ""  # "worker-text" (fixed)
                wid = {"unknown id": g.text(64) + long, "empty id": "",
                       "taken id": w.id if w else ""}[how]
                data = framing.encode(pb.WorkerHello(worker_id=wid))
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.ctx.cluster.sockets[d] + ".data")
                send_quietly(s, data)
                self.ctx.tally.count(self.T, f"before hello: {how}")
                if how == "truncated hello":
                    s.shutdown(socket.SHUT_WR)
                _, closed = read_frames(s, 3 if how == "garbage" else 10)
                self.ctx.tally.outcome(self.T, "closed" if closed else "left open")
                if not closed and how not in ("garbage",):
                    self.ctx.tally.violation(self.T, f"{how}: the channel stayed open")
        finally:
            if w is not None and w.data is not None:
                w.data.close()

    def submits(self, d: int) -> None:
        """Hostile requests from a registered worker, then an undecodable, oversized or
        truncated frame (the daemon drops the channel, and the worker with it); completions
        are read throughout."""
        w = self.attach(d)
        assert w.data is not None
        with w.data:
            frames = [framing.encode(self.submit_request(w.arena))
                      for _ in range(self.g.r.randint(1, 30))]
            end, kind = self.g.pick(((frame(b"\xff\xff\xff"), "undecodable frame"),
                                     ((1 << 31).to_bytes(4, "little"), "oversized prefix"),
                                     (frames[-1][:-1], "truncated request")))
            reader = threading.Thread(target=read_frames, args=(w.data, 30), daemon=True)
            reader.start()
            send_quietly(w.data, b"".join(frames) + end)
            if kind == "truncated request":  # this side ends it: the daemon sees EOF
                with contextlib.suppress(OSError):
                    w.data.shutdown(socket.SHUT_WR)
            reader.join(35)
            self.ctx.tally.count(self.T, "submit request", len(frames))
            self.ctx.tally.count(self.T, kind)
            self.ctx.tally.outcome(self.T, "dropped" if not reader.is_alive() else "open")

    def submit_request(self, arena: int) -> pb.SubmitRequest:
        g = self.g
        req = random_message(pb.SubmitRequest, g)
        if g.chance(0.8):
            op = g.pick(SUBMIT_OPS)
            getattr(req, op).CopyFrom(random_message(type(getattr(req, op)), g))
        req.timeout_s = g.pick((0.05, 0.2, 0.5, 0.01, g.real()))
        del req.tensors[:]
        for _ in range(g.pick((0, 1, 1, 1, 2, 3, 300))):
            req.tensors.append(self.tensor_ref(arena))
        if req.WhichOneof("op") == "set_topology":
            req.set_topology.spec_json = self.spec_json()
        return req

    def tensor_ref(self, arena: int) -> pb.TensorRef:
        g = self.g
        dtype = g.pick((pb.FLOAT32, pb.FLOAT64, pb.INT32, pb.UINT8, pb.FLOAT16, pb.BFLOAT16,
                        g.dtype()))
        shape = g.pick(([], [1], [4], [2, 3], [0], g.shape()))
        item = {pb.FLOAT64: 8, pb.FLOAT32: 4, pb.INT32: 4, pb.UINT8: 1}.get(dtype, 2)
        want = item * math.prod(shape) if all(0 <= s < 1 << 20 for s in shape) else 8
        off = g.pick((0, 4096, arena - want, arena, arena + 1, 2**64 - 1, g.u64()))
        return pb.TensorRef(
            name=g.pick(("t", "t" + g.text(8), g.text(), "a\x1fb", "a\x1eb", "\x1d", "")),
            round=g.pick((0, 0, 1, 2**64 - 1, g.u64())),
            meta=pb.TensorMeta(dtype=dtype, shape=shape), offset=u64(off),
            nbytes=u64(g.pick((want, want, 0, want + 1, g.u64()))),
            out_offset=g.pick((1 << 20, 0, arena, g.u64())),
            out_capacity=u64(g.pick((want, 2 * want, 0, g.u64()))))

    def spec_json(self) -> str:
        g = self.g
        kind = g.pick(("ring", "exponential", "torus", "wagma", "custom", "random-matching",
                       "star", "nope", "", g.text(8)))
        options: Any = g.pick(({}, {"rows": g.pick((0, -1, 3, "x", 1e300))},
                               {"group_size": g.pick((0, 1, 3, -2, 2**40))},
                               {"edges": [[g.rank(), g.rank(), g.real()] for _ in range(3)]},
                               {"seed": g.pick(("s", 2**70, None))}, {"bogus": 1}, [1, 2],
                               {"mean": g.text(4)}))
        spec: Any = {"kind": kind, "scheme": g.pick(("uniform", "metropolis", "x")),
                     "options": options,
                     "weights": g.pick((None, {}, {"0": {"1": 0.5}}, {"x": {}}, [1]))}
        spec = g.pick((spec, spec, spec, [spec], "ring", 3, None, {}))
        text = json.dumps(spec, allow_nan=True)
        return g.pick((text, text, text[:g.r.randint(0, len(text))], "[" * 40 + "]" * 40,
                       "{" + g.text(8), "NaN", ""))

    def register(self, d: int) -> None:
        """Spoofed registrations: the real workers' job and rank, another protocol."""
        g = self.g
        req = pb.RegisterRequest(protocol_version=g.pick((PROTOCOL_VERSION, 1, 2, 0, g.u32())),
                                 pid=g.int_in(-(2**63), 2**63 - 1), framework=g.text(),
                                 job=g.pick((self.ctx.cluster.job, g.text())))
        if g.chance(0.8):
            req.local_rank = g.pick((0, 1, -1, 2**31 - 1))
        reply = self.stubs[d].Register(req, timeout=30)
        self.ctx.tally.count(self.T, "register spoofed")
        if reply.error.code == pb.OK:  # a worker of a job of its own: attached, then gone
            if req.job == self.ctx.cluster.job:
                self.ctx.tally.violation(self.T, f"registered into the real job: {req}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.ctx.cluster.sockets[d] + ".data")
                s.sendall(framing.encode(pb.WorkerHello(worker_id=reply.worker_id)))
                read_frames_until(s, 1, 10)
            self.ctx.tally.outcome(self.T, "registered")
        else:
            self.ctx.tally.outcome(self.T, f"register {pb.ErrorCode.Name(reply.error.code)}")


def read_frames_until(sock: socket.socket, n: int, timeout: float) -> tuple[list[bytes], bool]:
    """At least ``n`` frame bodies, or what came before the other end closed or ``timeout``."""
    reader = framing.FrameReader(64 << 20)
    bodies: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(bodies) < n and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(1 << 16)
            if not chunk:
                return bodies, True
            bodies += reader.feed(chunk)
    except (TimeoutError, OSError):
        return bodies, False
    return bodies, False


# ---------------------------------------------------------------------------- (e) memory socket


class Descriptors:
    """Files to pass to the daemon: some it can map, most it must refuse."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        tiny = workdir / "tiny"
        tiny.write_bytes(b"\1" * 8192)
        self.tiny_rw = os.open(tiny, os.O_RDWR)
        self.tiny_ro = os.open(tiny, os.O_RDONLY)
        self.null = os.open(os.devnull, os.O_RDWR)
        self.dirfd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        self.pipe_r, self.pipe_w = os.pipe()
        self.sock_a, self.sock_b = socket.socketpair()
        self.memfd = os.memfd_create("fuzz")
        os.ftruncate(self.memfd, 16384)

    def pick(self, g: Gen) -> tuple[str, list[int], bool]:
        """(what, descriptors, whether the daemon could map them for a small region)."""
        what = g.pick(("none", "tiny rw", "tiny ro", "/dev/null", "directory", "pipe", "socket",
                       "memfd", "memfd", "reused number", "many"))
        fds = {"none": [], "tiny rw": [self.tiny_rw], "tiny ro": [self.tiny_ro],
               "/dev/null": [self.null], "directory": [self.dirfd],
               "pipe": [g.pick((self.pipe_r, self.pipe_w))], "socket": [self.sock_a.fileno()],
               "memfd": [self.memfd], "reused number": [], "many": []}[what]
        if what == "many":
            fds = [g.pick((self.null, self.memfd, self.tiny_rw))
                   for _ in range(g.pick((2, 5, 64, 250)))]
        return what, fds, what in ("tiny rw", "memfd", "reused number")

    @contextlib.contextmanager
    def reused(self) -> Iterator[int]:
        """A number that named one file, closed, and now names another."""
        first = os.open(self.dir / "tiny", os.O_RDWR)
        os.close(first)
        again = os.open(self.dir / "tiny", os.O_RDWR)
        try:
            yield again
        finally:
            os.close(again)

    def close(self) -> None:
        for fd in (self.tiny_rw, self.tiny_ro, self.null, self.dirfd, self.pipe_r, self.pipe_w,
                   self.memfd):
            os.close(fd)
        self.sock_a.close()
        self.sock_b.close()


class MemorySocket(WorkerData):
    """MemoryRequests from a registered worker and from nobody, with every kind of descriptor."""

    T = "memory-socket"

    def __init__(self, ctx: Ctx, gen: Gen) -> None:
        super().__init__(ctx, gen, "mem")
        self.fds = Descriptors(ctx.cluster.dir)
        self.bases: list[int] = []

    def run(self, quota: int) -> None:
        try:
            quota_loop(self.ctx, self.T, quota, lambda: self.session(self.g.r.randint(0, 1)))
        finally:
            self.fds.close()
            for c in self.chans:
                c.close()

    def session(self, d: int) -> None:
        w = self.attach(d)
        assert w.data is not None
        self.bases = []
        with w.data:
            for _ in range(self.g.r.randint(1, 20)):
                if self.g.chance(0.003):
                    self.spread(d, w)
                else:
                    self.request(d, w)

    def request(self, d: int, w: Worker) -> None:
        g = self.g
        page = 4096
        req = pb.MemoryRequest(
            worker_id=g.pick((w.id, w.id, w.id, "", g.text(20))),
            base=g.pick((w.arena + page * g.r.randint(0, 64), w.arena, w.arena - page, 0,
                         2**64 - 1, g.u64())),
            nbytes=g.pick((0, 1, page, 8192, 16384, 16385, 2**63, g.u64())),
            release=[g.pick((*self.bases, 0, g.u64())) for _ in range(g.pick((0, 0, 1, 3)))])
        what, fds, mappable = self.fds.pick(g)
        with contextlib.ExitStack() as stack:
            if what == "reused number":
                fds = [stack.enter_context(self.fds.reused())]
            data = framing.encode(req)
            how = g.pick(("whole", "whole", "split", "garbage", "oversized", "two frames"))
            if how == "garbage":
                data = g.r.randbytes(g.r.randint(1, 300))
            elif how == "oversized":
                data = g.pick(((1 << 20) + 1, 2**32 - 1)).to_bytes(4, "little") + g.blob()
            elif how == "two frames":
                data += framing.encode(pb.MemoryRequest(worker_id=w.id, nbytes=8192))
            code = self.send(d, data, fds, how == "split")
        self.ctx.tally.count(self.T, f"{how} request, fds: {what}")
        self.ctx.tally.outcome(self.T, code)
        ok = code == "OK"
        if ok and req.nbytes and how in ("whole", "split", "two frames"):
            if not (mappable and len(fds) == 1 and req.worker_id == w.id):
                self.ctx.tally.violation(self.T, f"registered {req} with {what}")
            self.bases.append(req.base)

    def send(self, d: int, data: bytes, fds: list[int], split: bool) -> str:
        """One connection: ``data`` with ``fds`` (on its second half when ``split``); the
        answer's error code, or how the connection ended."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.ctx.cluster.sockets[d] + ".mem")
            try:
                if split and len(data) > 1:
                    s.sendall(data[:len(data) // 2])
                    time.sleep(0.001)
                    socket.send_fds(s, [data[len(data) // 2:]], fds)
                else:
                    socket.send_fds(s, [data], fds)
            except OSError as exc:
                return f"send failed ({type(exc).__name__})"
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
            bodies, closed = read_frames_until(s, 1, 15)
        if not bodies:
            return "closed without an answer" if closed else "no answer in 15 s"
        return str(pb.ErrorCode.Name(framing.decode(pb.Error, bodies[0]).code))

    def spread(self, d: int, w: Worker) -> None:
        """One frame sent a byte at a time, four descriptors with each byte: the daemon takes one
        descriptor per request and ends the connection at the second (INVALID_ARGUMENT)."""
        data = framing.encode(pb.MemoryRequest(worker_id=w.id, base=w.arena + (1 << 30),
                                               nbytes=4096))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.ctx.cluster.sockets[d] + ".mem")
            try:
                for i in range(len(data)):
                    socket.send_fds(s, [data[i:i + 1]], [self.fds.memfd] * 4)
                code = "sent"
            except OSError as exc:
                code = f"send failed ({type(exc).__name__})"
            bodies, _ = read_frames_until(s, 1, 15)
        self.ctx.tally.count(self.T, "frame in one-byte pieces, 4 fds each", len(data))
        self.ctx.tally.outcome(self.T, str(pb.ErrorCode.Name(
            framing.decode(pb.Error, bodies[0]).code)) if bodies else code)


# ---------------------------------------------------------------------------- the exact ops


@dataclass
class PairOps:
    """Neighbor averages between the real workers 0 and 1 (explicit weights: rank 2 takes no
    part), in flight the whole time; each result must be exact."""

    clients: list[Client[np.ndarray]]
    done: int = 0
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    #: element counts: small, and past the 2 MiB receive window (sent after a CTS)
    SIZES = (1, 37, 4096, 600_000)

    def start(self) -> PairOps:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pair-ops")
        self._thread.start()
        return self

    def finish(self, timeout: float = 60) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                self.step(i)
            except Exception as exc:  # reported: every op must complete
                self.errors.append(f"step {i}: {type(exc).__name__}: {exc}"[:500])
                if len(self.errors) > 5:
                    return

    def step(self, i: int) -> None:
        """Four ops in flight per rank at once (different names, sizes and dtypes)."""
        handles = []
        for k, n in enumerate(self.SIZES if i % 4 == 0 else self.SIZES[:3]):
            dtype = (np.float32, np.float64, np.float16)[(i + k) % 3]
            if n > 100_000:
                dtype = np.float32
            xs = [np.full(n, (i * 7 + k + 11 * r) % 64, dtype) for r in (0, 1)]
            expect = (xs[0].astype(np.float64) + xs[1].astype(np.float64)) / 2
            for r, c in enumerate(self.clients):
                h = c.neighbor_allreduce_async(xs[r], name=f"pair.{k}", self_weight=0.5,
                                               src_weights={1 - r: 0.5},
                                               dst_weights={1 - r: 1.0}, timeout=60)
                handles.append((h, expect, dtype, f"pair.{k} round {i} rank {r}"))
        for h, expect, dtype, what in handles:
            got = h.wait(timeout=90)
            if got.dtype != dtype or not np.array_equal(got, expect.astype(dtype)):
                self.wrong.append(f"{what}: {got[:4]} != {expect[:4]}")
            self.done += 1


# ---------------------------------------------------------------------------- the campaign


def quotas(count: int) -> dict[str, int]:
    out = {t: int(count * SHARES[t]) for t in TARGETS}
    out[TARGETS[0]] += count - sum(out.values())
    return out


def campaign(cluster: FuzzCluster, count: int, seed: int, budget: float,
             tally: Tally | None = None) -> Tally:
    """``count`` messages over the five targets (each in its own thread, seeded from ``seed``),
    within ``budget`` seconds."""
    tally = tally or Tally()
    ctx = Ctx(cluster, tally, time.monotonic() + budget)
    makers: dict[str, Callable[[Gen], Any]] = {
        "peer-grpc": lambda g: PeerGrpc(ctx, g), "bulk-unauth": lambda g: BulkUnauth(ctx, g),
        "bulk-auth": lambda g: BulkAuth(ctx, g), "worker-data": lambda g: WorkerData(ctx, g),
        "memory-socket": lambda g: MemorySocket(ctx, g)}
    start = time.monotonic()
    failures: list[str] = []

    def run(target: str, quota: int) -> None:
        try:
            makers[target](Gen(seed * 1000 + TARGETS.index(target))).run(quota)
        except Exception as exc:  # a fuzzer bug, or a daemon gone: the report says so
            failures.append(f"{target}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(t, q), name=f"fuzz-{t}")
               for t, q in quotas(count).items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally.seconds = time.monotonic() - start
    for f in failures:
        tally.violation("fuzzer", f)
    return tally


# ---------------------------------------------------------------------------- checks, report

TRACEBACK = "Traceback (most recent call last)"
LONG_LINE = 1024


def log_problems(text: str) -> list[str]:
    """Python tracebacks (one example of each, counted), and lines longer than
    :data:`LONG_LINE`, in a daemon's log."""
    lines = text.splitlines()
    seen: Counter[str] = Counter()
    example: dict[str, str] = {}
    for i, line in enumerate(lines):
        if not line.startswith(TRACEBACK):
            continue
        j = i + 1
        while j < len(lines) and lines[j].startswith(" "):
            j += 1
        last = lines[j][:300] if j < len(lines) else "?"
        seen[last] += 1
        example.setdefault(last, "\n".join(s[:300] for s in lines[max(0, i - 1):j + 1]))
    out = [f"{n} traceback(s) ending {last!r}, e.g.\n{example[last]}"
           for last, n in seen.most_common()]
    long = [line for line in lines if len(line) > LONG_LINE]
    if long:
        out.append(f"{len(long)} log line(s) over {LONG_LINE} characters, e.g. "
                   f"{long[0][:300]!r}... ({len(long[0])} characters)")
    return out


@dataclass
class Outcome:
    """What a campaign did to the daemons."""

    tally: Tally
    alive: list[bool]
    ops: int
    wrong: list[str]
    op_errors: list[str]
    rss: list[tuple[int, int]]  #: per daemon: RSS before and after, bytes
    fds: list[tuple[int, int]]  #: per daemon: open descriptors before and after
    log_problems: list[list[str]]
    #: (messages sent, RSS of daemon 0, RSS of daemon 1) every few seconds
    rss_series: list[tuple[int, int, int]] = field(default_factory=list)


def run_campaign(cluster: FuzzCluster, count: int, seed: int, budget: float) -> Outcome:
    """The campaign with exact ops in flight, and what the daemons look like after."""
    clients = cluster.clients or cluster.connect()
    PairOps(clients).step(0)  # everything allocated on the ops' first run, before measuring
    before = [(cluster.rss(i), cluster.open_fds(i)) for i in (0, 1)]
    ops = PairOps(clients).start()
    tally, series, done = Tally(), [], threading.Event()

    def sample() -> None:
        while not done.wait(2.0):
            with contextlib.suppress(grpc.RpcError, OSError):
                series.append((tally.total(), cluster.rss(0), cluster.rss(1)))

    sampler = threading.Thread(target=sample, daemon=True, name="rss-sampler")
    sampler.start()
    try:
        campaign(cluster, count, seed, budget, tally)
    finally:
        done.set()
        ops.finish()
    time.sleep(0.5)  # connections the daemons closed are gone from /proc too
    alive = cluster.alive()
    after = [(cluster.rss(i), cluster.open_fds(i)) if alive[i] else (0, 0)
             for i in (0, 1)]
    return Outcome(tally, alive, ops.done, ops.wrong, ops.errors,
                   [(b[0], a[0]) for b, a in zip(before, after, strict=True)],
                   [(b[1], a[1]) for b, a in zip(before, after, strict=True)],
                   [log_problems(cluster.log(i)) for i in (0, 1)], series)


def print_report(out: Outcome) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    t = out.tally
    table = Table(title=f"decentd fuzzing: {t.total()} messages in {t.seconds:.1f} s")
    for col, just in (("target", "left"), ("messages", "right"), ("kind", "left"),
                      ("n", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    data = t.as_dict()["targets"]
    for target in TARGETS:
        kinds = list(data[target]["kinds"].items()) or [("-", 0)]
        for j, (kind, n) in enumerate(kinds):
            table.add_row(target if j == 0 else "", str(data[target]["messages"]) if j == 0
                          else "", escape(kind), str(n), end_section=j == len(kinds) - 1)
    console.print(table)
    results = Table(title="outcomes")
    for col in ("target", "outcome", "n"):
        results.add_column(col)
    for target in TARGETS:
        for kind, n in data[target]["outcomes"].items():
            results.add_row(target, escape(kind), str(n))
    console.print(results)
    summary = Table(title="the daemons")
    for col in ("check", "rank 0", "rank 1"):
        summary.add_column(col)
    summary.add_row("alive", *(str(a) for a in out.alive))
    summary.add_row("RSS before -> after (MiB)",
                    *(f"{b / 2**20:.1f} -> {a / 2**20:.1f}" for b, a in out.rss))
    summary.add_row("open fds before -> after", *(f"{b} -> {a}" for b, a in out.fds))
    summary.add_row("log problems", *(str(len(p)) for p in out.log_problems))
    console.print(summary)
    step = max(1, len(out.rss_series) // 10)
    console.print("RSS while fuzzing, MiB of daemons 0/1 after so many messages: " + ", ".join(
        f"{n // 1000}k {r0 / 2**20:.0f}/{r1 / 2**20:.0f}" for n, r0, r1 in out.rss_series[::step]))
    console.print(f"exact ops completed: {out.ops}, wrong: {len(out.wrong)}, "
                  f"failed: {len(out.op_errors)}; violations: {len(t.violations)}")
    for line in [*out.wrong[:5], *out.op_errors[:5], *t.violations[:20]]:
        console.print(escape(line))
    for i, problems in enumerate(out.log_problems):
        for p in problems[:3]:
            console.print(f"[bold]daemon {i}[/bold]: {escape(p)}")


def verdict(out: Outcome, rss_slack: int = 64 << 20, fd_slack: int = 16) -> list[str]:
    """Everything wrong with a campaign's outcome (empty: it passed)."""
    bad = []
    if not all(out.alive):
        bad.append(f"daemons alive: {out.alive}")
    if out.wrong or out.op_errors or out.ops == 0:
        bad.append(f"exact ops: {out.ops} done, wrong {out.wrong[:3]}, failed "
                   f"{out.op_errors[:3]}")
    bad += [f"violation: {v}" for v in out.tally.violations]
    for i, (b, a) in enumerate(out.rss):
        if a - b > rss_slack:
            bad.append(f"daemon {i}: RSS grew by {(a - b) / 2**20:.1f} MiB")
    for i, (b, a) in enumerate(out.fds):
        if a - b > fd_slack:
            bad.append(f"daemon {i}: open descriptors {b} -> {a}")
    bad += [f"daemon {i}: {p}" for i, ps in enumerate(out.log_problems) for p in ps]
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=200_000, help="messages in all (default 200000)")
    p.add_argument("--seed", type=int, default=None, help="seed (default: random, printed)")
    p.add_argument("--budget", type=float, default=3600, help="stop after this many seconds")
    p.add_argument("--json", help="write the counts and the outcome here")
    p.add_argument("--keep", action="store_true", help="keep the daemons' logs")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"seed {seed}, {args.count} messages", flush=True)
    cluster = FuzzCluster()
    out: Outcome | None = None
    bad = ["the campaign did not finish"]
    try:
        out = run_campaign(cluster, args.count, seed, args.budget)
        print_report(out)
        bad = verdict(out)
    finally:
        codes = cluster.stop()
    if codes != [0, 0]:
        bad.append(f"daemons exited with {codes} at SIGTERM")
    if args.json and out is not None:
        Path(args.json).write_text(json.dumps({
            "seed": seed, **out.tally.as_dict(), "alive": out.alive, "exact_ops": out.ops,
            "rss": out.rss, "fds": out.fds, "rss_series": out.rss_series, "problems": bad},
            indent=1))
    if args.keep or bad:
        print(f"daemon logs: {cluster.dir}")
    else:
        shutil.rmtree(cluster.dir, ignore_errors=True)
    print("PASS" if not bad else "FAIL:\n" + "\n".join(p[:2000] for p in bad[:30]))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
