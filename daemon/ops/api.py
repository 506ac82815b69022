"""What an op may use: its request, its tensors, and the daemon's services, all through one
:class:`OpContext`.

An op reads the worker's input tensors (storage-dtype views of the arena), talks to exactly the
peers it involves with :meth:`OpContext.send` and :meth:`OpContext.recv_parts` (which match parts
by ``(peer, name, round, tag)`` in the mailbox and check what arrives against what this op
has), and writes its result into the worker's output region. The engine builds the context and
runs the op; the op sees nothing else of the daemon."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.ops import Agreed, op_types
from decent_wire.protocol import clash, op_label
from decent_wire.topology import Step, Topology
from decent_wire.v1 import decent_pb2 as pb
from decentd.concurrency import gather_all
from decentd.errors import VERDICT_CODES, PeerLost
from decentd.keys import part
from decentd.mailbox.arrivals import Arrival
from decentd.mailbox.records import Accepts, Key, Progress
from decentd.mailbox.slots import Mailbox
from decentd.membership.view import Membership, PeerState
from decentd.net.buffers import BufferPool
from decentd.net.links import Links
from decentd.net.outbound import Outgoing
from decentd.ops.parts import Expected, PartSpec
from decentd.ops.phases import Phases
from decentd.windows.groups import GroupSums
from decentd.windows.locks import WindowLocks
from decentd.windows.store import WindowStore

__all__ = ["Arrival", "DecentError", "Level", "OpContext", "OpResult", "OpSpec", "Outgoing",
           "PartSpec", "Progress", "Services", "gather_all", "part"]

#: collectives of the daemons that run beside their agreement, which decides how they end
AGREED_AMONG_DAEMONS = op_types(agreed=Agreed.NODES)


@dataclass(frozen=True, kw_only=True)
class Services:
    """The daemon services ops use, handed to every op explicitly (built by keyword)."""

    machine: int  #: this daemon's rank among the daemons
    machines: int  #: daemons in the cluster
    per_node: int  #: workers per daemon
    topology: Topology  #: over the workers (the default of their ops)
    machine_topology: Topology  #: over the daemons (hierarchical ops)
    links: Links
    mailbox: Mailbox
    pool: BufferPool  #: reusable buffers (a ring allreduce's working copy)
    windows: WindowStore
    groups: GroupSums  #: WAGMA's group sums
    locks: WindowLocks  #: window mutexes
    ring_threshold: int  #: allreduce of a lone tensor this large runs as a ring
    members: Membership  #: which peer daemons are up, and the view's epoch
    on_peer_loss: str = "reweight"  #: ``faults.on_peer_loss``: reweight or fail

    @property
    def workers(self) -> int:
        """Workers in the cluster."""
        return self.machines * self.per_node


@dataclass(frozen=True)
class Level:
    """Whom an op runs among: the workers (worker ranks, their topology) or, for a node's
    part of a hierarchical collective, the daemons (``node``)."""

    rank: int
    size: int
    topology: Topology
    node: bool = False


@dataclass(slots=True)
class OpResult:
    """What an op wrote to the worker's output region."""

    out_nbytes: int
    shape: tuple[int, ...]
    src_ranks: list[int] = field(default_factory=list)
    #: an agreement's verdict against running its collective (the agreement itself ended well:
    #: every participant draws the same one, so nobody is told to abort)
    verdict: DecentError | None = None
    #: the output holds the in-neighbor's tensor, which the worker combines with its own so
    #: (SubmitRequest.combining)
    combine: pb.Combine | None = None


OpFn = Callable[["OpContext"], Awaitable[OpResult]]


@dataclass(frozen=True)
class OpSpec:
    """An op: how to run it, and which peers it involves (known before it runs, so that an op
    failing before or while it starts can tell them)."""

    run: OpFn
    peers: Callable[[OpContext], set[int]]
    #: the message tags this op can receive (None: any); another tag means the sender went
    #: another way (e.g. another broadcast root, ring vs. direct allreduce)
    tags: Callable[[OpContext], set[int] | None] = lambda _ctx: None
    #: what a tag disagreement means, for the MISMATCH message
    tag_hint: str = "different message tags"
    #: gathers: the first-dimension rows each peer sends (None: the same shape as ours)
    rows: Callable[[OpContext], dict[int, int] | None] = lambda _ctx: None
    #: counted in ``ops_completed`` (an agreement is part of its collective, not an op of its own)
    counted: bool = True
    #: whether its participants agree in its own exchange (``Part.agreement``), not beside it
    agrees_itself: Callable[[OpContext], bool] = lambda _ctx: False


class OpContext:
    """One running op: its request, its tensors and peers, and send/receive with checks."""

    #: the op's neighbors come from the topology: its name travels with what it sends, and a
    #: peer on another topology fails the op with MISMATCH
    on_topology = False
    warned_at = 0.0
    task: asyncio.Task[None] | None = None
    failure: DecentError | None = None
    aborted_by = -1
    running = False  #: set once the task has started
    #: phase marks while a timeline records (set by the engine), else None
    phases: Phases | None = None
    #: a collective's ranks (the live ones when it was planned), ascending; None: not one
    group: list[int] | None = None
    #: a collective's view (its live ranks and their incarnations): travels with what it
    #: sends, and a peer that planned with another view fails the op with MISMATCH
    view_name = ""
    #: ``@<live ranks>`` when a dynamic schedule runs over the live ranks only
    live_schedule = ""
    #: what the op planned when its peers were asked for (e.g. its neighbor weights), reused
    #: when it runs right after
    plan: Any = None

    def __init__(self, services: Services, op: int, args: Any, parts: list[PartSpec],
                 spec: OpSpec, level: Level) -> None:
        self.services = services
        #: the topology of the op's level (a worker's: its job's when it was submitted)
        self.topology = level.topology
        self.rank = level.rank
        self.size = level.size
        self.level = level
        self.op = op
        #: the op's typed arguments (``pb.NeighborAllreduce``, ``pb.Broadcast``, ...)
        self.args = args
        self.spec = spec
        self.parts = parts
        first = parts[0]
        #: the op's key on the wire (the job id, if any, qualifies the user's name)
        self.name = first.name
        self.display = first.display
        self.round = first.round
        self.dtype = first.dtype
        self.shape = first.shape
        self.waiting: set[int] = set()  #: ranks whose data this op still needs
        self.unacked: set[int] = set()  #: ranks that have not yet matched what this op sent
        self.participants: set[int] = set()
        self.started = time.monotonic()
        #: peers lost while the op ran and left out (reweight): told so (SKIP) when it ends
        self.left_out: set[int] = set()

    @cached_property
    def by_name(self) -> dict[str, PartSpec]:
        """The op's tensors by wire name."""
        return {p.name: p for p in self.parts}

    @cached_property
    def payload(self) -> list[memoryview]:
        """Every part's input, in order: the payload of this op's messages (sent gathered)."""
        return [p.raw for p in self.parts]

    @cached_property
    def agrees_in_exchange(self) -> bool:
        """Whether its participants agree in its own exchange (the spec decides, once)."""
        return self.parts[0].agreement is not None and self.spec.agrees_itself(self)

    @cached_property
    def keys(self) -> list[tuple[str, int]]:
        """The ``(name, round)`` of every tensor of the op."""
        return [(p.name, p.round) for p in self.parts]

    @cached_property
    def label(self) -> str:
        """``neighbor_allreduce 'w' round 3`` for messages."""
        fused = f" (+{len(self.parts) - 1} fused)" if len(self.parts) > 1 else ""
        return f"{op_label(self.op)} '{self.display}'{fused} round {self.round}"

    def topology_step(self, rank: int | None = None) -> Step:
        """This rank's (or ``rank``'s) neighbors and weights at this op's step (= its round)."""
        return self.topology.step(self.rank if rank is None else rank, self.round)

    @property
    def topology_name(self) -> str:
        """``ring#1a2b3c4d``: the topology's kind and digest, for messages and mismatches
        (``@0,1,2``: a dynamic schedule over these live ranks only)."""
        return self.topology.name + self.live_schedule

    def same_host(self, peer: int) -> bool:
        """Whether ``peer``'s daemon is this one or on this host (both addressed on loopback)."""
        return self.services.links.same_host(self.machine_of(peer))

    def machine_of(self, peer: int) -> int:
        """The daemon of ``peer`` (a rank of this op's level)."""
        return peer if self.level.node else peer // self.services.per_node

    def output(self, p: PartSpec, nbytes: int) -> np.ndarray:
        """Part ``p``'s output region as a flat storage-dtype array of ``nbytes``."""
        return p.output(nbytes, self.label)

    def check_ranks(self, ranks: list[int], what: str) -> None:
        """INVALID_ARGUMENT unless every rank exists and is not this one."""
        for r in ranks:
            if not 0 <= r < self.size:
                raise DecentError(pb.INVALID_ARGUMENT, f"{self.label}: {what} names rank {r}, "
                                                       f"but ranks are 0..{self.size - 1}")
            if r == self.rank:
                raise DecentError(pb.INVALID_ARGUMENT, f"{self.label}: {what} names this rank "
                                  f"({r}) itself; use self_weight for the own share")

    # ------------------------------------------------------------------ sending

    def wire_parts(self, tag: int, weight: float, parts: list[PartSpec] | None = None
                   ) -> list[pb.Part]:
        """This op's tensors (or ``parts`` of them) as the parts of one message."""
        wire = [part(p.name, p.round, tag, self.op, p.dtype, p.shape, p.nbytes, weight)
                for p in (self.parts if parts is None else parts)]
        if self.on_topology or self.view_name:
            for w in wire:
                w.topology = self.topology_name if self.on_topology else self.view_name
        return wire

    async def send(self, dst: int, tag: int, weight: float = 1.0, ack: bool = False,
                   track: list[tuple[Outgoing, int]] | None = None,
                   parts: list[PartSpec] | None = None, data: memoryview | None = None,
                   extra: list[pb.Part] | None = None) -> None:
        """Send this op's tensors (or ``parts`` of them; one message) to ``dst``; ``ack``: wait
        until they are matched; ``track`` receives the queued frame (and its header size), to
        follow its progress; ``data`` replaces the payload of a one-tensor op (e.g. its
        compressed form); ``extra``: payload-free parts that go in the same message."""
        want = self.parts if parts is None else parts
        payload = self.payload if parts is None else [p.raw for p in parts]
        wire = self.wire_parts(tag, weight, want) + (extra or [])
        gate = want[0].input.gate() if len(want) == 1 else None
        if data is not None:
            payload = [data]
            wire[0].nbytes = len(data)
            gate = None
        mailbox = self.services.mailbox
        futs = [mailbox.expect_ack(dst, p.name, p.round, tag) for p in want] if ack else []
        self.unacked.add(dst)
        phases = self.phases
        if phases is not None:
            phases.sending()
        await self.services.links.outbox.send_parts(dst, wire, payload, track, gate)
        if futs:
            await asyncio.gather(*futs)
        if phases is not None:
            phases.sent()
        self.unacked.discard(dst)

    async def send_bytes(self, dst: int, tag: int, payload: memoryview, p: PartSpec | None = None,
                         input_from: int | None = None, shape: tuple[int, ...] | None = None
                         ) -> None:
        """Send ``payload`` as the one part of tensor ``p`` (default: the op's first) with
        ``tag``; the header carries the whole tensor's meta (or ``shape``, a piece's), so
        mismatches show. ``input_from``: the payload is the input's bytes from that offset
        (sent as they are copied in)."""
        p = self.parts[0] if p is None else p
        if (phases := self.phases) is not None:
            phases.sending()
        await self.services.links.outbox.send_data(dst, p.name, p.round, tag, self.op, p.dtype,
                                            p.shape if shape is None else shape, payload,
                                            gate=None if input_from is None else
                                            p.input.gate(input_from))
        if phases is not None:
            phases.sent()

    async def send_part(self, dst: int, wire: pb.Part, payload: memoryview) -> None:
        """Send one part described by the caller (window requests)."""
        phases = self.phases
        if phases is not None:
            phases.sending()
        await self.services.links.outbox.send_parts(dst, [wire], [payload])
        if phases is not None:
            phases.sent()

    # ------------------------------------------------------------------ receiving

    def expect(self, src: int, tag: int) -> asyncio.Future[Arrival]:
        """A future for this op's first tensor with ``tag`` from ``src``, unchecked."""
        fut = self.services.mailbox.expect(src, self.name, self.round, tag)
        phases = self.phases
        if phases is not None:
            phases.receiving()
            fut.add_done_callback(phases.received)
        return fut

    async def recv_parts(self, src: int, tag: int, ack: bool = False,
                         parts: list[PartSpec] | None = None, sized: bool = True,
                         progress: Progress | None = None, direct: bool = False,
                         into: np.ndarray | None = None,
                         shape: tuple[int, ...] | None = None) -> list[Arrival]:
        """Receive this op's tensors (or ``parts`` of them) from ``src``, however the sender
        grouped them into messages: :meth:`expect_parts`, then :meth:`arrivals`.

        A part whose op, dtype or shape differs from ours fails the op with MISMATCH. The
        arrivals' bytes stay valid until the op ends (or :meth:`release`). ``direct``: a part
        that travels alone is received straight into its output region; ``into`` (uint8, for
        one part, a view of its output): straight into that buffer when the payload has its
        size. Only where the sink lets payloads land (:meth:`Sink.landing`). Either may still
        arrive elsewhere (it came before the op ran): compare ``Arrival.data`` with it.
        ``shape``: the one part's expected shape when it is not ours (gathers).
        """
        return await self.arrivals(self.expect_parts(src, tag, ack, parts, sized, progress,
                                                     direct, into, shape))

    def expect_parts(self, src: int, tag: int, ack: bool = False,
                     parts: list[PartSpec] | None = None, sized: bool = True,
                     progress: Progress | None = None, direct: bool = False,
                     into: np.ndarray | None = None,
                     shape: tuple[int, ...] | None = None) -> Expected:
        """:meth:`recv_parts` begun at once: the mailbox waits for the parts from now on (an
        op can send next without a task of its own for receiving)."""
        if self.services.links.link(self.machine_of(src)) is None:
            raise DecentError(pb.PEER_UNAVAILABLE, f"{self.label}: rank {src} is not a peer")
        want = self.parts if parts is None else parts
        futs = [self._expect(src, tag, p, ack and sized, progress, into, direct) for p in want]
        expected = Expected(src, tag, want, futs, ack, sized, shape)
        if self.services.members.state(self.machine_of(src)) is PeerState.DOWN and \
                not all(f.done() for f in futs):
            expected.drop()
            expected.lost = PeerLost(f"{self.label}: rank {src} is not connected")
            return expected
        self.waiting.add(src)
        if self.phases is not None:
            self.phases.receiving()
        return expected

    async def arrivals(self, expected: Expected) -> list[Arrival]:
        """The parts :meth:`expect_parts` began to receive, once all are here, checked (and
        acknowledged when asked)."""
        if expected.lost is not None:
            raise expected.lost
        futs, src, want = expected.futs, expected.src, expected.parts
        arrivals = [await futs[0]] if len(futs) == 1 else list(await asyncio.gather(*futs))
        if self.phases is not None:
            self.phases.received()
        self.waiting.discard(src)
        for p, arrival in zip(want, arrivals, strict=True):
            problem = self.mismatch(src, arrival, p, expected.sized, expected.shape)
            if problem is not None:
                raise problem
        if expected.ack:
            late = [(p.name, p.round) for p, a in zip(want, arrivals, strict=True) if not a.acked]
            if late:
                self.services.links.outbox.send_acks(src, late, expected.tag, True)
        return arrivals

    def _expect(self, src: int, tag: int, p: PartSpec, ack: bool, progress: Progress | None,
                into: np.ndarray | None, direct: bool) -> asyncio.Future[Arrival]:
        accepts: Accepts = (self.op, p.dtype, p.shape)
        dest = None if not p.sink.landable else into if into is not None else (
            p.sink.landing(p.nbytes) if direct else None)
        return self.services.mailbox.expect(src, p.name, p.round, tag,
                                            accepts if ack else None, progress,
                                            None if dest is None else (dest, accepts))

    async def recv(self, src: int, tag: int, ack: bool = False, sized: bool = True
                   ) -> tuple[np.ndarray, float]:
        """Receive this (one-tensor) op's tensor from ``src``: (storage array, dst weight)."""
        (arrival,) = await self.recv_parts(src, tag, ack, self.parts[:1], sized)
        return arrival.data.view(dtypes.STORAGE[self.dtype]), arrival.weight

    async def recv_rows(self, src: int, tag: int, rows: int, ack: bool = False) -> Arrival:
        """Receive ``src``'s tensor of ``rows`` first-dimension rows (gathers: the first
        dimension may differ from ours, the rest of the shape and the dtype may not)."""
        p = self.parts[0]
        (arrival,) = await self.recv_parts(src, tag, parts=[p], shape=(rows, *p.shape[1:]))
        if ack:
            self.services.links.outbox.send_acks(src, [(p.name, p.round)], tag, True)
        return arrival

    @staticmethod
    def release(arrival: Arrival) -> None:
        """Done with a received tensor before the op ends: its buffer can be reused."""
        arrival.release()

    def mismatch(self, src: int, arrival: Arrival, p: PartSpec | None = None,
                 exact_size: bool = True, shape: tuple[int, ...] | None = None
                 ) -> DecentError | None:
        """MISMATCH when ``src``'s tensor disagrees with part ``p``'s op kind, dtype or shape
        (``shape``: this one instead of ``p``'s)."""
        p = p or self.parts[0]
        want = p.shape if shape is None else shape
        # p.nbytes: a segment of a staged node tensor carries the whole tensor's shape
        nbytes = p.nbytes if shape is None else dtypes.nbytes(p.dtype, want)
        problem = None
        if self.on_topology and arrival.topology and arrival.topology != self.topology_name:
            problem = (f"rank {self.rank} runs it on topology {self.topology_name} but rank "
                       f"{src} on {arrival.topology} (set_topology at another point of their "
                       "sequences of ops?)")
        elif self.view_name and arrival.topology and arrival.topology != self.view_name:
            problem = (f"rank {self.rank} ran it over live ranks {self.view_name} but rank {src} "
                       f"over {arrival.topology}: the membership changed during the op; "
                       "retry it in the new view")
        elif arrival.op != self.op:
            problem = (f"rank {self.rank} submitted {op_label(self.op)} but rank {src} "
                       f"submitted {op_label(arrival.op)}")
        elif arrival.dtype != p.dtype or arrival.shape != want:
            problem = (f"rank {self.rank} expected {dtypes.describe(p.dtype, want)} but rank "
                       f"{src} sent {dtypes.describe(arrival.dtype, arrival.shape)}")
        elif exact_size and arrival.data.nbytes != nbytes:
            problem = (f"rank {src} sent {arrival.data.nbytes} bytes for "
                       f"{dtypes.describe(p.dtype, want)} ({nbytes} bytes)")
        if problem is None:
            return None
        return DecentError(pb.MISMATCH, f"tensor '{p.display}' round {p.round}: {problem}")

    # ------------------------------------------------------------------ told by the mailbox

    def aborted(self, src: int, error: pb.Error) -> None:
        """Peer ``src`` failed this op and told us; a verdict (an agreement's, or relayed by
        a collective it decides) is kept word for word, the same on every rank."""
        self.aborted_by, message = src, error.message
        verdict = error.code in VERDICT_CODES and (
            self.op == pb.AGREEMENT or (self.level.node and self.op in AGREED_AMONG_DAEMONS))
        if f"rank {src}" not in message and not verdict:
            message = f"rank {src} failed {self.label}: {message}"
        self.fail(DecentError(error.code or pb.ABORTED, message))

    def foreign(self, src: int, op: int) -> None:
        """Another op of this name from ``src`` (ours, unless ``op`` differs): MISMATCH."""
        mine = (pb.Agreement.FromString(bytes(self.parts[0].raw)).op
                if self.op == pb.AGREEMENT else self.op)  # an agreement: the op it agrees on
        if clash(op, mine) and self.failure is None:
            self.participants.add(src)
            self.fail(DecentError(pb.MISMATCH, f"tensor '{self.display}' round {self.round}: "
                                  f"rank {self.rank} submitted {op_label(mine)} but rank {src} "
                                  f"submitted {op_label(op)} under the same name"))

    def stray(self, key: Key, arrival: Arrival) -> None:
        """A part of this op arrived that nothing waits for: fail the op if it disagrees (else
        ranks that took different paths for it, another shape across the ring threshold or
        another broadcast root, would each wait out the timeout)."""
        if not self.running or self.failure is not None:
            return
        src, name, _, tag = key
        p = self.by_name.get(name) or self.parts[0]
        rows = (self.spec.rows(self) or {}).get(src)
        shape = None if rows is None else (rows, *p.shape[1:])
        err = self.mismatch(src, arrival, p, exact_size=False, shape=shape)
        if err is None:
            expected = self.spec.tags(self)
            if expected is not None and tag not in expected:
                err = DecentError(pb.MISMATCH, f"tensor '{self.display}' round {self.round}: "
                                  f"rank {src} runs {op_label(self.op)} differently from rank "
                                  f"{self.rank} ({self.spec.tag_hint})")
        if err is not None:
            self.participants.add(src)
            self.fail(err)

    # ------------------------------------------------------------------ lifecycle

    def release_views(self) -> None:
        """Drop this op's views of the worker's arena (so the arena can be unmapped)."""
        for p in self.parts:
            p.release()
        self.by_name = {}
        self.payload = []

    async def inputs_whole(self) -> None:
        """Wait until the worker has copied every input in (at once for most ops)."""
        for p in self.parts:
            await p.input.whole()

    def fail(self, error: DecentError) -> None:
        """Fail this op from outside (an ABORT from a peer, a timeout, shutdown).

        A task that has not started yet is not cancelled (a task cancelled before its first step
        never runs its cleanup); it sees ``failure`` when it starts.
        """
        if self.failure is None:
            self.failure = error
        if self.running and self.task is not None and not self.task.done():
            self.task.cancel()
