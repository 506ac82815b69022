"""The daemon process: gRPC services for local workers (Unix socket) and peers (TCP)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import time

import grpc

from decentd import PROTOCOL_VERSION
from decentd.arena import Arena
from decentd.config import NodeConfig
from decentd.engine import Engine, WorkerSession
from decentd.errors import OpError, StartupError
from decentd.ops import OPS
from decentd.topology import Topology, TopologyError
from decentd.transport import GRPC_OPTIONS, Transport, qualify
from decentd.windows import WINDOW_OPS, Windows
from decentd.wire import pb, pb_grpc
from decentd.workers import MemorySocket, WorkerChannel

log = logging.getLogger("decentd")

#: /dev/shm names of all arenas start with this (tests and the before-stop hook look for it)
SHM_PREFIX = "decent"
#: a worker must open its completion stream this soon after Register, or its arena is freed
ATTACH_TIMEOUT = 30.0


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def topology_info(topology: Topology, rank: int, step: int) -> pb.TopologyInfo:
    """The wire form of ``rank``'s view of ``topology`` at ``step``."""
    s = topology.step(rank, step)
    return pb.TopologyInfo(
        kind=topology.kind,
        dynamic=topology.dynamic,
        step=step % topology.period,
        in_neighbors=s.in_neighbors,
        out_neighbors=s.out_neighbors,
        self_weight=s.self_weight,
        src_weights=dict(s.src_weights),
        spec_json=topology.spec_json(),
    )


class WorkerService(pb_grpc.WorkerServicer):
    """Local workers: register, submit, stream completions, query."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterReply:
        """Create the worker's arena once the cluster is up."""
        d = self.d
        if request.protocol_version != PROTOCOL_VERSION:
            return pb.RegisterReply(error=pb.Error(
                code=pb.VERSION_MISMATCH,
                message=f"worker speaks protocol {request.protocol_version}, daemon rank "
                f"{d.rank} speaks {PROTOCOL_VERSION}"))
        await d.ready.wait()
        worker_id = secrets.token_hex(8)
        try:
            arena = Arena(d.cfg.memory.arena_bytes, f"{SHM_PREFIX}-{d.rank}-{os.getpid()}",
                          d.cfg.memory.max_regions)
        except OpError as err:
            log.error("worker (pid %d) refused: %s", request.pid, err.message)
            return pb.RegisterReply(error=err.to_pb())
        session = WorkerSession(worker_id, request.pid, request.framework, arena, request.job)
        d.sessions[worker_id] = session
        asyncio.get_running_loop().create_task(d._expire_unattached(session))
        log.info("worker %s (pid %d, %s, job %r) registered", worker_id, request.pid,
                 request.framework, request.job)
        return pb.RegisterReply(
            worker_id=worker_id,
            rank=d.rank,
            size=d.size,
            arena_name=arena.name,
            arena_bytes=arena.nbytes,
            cluster_id=d.cfg.cluster_id,
            protocol_version=PROTOCOL_VERSION,
            topology=topology_info(d.topology, d.rank, 0),
            default_timeout_s=d.cfg.timeouts.op,
            data_socket=d.data_socket,
            memory_socket=d.memory.path,
            ring_threshold_bytes=d.cfg.transport.ring_threshold_bytes,
        )

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """Counters and peer health."""
        d = self.d
        now = time.monotonic()
        return pb.StatusReply(
            rank=d.rank,
            size=d.size,
            cluster_id=d.cfg.cluster_id,
            workers=len(d.sessions),
            ops_in_flight=len(d.engine.running),
            ops_completed=d.engine.completed,
            ops_failed=d.engine.failed,
            topology_kind=d.topology.kind,
            early_arrival_bytes=d.transport.early_bytes,
            pid=os.getpid(),
            rss_bytes=rss_bytes(),
            pool_bytes=d.transport.pool.in_use_bytes + d.transport.pool.idle_bytes,
            pool_peak_bytes=d.transport.pool.peak_in_use,
            registered_bytes=sum(s.arena.region_bytes for s in d.sessions.values()),
            peers=[
                pb.PeerStatus(
                    rank=link.rank,
                    address=link.address,
                    connected=link.connected,
                    last_heartbeat_age_s=now - link.last_heartbeat if link.last_heartbeat else -1,
                    bytes_sent=link.bytes_sent,
                    bytes_received=link.bytes_received,
                    acks_early=link.acks_early,
                    acks_late=link.acks_late,
                )
                for link in d.transport.links.values()
            ],
        )

    async def Topology(
        self, request: pb.TopologyRequest, context: grpc.aio.ServicerContext
    ) -> pb.TopologyInfo:
        """This rank's neighbors at the step that round ``round`` of an op uses."""
        return topology_info(self.d.topology, self.d.rank, int(request.round))

    async def Window(
        self, request: pb.WindowRequest, context: grpc.aio.ServicerContext
    ) -> pb.WindowInfo:
        """What window ``name`` of the worker's job holds on this rank."""
        session = self.d.sessions.get(request.worker_id)
        if session is None:
            return pb.WindowInfo(error=pb.Error(code=pb.UNKNOWN_WORKER,
                                                message=f"unknown worker {request.worker_id!r}"))
        windows = self.d.engine.windows
        assert windows is not None
        return windows.info(qualify(session.job, request.name))


class PeerService(pb_grpc.PeerServicer):
    """Other daemons: handshake and heartbeat (data goes over the bulk path)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def Handshake(
        self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandshakeReply:
        """Check cluster id, protocol version and that the caller reached the rank it meant."""
        error = self.d.transport.check_handshake(request)
        if error is not None:
            log.error("refused handshake: %s", error.message)
            return pb.HandshakeReply(error=error, rank=self.d.rank)
        return pb.HandshakeReply(rank=self.d.rank, data_port=self.d.transport.data_port,
                                 window_bytes=self.d.transport.window)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply:
        """Liveness, for tools; daemons hear from each other on the bulk connections."""
        link = self.d.transport.links.get(request.from_rank)
        if link is not None:
            link.last_heartbeat = time.monotonic()
        return pb.HeartbeatReply(rank=self.d.rank, uptime_s=time.monotonic() - self.d.started)


class Daemon:
    """One decentd: owns the servers, the transport, the engine and the worker sessions."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.rank = cfg.resolved_rank()
        self.size = cfg.size
        if cfg.peers and not 0 <= self.rank < self.size:
            raise StartupError(f"config error: rank: {self.rank} is outside peers "
                               f"(there are {self.size})")
        try:
            self.topology = cfg.topology.build(self.size)
        except TopologyError as exc:
            raise StartupError(f"config error: topology: {exc}") from None
        self.started = time.monotonic()
        self.ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.sessions: dict[str, WorkerSession] = {}
        self.transport = Transport(
            self.rank, cfg.peers or ["local"], cfg.cluster_id, cfg.memory.early_arrival_bytes,
            self._on_abort, self._on_peer_down,
            lambda name, round_: (name, round_) in self.engine.running,
            lambda *args: self.engine.check_arrival(*args),
            cfg.memory.pool_bytes,
        )
        self.transport.topology_digest = self.topology.digest()
        self.engine = Engine(
            self.rank, self.size, self.topology, self.transport, cfg.timeouts.op,
            cfg.timeouts.stall_warning, cfg.transport.ring_threshold_bytes,
            {**OPS, **WINDOW_OPS},
        )
        self.engine.windows = Windows(self.rank, self.size, self.transport,
                                      cfg.timeouts.op)
        self.transport.on_one_sided = self.engine.windows.on_message
        self.transport.on_group_failed = self.engine.windows.group_failed
        self._tasks: list[asyncio.Task[None]] = []
        self.peer_port = 0
        self.data_socket = f"{cfg.socket}.data"
        self.channels: set[WorkerChannel] = set()
        self.memory = MemorySocket(self, f"{cfg.socket}.mem")

    def _on_abort(self, src: int, name: str, round_: int, error: pb.Error) -> None:
        self.engine.on_abort(src, name, round_, error)

    def _on_peer_down(self, src: int, reason: str) -> None:
        self.engine.on_peer_down(src, reason)

    def region_count(self) -> int:
        """Worker memory regions mapped, over all workers."""
        return sum(s.arena.region_count for s in self.sessions.values())

    def drop_session(self, session: WorkerSession) -> None:
        """Forget a worker: fail its in-flight ops, then release its arena."""
        if self.sessions.pop(session.worker_id, None) is None:
            return
        tasks = []
        for key in list(session.in_flight):
            ctx = self.engine.running.get(key)
            if ctx is not None:
                ctx.fail(OpError(pb.ABORTED, f"{ctx.label}: its worker went away"))
                if ctx.task is not None:
                    tasks.append(ctx.task)
        log.info("worker %s left", session.worker_id)
        asyncio.get_running_loop().create_task(self._retire(session, tasks))

    async def _retire(self, session: WorkerSession, tasks: list[asyncio.Task[None]]) -> None:
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        session.arena.close()
        if not self.sessions:
            # a later job starts its (name, round) keys at 0 again: nothing of this one may linger
            self.engine.forget_history()

    async def _expire_unattached(self, session: WorkerSession) -> None:
        await asyncio.sleep(ATTACH_TIMEOUT)
        if not session.attached:
            log.warning("worker %s registered but never opened its completion stream; dropped",
                        session.worker_id)
            self.drop_session(session)

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then shut down cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        peer_server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_PeerServicer_to_server(PeerService(self), peer_server)
        worker_server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_WorkerServicer_to_server(WorkerService(self), worker_server)
        sock = self.cfg.socket
        for path in (sock, self.data_socket):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        data_server = await loop.create_unix_server(self._channel, self.data_socket)
        self.memory.start()
        try:
            if self.cfg.peers:
                host = self.cfg.listen_address().rsplit(":", 1)[0]
                await self.transport.start_server(host, self.cfg.transport.data_port)
        except OSError as exc:
            data_server.close()
            self.memory.close()
            raise StartupError(f"cannot listen for bulk data on port "
                               f"{self.cfg.transport.data_port}: {exc}") from None
        try:
            if self.cfg.peers:
                self.peer_port = peer_server.add_insecure_port(self.cfg.listen_address())
                if self.peer_port == 0:
                    raise StartupError(f"cannot listen for peers on {self.cfg.listen_address()}")
            worker_server.add_insecure_port(f"unix://{sock}")
        except RuntimeError as exc:
            raise StartupError(f"cannot bind: {exc}") from None
        await peer_server.start()
        await worker_server.start()
        log.info("rank %d/%d listening for peers on %s, workers on %s (topology %s)",
                 self.rank, self.size, self.cfg.listen_address(), sock, self.topology.kind)
        try:
            connect = asyncio.ensure_future(self.transport.connect_all(self.cfg.timeouts.start))
            stop = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait({connect, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not connect.done():
                connect.cancel()
                raise StartupError("stopped before all peers were reachable")
            stop.cancel()
            connect.result()
            # everything allocated so far lives as long as the daemon: keep the cyclic GC from
            # walking it again and again on the hot path (a few % of a busy daemon's CPU)
            gc.collect()
            gc.freeze()
            self.ready.set()
            log.info("rank %d: all %d peers connected; ready", self.rank, self.size - 1)
            self._tasks = [
                loop.create_task(self.engine.stall_inspector()),
                loop.create_task(self.transport.heartbeat_loop(self.cfg.timeouts.heartbeat)),
            ]
            await self.stopping.wait()
            log.info("rank %d: shutting down", self.rank)
        finally:
            await self._shutdown(peer_server, worker_server, data_server)

    def _channel(self) -> WorkerChannel:
        channel = WorkerChannel(self)
        self.channels.add(channel)
        return channel

    async def _shutdown(self, peer_server: grpc.aio.Server, worker_server: grpc.aio.Server,
                        data_server: asyncio.AbstractServer) -> None:
        self.stopping.set()
        # grpc logs every stream it cuts at server stop; at shutdown that is expected, not news
        logging.getLogger("grpc._cython.cygrpc").setLevel(logging.CRITICAL)
        for task in self._tasks:
            task.cancel()
        try:  # a write to a peer that stopped reading must not hold the shutdown forever
            await asyncio.wait_for(self.engine.shutdown("SIGTERM"),
                                   self.cfg.timeouts.shutdown + 10)
        except TimeoutError:
            log.warning("some ops did not finish within the shutdown grace; stopping anyway")
        data_server.close()
        self.memory.close()
        for channel in list(self.channels):
            channel.close()  # after the completions written above
        self.channels.clear()
        await worker_server.stop(grace=self.cfg.timeouts.shutdown)
        await self.transport.close()
        await peer_server.stop(grace=0.5)
        left = list(self.sessions.values())
        for session in left:
            self.drop_session(session)
        for session in left:  # ops are done (engine.shutdown waited): release arenas now
            session.arena.close()
        for path in (self.cfg.socket, self.data_socket, self.memory.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        log.info("rank %d: stopped", self.rank)
