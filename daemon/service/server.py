"""The daemon process: its parts built once from the config, then served until SIGTERM.

Layers, each built whole and handed to the ones above it: the peer :class:`~decentd.net.links.Links`
(connections, handshake, heartbeat, sending, flow control), the
:class:`~decentd.mailbox.slots.Mailbox` (matching what arrives to the ops that take it), the window
services (:mod:`decentd.windows`), the :class:`~decentd.mailbox.receiver.Receiver` (the peers'
frames), the ops' :class:`Services`, the :class:`~decentd.engine.requests.Engine` (requests), the
worker :class:`~decentd.workers.sessions.Sessions`, and the servers: gRPC for control, Unix sockets
for the worker data channel and memory registration, TCP for the bulk path.

As a service (``deploy/systemd``) it tells systemd when it is ready (its peers connected),
reloading (SIGHUP: :mod:`decentd.service.reload`) and stopping, through
:mod:`decentd.service.notify`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import ssl
import time

import grpc
from prometheus_client import CollectorRegistry

from decent_wire.topology import Topology, TopologyError
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.engine.requests import Engine
from decentd.errors import ConfigError, StartupError
from decentd.mailbox.parking import ParkedFrames
from decentd.mailbox.receiver import Receiver
from decentd.mailbox.slots import Mailbox
from decentd.membership.liveness import Supervisor
from decentd.membership.view import Membership
from decentd.net.buffers import BufferPool
from decentd.net.flow import window_per_peer
from decentd.net.grpc_options import GRPC_OPTIONS, peer_server_options
from decentd.net.links import Links
from decentd.ops import OPS
from decentd.ops.api import Services
from decentd.security.auth import PeerAuth, read_secret
from decentd.security.local_access import LocalAccess
from decentd.security.refusals import Refusals
from decentd.service.config import NodeConfig, TopologyConfig
from decentd.service.descriptors import DescriptorWatch, raise_limit
from decentd.service.metrics import MetricsServer, OpMetrics, StatusCollector
from decentd.service.reload import Service, assign, changes, split, summary
from decentd.service.rpc import PeerService, WorkerEndpoints, WorkerService, add_peer_service
from decentd.service.timeline import open_timeline
from decentd.windows import one_sided_handlers
from decentd.windows.groups import GroupSums
from decentd.windows.locks import LockService, WindowLocks
from decentd.windows.store import WindowStore
from decentd.workers.channel import MemorySocket, WorkerChannel
from decentd.workers.sessions import Sessions

log = logging.getLogger("decentd")


def build_auth(cfg: NodeConfig, rank: int) -> PeerAuth:
    """What this daemon asks of its peers (ConfigError when the config cannot give it)."""
    sec = cfg.security
    if sec.mode == "mtls":
        from decentd.security.tls import Tls  # cryptography: only when certificates are used

        try:
            tls = Tls.load(str(sec.ca), str(sec.cert), str(sec.key), sec.encrypt_bulk)
        except (ValueError, ssl.SSLError) as exc:
            raise ConfigError(f"config error: {exc}") from None
        if tls.identity() != (cfg.cluster_id, rank):
            raise ConfigError(f"config error: security.cert {sec.cert} names "
                              f"{tls.identity() or 'no decent rank'}, but this daemon is rank "
                              f"{rank} of cluster {cfg.cluster_id!r}")
        return PeerAuth("mtls", cfg.cluster_id, tls=tls)
    if sec.mode == "secret":
        try:
            secret = read_secret(str(sec.secret_file))
        except ValueError as exc:
            raise ConfigError(f"config error: security.secret_file: {exc}") from None
        return PeerAuth("secret", cfg.cluster_id, secret)
    return PeerAuth("insecure", cfg.cluster_id)


def averaging_topology(config: TopologyConfig, size: int, key: str) -> Topology:
    """``config`` over ``size`` ranks, whose weights average: finite, non-negative and summing
    to 1 for every receiver (a ConfigError naming ``key`` and the entry otherwise)."""
    try:
        topology = config.build(size)
        topology.check(["row-stochastic"], "averaging")
    except TopologyError as exc:
        raise ConfigError(f"config error: {key}: {exc}") from None
    return topology


def build_services(cfg: NodeConfig, rank: int,
                   refusals: Refusals) -> tuple[Services, Receiver, Supervisor]:
    """The peer-facing layers of one daemon, wired bottom up (``refusals``: where callers
    refused at the bulk port are counted)."""
    topology = averaging_topology(cfg.topology, cfg.worker_count, "topology")
    machine_topology = averaging_topology(cfg.machine_topology_config(), cfg.size,
                                          "machine_topology")
    addresses = cfg.peers or ["local"]
    pool = BufferPool(cfg.memory.pool_bytes, cfg.memory.pool_floor_bytes,
                      cfg.memory.pool_idle_seconds)
    links = Links(rank, addresses, cfg.cluster_id,
                  window_per_peer(cfg.memory.early_arrival_bytes, len(addresses) - 1),
                  topology.digest(), cfg.workers_per_node, machine_topology.digest(),
                  build_auth(cfg, rank), cfg.timeouts.auth, incarnation=time.time_ns(),
                  refusals=refusals, striping=cfg.transport.striping())
    members = Membership(rank, len(addresses), links.incarnation, cfg.workers_per_node)
    mailbox = Mailbox(links.outbox)
    windows = WindowStore(cfg.worker_count, links, cfg.timeouts.op,
                          cfg.memory.window_early_bytes)
    groups = GroupSums(windows, links, mailbox, lambda w: not members.worker_gone(w))
    locks = WindowLocks()
    services = Services(machine=rank, machines=cfg.size, per_node=cfg.workers_per_node,
                        topology=topology, machine_topology=machine_topology, links=links,
                        mailbox=mailbox, pool=pool, windows=windows, groups=groups, locks=locks,
                        ring_threshold=cfg.transport.ring_threshold_bytes, members=members,
                        on_peer_loss=cfg.faults.on_peer_loss)
    handlers = one_sided_handlers(windows, groups, LockService(locks, links))
    faults = cfg.faults
    parking = ParkedFrames(links, pool)
    supervisor = Supervisor(links, members, mailbox, parking, handlers.peer_lost,
                            cfg.timeouts.heartbeat,
                            faults.peer_dead_after or 3 * cfg.timeouts.heartbeat,
                            faults.reconnect_max_delay)
    receiver = Receiver(links, mailbox, pool, handlers, groups.failed, supervisor, parking)
    return services, receiver, supervisor


async def trim_pool(pool: BufferPool) -> None:
    """Give idle receive buffers back after a burst, checking a few times per idle period."""
    while True:
        await asyncio.sleep(min(1.0, pool.idle_seconds / 4))
        freed = pool.trim()
        if freed:
            log.debug("freed %d MiB of idle receive buffers (%d MiB idle kept)", freed >> 20,
                      pool.idle_bytes >> 20)


class Daemon:
    """One decentd: its layers, its servers and its lifecycle."""

    def __init__(self, cfg: NodeConfig, service: Service | None = None) -> None:
        """Build every layer from ``cfg``; ``service``: how it runs as a service (re-reading
        its config at SIGHUP, notifying systemd)."""
        self.cfg = cfg
        self.service = service or Service()
        self.notifier = self.service.notifier
        self.rank = cfg.resolved_rank()
        if cfg.peers and not 0 <= self.rank < cfg.size:
            raise ConfigError(f"config error: rank: {self.rank} is outside peers "
                              f"(there are {cfg.size})")
        exposed = cfg.exposure_error()
        if exposed is not None:
            raise ConfigError(exposed)
        self.registry = CollectorRegistry()
        self.refusals = Refusals(self.registry)
        self.services, self.receiver, self.supervisor = build_services(cfg, self.rank,
                                                                       self.refusals)
        self.links = self.services.links
        observers = [OpMetrics(self.registry)] if cfg.metrics.port is not None else []
        self.timeline = open_timeline(cfg.timeline.path, self.rank, cfg.workers_per_node)
        self.engine = Engine(self.services, OPS, cfg.timeouts.op, cfg.timeouts.stall_warning,
                             observers + ([self.timeline] if self.timeline else []),
                             self.receiver.replay_placeable)
        try:
            self.access = LocalAccess(cfg.security.allowed_uids, cfg.security.worker_group)
        except ValueError as exc:
            raise ConfigError(f"config error: {exc}") from None
        self.sessions = Sessions(self.engine, self.rank, cfg.workers_per_node,
                                 cfg.memory.arena_bytes, cfg.memory.max_regions, self.access,
                                 cfg.memory.max_arenas or 4 * cfg.workers_per_node)
        self.ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.data_socket = f"{cfg.socket}.data"
        self.channels: set[WorkerChannel] = set()
        self.memory = MemorySocket(self.sessions, f"{cfg.socket}.mem", self.access)
        self.metrics = self._serve_metrics()
        self.endpoints = WorkerEndpoints(cfg.cluster_id, self.data_socket, self.memory.path,
                                         cfg.timeouts.op, cfg.transport.ring_threshold_bytes,
                                         self.metrics.port if self.metrics else 0)
        self._tasks: list[asyncio.Task[None]] = []

    def _serve_metrics(self) -> MetricsServer | None:
        """``/metrics`` on ``metrics.port`` (None when not configured)."""
        port = self.cfg.metrics.port
        if port is None:
            return None
        try:
            server = MetricsServer(self.registry, self.cfg.metrics.host, port)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {self.cfg.metrics.host}:{port}: "
                               f"{exc.strerror}") from None
        log.info("metrics on http://%s:%d/metrics", self.cfg.metrics.host, server.port)
        return server

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then shut down cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        peer_server = grpc.aio.server(options=peer_server_options(self.cfg.timeouts.auth))
        worker_service = WorkerService(self.services, self.sessions, self.engine,
                                       self.endpoints, self.ready, self.receiver.parking)
        add_peer_service(PeerService(self.links, worker_service.status,
                                     self.supervisor.handshake_from,
                                     lambda: self.engine.completed > 0, self.refusals),
                         peer_server)
        worker_server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_WorkerServicer_to_server(worker_service, worker_server)
        if self.metrics is not None:  # read at every scrape, on this loop

            async def snapshot() -> pb.StatusReply:
                return worker_service.status()

            self.registry.register(StatusCollector(snapshot, loop))
        descriptors = DescriptorWatch(raise_limit())
        data_server = await self._listen(peer_server, worker_server)
        try:
            self._tasks = [loop.create_task(descriptors.run(self.cfg.timeouts.heartbeat))]
            await self._connect()
            self._tasks += [
                loop.create_task(self.engine.stall_inspector()),
                loop.create_task(self.supervisor.watch()),
                loop.create_task(trim_pool(self.services.pool)),
            ]
            await self.stopping.wait()
            log.info("rank %d: shutting down", self.rank)
        finally:
            await self._shutdown(peer_server, worker_server, data_server)

    async def _listen(self, peer_server: grpc.aio.Server,
                      worker_server: grpc.aio.Server) -> asyncio.AbstractServer:
        """Open every socket: the worker data channel, memory registration, the bulk path, and
        both gRPC servers."""
        cfg = self.cfg
        try:
            self.access.prepare_default_dir(cfg.socket)
        except (ValueError, OSError) as exc:
            raise StartupError(f"socket {cfg.socket}: {exc}") from None
        for path in (cfg.socket, self.data_socket):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        data_server = await asyncio.get_running_loop().create_unix_server(
            lambda: WorkerChannel(self.sessions, self.engine, self.channels, self.access),
            self.data_socket)
        self.memory.start()
        self.links.start_loopback(self.receiver)
        tls = self.links.auth.tls
        try:
            if cfg.peers:
                host = cfg.listen_address().rsplit(":", 1)[0]
                await self.links.listen(host, cfg.transport.data_port, self.receiver,
                                        tls.server_context() if tls and tls.encrypt_bulk
                                        else None)
        except OSError as exc:
            data_server.close()
            self.memory.close()
            raise StartupError(f"cannot listen for bulk data on port "
                               f"{cfg.transport.data_port}: {exc}") from None
        try:
            bound = 1 if not cfg.peers else (
                peer_server.add_secure_port(cfg.listen_address(), tls.server_credentials())
                if tls is not None else peer_server.add_insecure_port(cfg.listen_address()))
            if bound == 0:
                raise RuntimeError("no address bound")
        except RuntimeError:
            raise StartupError(f"cannot listen for peers on {cfg.listen_address()}: the "
                               "address is in use (another decentd?) or not this host's"
                               ) from None
        try:
            worker_server.add_insecure_port(f"unix://{cfg.socket}")
        except RuntimeError as exc:
            raise StartupError(f"cannot listen for workers on {cfg.socket}: {exc}") from None
        await peer_server.start()
        await worker_server.start()
        for path in (cfg.socket, self.data_socket, self.memory.path):
            self.access.protect(path)
        self._announce()
        return data_server

    def _announce(self) -> None:
        """Say where this daemon listens (the log, and systemd's status line)."""
        cfg, tls = self.cfg, self.links.auth.tls
        bulk = "bulk over TLS" if tls is not None and tls.encrypt_bulk else (
            "bulk in clear, bound to the handshake" if self.links.auth.proves else "bulk in clear")
        log.info("rank %d/%d listening for peers on %s, bulk data on port %d, %d worker(s) on "
                 "%s (topology %s, machine topology %s; security: %s, %s)", self.rank,
                 cfg.size, cfg.listen_address(), self.links.data_port, cfg.workers_per_node,
                 cfg.socket, self.services.topology.kind, self.services.machine_topology.kind,
                 cfg.security.mode or "none, loopback only", bulk)
        if cfg.security.mode == "insecure":
            log.warning("security.mode is insecure: any process that reaches %s can join this "
                        "cluster and put values into its averages", cfg.listen_address())
        log.debug("rank %d: running config: %s", self.rank, cfg.model_dump_json())
        self.notifier.status(f"rank {self.rank}/{cfg.size}: listening on "
                             f"{cfg.listen_address()}; connecting to {cfg.size - 1} peer(s)")

    async def _connect(self) -> None:
        """Handshake with every peer (or stop trying at SIGTERM); then ready for workers."""
        needed = self.cfg.faults.min_nodes or self.cfg.size
        connect = asyncio.ensure_future(self.supervisor.start(self.cfg.timeouts.start,
                                                              min(needed, self.cfg.size)))
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
        self.links.rounds.ready = True  # peers that come up from now on joined late
        self.ready.set()
        live = self.services.members.live_daemons()
        if len(live) == self.cfg.size:
            log.info("rank %d: all %d peers connected; ready", self.rank, self.cfg.size - 1)
        else:
            log.info("rank %d: %d of %d daemons up (faults.min_nodes %d): ready; the others may "
                     "join later", self.rank, len(live), self.cfg.size, needed)
        self.notifier.ready(self._status())

    def _status(self) -> str:
        """The ``STATUS=`` line of a ready daemon."""
        return (f"rank {self.rank}/{self.cfg.size}: {self.cfg.size - 1} peer(s) connected; "
                f"serving workers on {self.cfg.socket}")

    def reload(self) -> None:
        """SIGHUP: read the config again and apply what may change while running (the log
        level and format, default op timeout, stall warning, shutdown grace); warn about
        changed keys that need a restart, and keep their running values. A config that does
        not load changes nothing."""
        ready = self.ready.is_set() and not self.stopping.is_set()
        if ready:
            self.notifier.reloading()
        if self.service.reread is None:
            status = "SIGHUP: no config to re-read (started without one); nothing changed"
            log.warning("%s", status)
        else:
            try:
                status = self._reconfigure(self.service.reread())
            except StartupError as exc:
                status = f"reload failed, running config kept: {exc}"
                log.error("SIGHUP: %s", status)
            except Exception as exc:  # a bug: say so, keep running, and answer systemd
                status = f"reload failed, running config kept: internal error: {exc!r}"
                log.exception("SIGHUP: %s", status)
        if ready:
            self.notifier.ready(f"{self._status()} ({status})")
        else:
            self.notifier.status(status)

    def _reconfigure(self, reread: NodeConfig) -> str:
        """Apply the reloadable changes of ``reread``; the summary of what changed."""
        applied, ignored = split(changes(self.cfg, reread))
        assign(self.cfg, applied)
        timeouts = self.cfg.timeouts
        self.engine.default_timeout = timeouts.op
        self.engine.stall_warning = timeouts.stall_warning
        self.services.windows.timeout = timeouts.op
        if self.service.log is not None:
            self.service.log.apply(self.cfg.log_level, self.cfg.log_format)
        text = summary(self.service.path, applied, ignored)
        log.info("SIGHUP: %s", text)
        if ignored:
            log.warning("SIGHUP: changed keys that need a restart were ignored (running "
                        "values kept): %s", ", ".join(c.key for c in ignored))
        log.debug("rank %d: running config: %s", self.rank, self.cfg.model_dump_json())
        return text

    async def _shutdown(self, peer_server: grpc.aio.Server, worker_server: grpc.aio.Server,
                        data_server: asyncio.AbstractServer) -> None:
        self.stopping.set()
        self.notifier.stopping(f"rank {self.rank}: shutting down")
        # grpc logs every stream it cuts at server stop; at shutdown that is expected, not news
        logging.getLogger("grpc._cython.cygrpc").setLevel(logging.CRITICAL)
        for task in self._tasks:
            task.cancel()
        await self.supervisor.close()  # peers that stop now are not reached again
        try:  # a write to a peer that stopped reading must not hold the shutdown forever
            await asyncio.wait_for(self.engine.shutdown("SIGTERM"),
                                   self.cfg.timeouts.shutdown + 10)
        except TimeoutError:
            log.warning("some ops did not finish within the shutdown grace; stopping anyway")
        if self.timeline is not None:  # every op has ended: the file gets its closing bracket
            self.timeline.close()
        data_server.close()
        self.memory.close()
        for channel in list(self.channels):  # after the completions written above
            channel.close(goodbye=f"daemon rank {self.rank} is shutting down (SIGTERM)")
        self.channels.clear()
        await worker_server.stop(grace=self.cfg.timeouts.shutdown)
        await self.links.close()
        await peer_server.stop(grace=0.5)
        self.sessions.drop_all()
        if self.metrics is not None:
            self.metrics.close()
        for path in (self.cfg.socket, self.data_socket, self.memory.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        log.info("rank %d: stopped", self.rank)
