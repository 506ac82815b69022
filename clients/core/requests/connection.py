"""The worker's links to its daemon: gRPC control calls, the data channel, the memory socket.

Registration (gRPC) gives the worker its rank, its arena and the daemon's sockets. Requests go
out and completions come back as frames on the data channel, a Unix stream socket with no reply
per request, read by a caller blocked on an op or else a background thread
(:mod:`decent.core.requests.completions`). Memory registration is one request per connection
on the memory socket, with the file descriptor riding along.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from decent.core.requests.completions import Awaitable, CompletionReader
from decent_wire import framing
from decent_wire.errors import DecentError
from decent_wire.local import default_socket
from decent_wire.protocol import PROTOCOL_VERSION
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc

#: how long a client waits for the daemon's Unix socket to appear before saying there is none
SOCKET_WAIT = 30.0
MEMORY_CALL_TIMEOUT = 30.0


def default_address() -> str:
    """$DECENT_DAEMON, else the daemon's default socket."""
    env = os.environ.get("DECENT_DAEMON")
    if env:
        return env if "://" in env or ":" in env else f"unix://{env}"
    return f"unix://{default_socket()}"


def _wait_for_socket(address: str, timeout: float) -> None:
    if not address.startswith("unix://"):
        return
    path = address[len("unix://"):]
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            raise DecentError(
                pb.PEER_UNAVAILABLE,
                f"no decentd socket at {path} after {timeout:g}s: start decentd (or run under "
                "decentrun), or point $DECENT_DAEMON at the daemon's socket",
            )
        time.sleep(0.05)


@dataclass(frozen=True)
class Registration:
    """What the daemon told this worker at registration."""

    worker_id: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    machine_rank: int
    machine_size: int
    cluster_id: str
    topology: pb.TopologyInfo
    machine_topology: pb.TopologyInfo
    default_timeout: float
    ring_threshold: int
    arena_bytes: int
    data_socket: str
    memory_socket: str
    #: the daemon joined a job already running (restarted or late): take the state first
    rejoining: bool = False


class Connection:
    """One worker's connection to its daemon. ``start()`` opens the data channel."""

    def __init__(self, address: str, framework: str, job: str, connect_timeout: float,
                 local_rank: int | None = None) -> None:
        """Register with the daemon at ``address`` as its worker ``local_rank`` (None: the
        lowest free one); DecentError when it cannot be reached or refuses."""
        self.address = address
        self.connect_timeout = connect_timeout
        _wait_for_socket(address, min(connect_timeout, SOCKET_WAIT))
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)])
        self._stub = pb_grpc.WorkerStub(self._channel)
        try:
            request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, pid=os.getpid(),
                                         framework=framework, job=job)
            if local_rank is not None:
                request.local_rank = local_rank
            reply = self._stub.Register(request, timeout=connect_timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            self._channel.close()
            raise DecentError(pb.PEER_UNAVAILABLE, f"cannot reach the daemon at {address}: "
                                                   f"{exc.details()}") from None
        if reply.error.code != pb.OK:
            self._channel.close()
            raise DecentError.from_pb(reply.error)
        self.registration = Registration(
            reply.worker_id, int(reply.rank), int(reply.size), int(reply.local_rank),
            max(1, int(reply.local_size)), int(reply.machine_rank),
            max(1, int(reply.machine_size)), reply.cluster_id, reply.topology,
            reply.machine_topology, reply.default_timeout_s, int(reply.ring_threshold_bytes),
            int(reply.arena_bytes), reply.data_socket, reply.memory_socket, reply.rejoining)
        #: joining a running job: peers leave this worker out until :meth:`join`
        self.joining = reply.rejoining
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._completions: CompletionReader | None = None
        self._closing = False

    # ------------------------------------------------------------------ the data channel

    def start(self, on_completion: Callable[[pb.Completion], None],
              on_lost: Callable[[DecentError], None]) -> None:
        """Open the data channel; ``on_completion`` gets every completion (on the reader
        thread), ``on_lost`` the reason once the channel ends. DecentError if the daemon does
        not take the channel."""
        reg = self.registration
        sock = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(reg.data_socket)
            sock.settimeout(None)
            sock.sendall(framing.encode(pb.WorkerHello(worker_id=reg.worker_id)))
        except OSError as exc:
            self.close(patience=0)
            raise DecentError(pb.PEER_UNAVAILABLE, f"cannot open the daemon's data channel at "
                                                   f"{reg.data_socket}: {exc}") from None
        reader = self._completions = CompletionReader(
            sock, on_completion, on_lost, self.address, lambda: self._closing,
            f"decent-completions-{reg.rank}")
        reader.start()
        if not reader.attached.wait(self.connect_timeout) or reader.lost is not None:
            lost = reader.lost
            self.close(patience=0)  # the daemon did not answer: no point waiting for it again
            raise lost or DecentError(pb.PEER_UNAVAILABLE, f"daemon at {self.address} did not "
                                                           "answer on its data channel")

    def await_event(self, event: Awaitable, timeout: float | None) -> bool:
        """Block until ``event`` (a request's latch) is set, at most ``timeout`` s, reading the
        completions on this thread if no other caller is; whether it is set."""
        if self._completions is None:
            return event.wait(timeout)
        return self._completions.await_event(event, timeout)

    def send(self, req: pb.SubmitRequest) -> None:
        """Write one request to the data channel (no reply: its completion answers it)."""
        assert self._sock is not None
        try:
            with self._send_lock:
                self._sock.sendall(framing.encode(req))
        except OSError as exc:
            raise DecentError(pb.PEER_UNAVAILABLE, f"cannot reach the daemon: {exc}") from None

    # ------------------------------------------------------------------ control calls

    def memory_call(self, req: pb.MemoryRequest, fd: int | None) -> list[int]:
        """One request on the daemon's memory socket (``fd`` rides along); raises its error.
        Returns the descriptors that came with the answer (the caller's to close)."""
        path = self.registration.memory_socket
        reader = framing.FrameReader(1 << 16)
        bodies: list[bytes] = []
        fds: list[int] = []
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(MEMORY_CALL_TIMEOUT)
                sock.connect(path)
                frame = framing.encode(req)
                sent = socket.send_fds(sock, [frame], [] if fd is None else [fd])
                if sent < len(frame):  # the daemon answers and closes once it has all of it
                    sock.sendall(frame[sent:])
                while not bodies:
                    chunk, got, _, _ = socket.recv_fds(sock, 4096, 1)
                    fds.extend(got)
                    if not chunk:
                        break
                    bodies = reader.feed(chunk)
            if not bodies:
                raise DecentError(pb.PEER_UNAVAILABLE, f"memory socket {path} closed without "
                                                       "an answer")
            error = framing.decode(pb.Error, bodies[0])
            if error.code != pb.OK:
                raise DecentError.from_pb(error)
        except (OSError, framing.FrameError) as exc:
            _close_all(fds)
            raise DecentError(pb.PEER_UNAVAILABLE, f"memory socket {path}: {exc}") from None
        except DecentError:
            _close_all(fds)
            raise
        return fds

    def arena_fd(self) -> int:
        """The descriptor of this worker's arena (the daemon hands it over once)."""
        fds = self.memory_call(pb.MemoryRequest(worker_id=self.registration.worker_id,
                                                arena=True), None)
        if len(fds) != 1:
            _close_all(fds)
            raise DecentError(pb.ARENA_ERROR, f"the daemon sent {len(fds)} descriptors for "
                                              "the arena, not 1")
        return fds[0]

    def join(self) -> None:
        """Tell the daemon this worker (of a job it joined late) takes part from now on."""
        self.joining = False
        error: pb.Error = self._stub.Joined(pb.JoinedRequest(
            worker_id=self.registration.worker_id), timeout=MEMORY_CALL_TIMEOUT)
        if error.code != pb.OK:
            raise DecentError.from_pb(error)

    def status(self) -> pb.StatusReply:
        """The daemon's counters and peer health."""
        reply: pb.StatusReply = self._stub.Status(pb.StatusRequest())
        return reply

    def topology(self, name: str, round_: int) -> pb.TopologyInfo:
        """Neighbors and weights at the step round ``round_`` of op ``name`` uses."""
        info: pb.TopologyInfo = self._stub.Topology(pb.TopologyRequest(
            name=name, round=round_, worker_id=self.registration.worker_id))
        return info

    def window(self, name: str) -> pb.WindowInfo:
        """What the daemon holds for window ``name``."""
        info: pb.WindowInfo = self._stub.Window(pb.WindowRequest(
            worker_id=self.registration.worker_id, name=name))
        return info

    def close(self, patience: float) -> None:
        """Close the data channel (waiting up to ``patience`` s for the daemon to let this
        worker go: it closes its end after that) and the control channel."""
        self._closing = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            reader = self._completions
            if reader is not None and not reader.join(patience):
                # the daemon does not answer: stop reading anyway
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                reader.join(5)
            sock.close()
        self._channel.close()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
