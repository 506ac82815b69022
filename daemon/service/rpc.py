"""The daemon's gRPC services: ``Worker`` for local workers (Unix socket), ``Peer`` for daemons."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

import decentd
from decent_wire.errors import DecentError
from decent_wire.protocol import PROTOCOL_VERSION
from decent_wire.topology import Topology
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.engine.requests import Engine
from decentd.keys import at_worker, qualify
from decentd.mailbox.parking import ParkedFrames
from decentd.net.handshake import check_handshake
from decentd.net.links import Links
from decentd.net.outbound import Sender
from decentd.net.peer import PeerLink
from decentd.ops.api import Services
from decentd.security.auth import NONCE_BYTES, shown
from decentd.security.refusals import Refusals
from decentd.security.tls import peer_identity
from decentd.service.peer_status import cluster_status
from decentd.workers.sessions import Sessions

log = logging.getLogger("decentd")


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


@dataclass(frozen=True)
class WorkerEndpoints:
    """What a registered worker is told about this daemon besides its rank."""

    cluster_id: str
    data_socket: str  #: the worker data channel (submissions and completions)
    memory_socket: str  #: memory registration
    default_timeout: float
    ring_threshold: int
    metrics_port: int = 0  #: where /metrics is served (0: not served)


class WorkerService(pb_grpc.WorkerServicer):
    """Local workers: register, status, topology, window queries."""

    def __init__(self, services: Services, sessions: Sessions, engine: Engine,
                 endpoints: WorkerEndpoints, ready: asyncio.Event,
                 parking: ParkedFrames) -> None:
        self._services = services
        self._parking = parking
        self._sessions = sessions
        self._engine = engine
        self._endpoints = endpoints
        self._ready = ready
        self._machine = services.machine
        self._topology = services.topology
        self._started = time.monotonic()

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterReply:
        """Create the worker's arena once the cluster is up."""
        if request.protocol_version != PROTOCOL_VERSION:
            return pb.RegisterReply(error=pb.Error(
                code=pb.VERSION_MISMATCH,
                message=f"worker speaks protocol {request.protocol_version}, daemon rank "
                f"{self._machine} speaks {PROTOCOL_VERSION}"))
        await self._ready.wait()
        local = request.local_rank if request.HasField("local_rank") else None
        try:
            session = await self._sessions.register(request.pid, request.framework, request.job,
                                                    local, self._joining())
        except DecentError as err:
            log.error("worker (pid %d) refused: %s", request.pid, err.message)
            return pb.RegisterReply(error=err.to_pb())
        e, s = self._endpoints, self._services
        return pb.RegisterReply(
            worker_id=session.worker_id,
            rank=session.rank,
            size=s.workers,
            local_rank=session.local_rank,
            local_size=s.per_node,
            machine_rank=s.machine,
            machine_size=s.machines,
            machine_topology=topology_info(s.machine_topology, s.machine, 0),
            arena_bytes=session.arena.nbytes,
            cluster_id=e.cluster_id,
            protocol_version=PROTOCOL_VERSION,
            topology=topology_info(self._topology, session.rank, 0),
            default_timeout_s=e.default_timeout,
            data_socket=e.data_socket,
            memory_socket=e.memory_socket,
            ring_threshold_bytes=e.ring_threshold,
            rejoining=not session.joined,
        )

    def _joining(self) -> bool:
        """Whether a worker registering now joins a job already running elsewhere."""
        return self._services.members.joined_running and self._engine.completed == 0

    async def Joined(
        self, request: pb.JoinedRequest, context: grpc.aio.ServicerContext
    ) -> pb.Error:
        """A worker that joined late took its state: peers include it from now on."""
        session = self._sessions.get(request.worker_id)
        if session is None:
            return pb.Error(code=pb.UNKNOWN_WORKER, message=f"unknown worker "
                                                            f"{shown(request.worker_id)}")
        self._sessions.joined(session)
        return pb.Error()

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """Counters and peer health; with ``cluster``, every daemon's too."""
        own = self.status()
        if request.cluster:
            own.cluster.extend(await cluster_status(self._services.links, own))
        return own

    def status(self) -> pb.StatusReply:
        """Counters and peer health, now (on the event loop)."""
        now = time.monotonic()
        engine, pool = self._engine, self._services.pool
        members = self._services.members
        return pb.StatusReply(
            rank=self._machine,
            size=self._services.machines,
            workers_per_node=self._services.per_node,
            local_workers=[
                pb.LocalWorker(rank=w.rank, local_rank=w.local_rank, pid=w.pid,
                               framework=w.framework, job=w.job,
                               ops_in_flight=(len(w.in_flight)
                                              + engine.hierarchy.requests_of(w)))
                for w in sorted(self._sessions.by_id.values(), key=lambda w: (w.job, w.rank))],
            cluster_id=self._endpoints.cluster_id,
            workers=len(self._sessions),
            ops_in_flight=len(engine.running),
            ops_completed=engine.completed,
            ops_failed=engine.failed,
            topology_kind=self._topology.kind,
            early_arrival_bytes=self._services.mailbox.early_bytes,
            pid=os.getpid(),
            rss_bytes=rss_bytes(),
            pool_bytes=pool.in_use_bytes + pool.idle_bytes,
            pool_peak_bytes=pool.peak_in_use,
            registered_bytes=self._sessions.registered_bytes,
            parked_window_requests=self._services.windows.parked,
            window_lock_waiters=self._services.locks.waiting,
            early_window_bytes=self._services.windows.early_bytes,
            arena_bytes=sum(w.arena.nbytes for w in self._sessions.by_id.values()),
            arena_spills=self._sessions.spills[0],
            arena_spill_bytes=self._sessions.spills[1],
            inputs_streamed=engine.streamed[0],
            inputs_streamed_early_bytes=engine.streamed[1],
            inputs_left_out=engine.left_out,
            group_calls_led=self._services.groups.calls_led,
            window_staleness=self._services.windows.staleness(),
            metrics_port=self._endpoints.metrics_port,
            version=decentd.__version__,
            uptime_s=now - self._started,
            security_mode=self._services.links.auth.mode,
            address=self._services.links.own.address,
            view_epoch=members.epoch,
            live_daemons=members.live_daemons(),
            live_ranks=[w for w in members.live_workers() if w not in members.absent],
            incarnation=members.incarnation,
            on_peer_loss=self._services.on_peer_loss,
            serving_daemons=[r for r, m in members.members.items() if m.serving],
            parked_frames=len(self._parking),
            peers=[self._peer_status(link, now)
                   for link in self._services.links.links.values()],
        )

    def _peer_status(self, link: PeerLink, now: float) -> pb.PeerStatus:
        """One peer's link and membership state."""
        members = self._services.members
        return pb.PeerStatus(
            rank=link.rank,
            address=link.address,
            connected=link.connected,
            last_heartbeat_age_s=now - link.last_heartbeat if link.last_heartbeat else -1,
            bytes_sent=link.bytes_sent,
            bytes_received=link.bytes_received,
            acks_early=link.acks_early,
            acks_late=link.acks_late,
            aborts_received=link.aborts_received,
            frames_sent=link.frames_sent,
            writes=link.writes,
            frames_received=link.inbound.frames_received if link.inbound else 0,
            frames_queued=link.sender.queued if isinstance(link.sender, Sender) else 0,
            state=members.state(link.rank).value,
            incarnation=members.incarnation_of(link.rank),
            reconnects=members.members[link.rank].reconnects,
            down_reason=members.members[link.rank].reason,
            stripes=link.sender.stripes if isinstance(link.sender, Sender) else 0,
            connect_rtt_ms=link.connect_rtt * 1e3,
        )

    async def Topology(
        self, request: pb.TopologyRequest, context: grpc.aio.ServicerContext
    ) -> pb.TopologyInfo:
        """This rank's neighbors at the step that round ``round`` of an op uses (on the topology
        the worker set, if it did)."""
        session = self._sessions.get(request.worker_id) if request.worker_id else None
        topology = session.topology if session is not None and session.topology else \
            self._topology
        rank = session.rank if session is not None else self._machine * self._services.per_node
        return topology_info(topology, rank, int(request.round))

    async def Window(
        self, request: pb.WindowRequest, context: grpc.aio.ServicerContext
    ) -> pb.WindowInfo:
        """What window ``name`` of the worker's job holds on this rank."""
        session = self._sessions.get(request.worker_id)
        if session is None:
            return pb.WindowInfo(error=pb.Error(code=pb.UNKNOWN_WORKER,
                                                message=f"unknown worker {request.worker_id!r}"))
        return self._services.windows.info(at_worker(qualify(session.job, request.name),
                                                     session.rank))


def _lenient(message: type[Message]) -> Callable[[bytes], Message]:
    """A request parser that turns undecodable bytes into an empty request (refused by the
    handler like any other bad one) instead of an exception gRPC logs with a traceback."""
    def parse(data: bytes) -> Message:
        try:
            return message.FromString(data)
        except DecodeError:
            return message()
    return parse


def add_peer_service(service: PeerService, server: grpc.aio.Server) -> None:
    """Serve ``service`` on ``server`` with lenient request parsers."""
    handlers = {
        "Challenge": grpc.unary_unary_rpc_method_handler(
            service.Challenge, _lenient(pb.ChallengeRequest),
            pb.ChallengeReply.SerializeToString),
        "Handshake": grpc.unary_unary_rpc_method_handler(
            service.Handshake, _lenient(pb.HandshakeRequest),
            pb.HandshakeReply.SerializeToString),
        "Status": grpc.unary_unary_rpc_method_handler(
            service.Status, _lenient(pb.PeerStatusRequest),
            pb.StatusReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("decent.v1.Peer",
                                                                          handlers),))


class PeerService(pb_grpc.PeerServicer):
    """Other daemons: the challenge and the handshake (data and heartbeats go over the bulk
    path)."""

    def __init__(self, links: Links, status: Callable[[], pb.StatusReply],
                 handshaken: Callable[[int, int, bool, bool], bool],
                 serving: Callable[[], bool], refusals: Refusals) -> None:
        """``status``: this daemon's (``WorkerService.status``) for peers that ask;
        ``handshaken(rank, incarnation, was_down) -> we counted it out``: a peer passed its
        handshake and connects now;
        ``serving``: whether a job runs here (told to peers that join);
        ``refusals``: where refused callers are counted and logged (at a bounded rate)."""
        self._links = links
        self._refusals = refusals
        self._status = status
        self._handshaken = handshaken
        self._serving = serving

    async def Status(
        self, request: pb.PeerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """This daemon's status for a peer that proves who it is (as at handshake)."""
        links = self._links
        error = None
        if request.cluster_id != links.cluster_id or request.from_rank not in links.links \
                or request.to_rank != links.rank:
            error = pb.Error(code=pb.UNAUTHENTICATED, message="not a peer of this rank")
        elif links.auth.mode == "secret":
            why = links.auth.admit_status(request.from_rank, links.rank, request.server_nonce,
                                          request.proof)
            if why is not None:
                error = pb.Error(code=pb.UNAUTHENTICATED, message=why)
        elif links.auth.mode == "mtls":
            error = self._certificate_error(request, context)
        if error is not None:
            self._refusals.refused("status door", f"refused a status request from rank "
                                   f"{request.from_rank}: {shown(error.message, 300)}")
            return pb.StatusReply(rank=links.rank, error=error)
        return self._status()

    async def Challenge(
        self, request: pb.ChallengeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChallengeReply:
        """Secret mode: our nonce for the caller's, and our proof that we hold the secret."""
        links = self._links
        problem = None
        if links.auth.mode != "secret":
            problem = f"rank {links.rank} runs security mode {links.auth.mode}, not secret"
        elif request.cluster_id != links.cluster_id or request.from_rank not in links.links:
            problem = (f"no peer rank {request.from_rank} in cluster "
                       f"{shown(request.cluster_id)} here")
        elif request.to_rank != links.rank or len(request.client_nonce) != NONCE_BYTES:
            problem = "a challenge for another rank, or a nonce of the wrong size"
        if problem is not None:
            self._refusals.refused("challenge door", f"refused a challenge: {problem}")
            return pb.ChallengeReply(error=pb.Error(code=pb.UNAUTHENTICATED, message=problem))
        nonce, proof = links.auth.challenge(request.from_rank, links.rank,
                                            request.client_nonce)
        return pb.ChallengeReply(server_nonce=nonce, server_proof=proof)

    async def Handshake(
        self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandshakeReply:
        """Check cluster id, protocol version, that the caller reached the rank it meant, and
        (secret mode) its proof."""
        links = self._links
        error = None
        if links.auth.mode == "secret":  # who it is first: nothing else is said to strangers
            why = links.auth.admit_handshake(request.from_rank, links.rank,
                                             request.server_nonce, request.proof)
            if why is not None:
                error = pb.Error(code=pb.UNAUTHENTICATED,
                                 message=f"rank {request.from_rank} refused: {why}")
        if links.auth.mode == "mtls":
            error = self._certificate_error(request, context)
        error = error or check_handshake(links, request)
        if error is not None:
            self._refusals.refused("handshake door", f"refused handshake: {error.message}",
                                   logging.ERROR)
            return pb.HandshakeReply(error=error, rank=links.rank)
        key = links.auth.issue_bulk_key(request.from_rank) if links.auth.mode == "mtls" else b""
        counted_out = self._handshaken(int(request.from_rank), int(request.incarnation),
                                       request.was_down, request.serving)
        return pb.HandshakeReply(rank=links.rank, data_port=links.data_port,
                                 window_bytes=links.window, bulk_key=key,
                                 incarnation=links.incarnation, serving=self._serving(),
                                 was_down=counted_out)

    def _certificate_error(self, request: pb.HandshakeRequest | pb.PeerStatusRequest,
                           context: grpc.aio.ServicerContext) -> pb.Error | None:
        """mtls: UNAUTHENTICATED unless the caller's certificate names the rank it claims."""
        who = peer_identity(context.auth_context())
        if who == (self._links.cluster_id, request.from_rank):
            return None
        named = "no decent rank" if who is None else \
            f"rank {who[1]} of cluster {shown(who[0])}"
        return pb.Error(code=pb.UNAUTHENTICATED, message=(
            f"the caller's certificate names {named}, but it says it is rank "
            f"{request.from_rank} of {shown(request.cluster_id)}"))
