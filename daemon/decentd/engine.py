"""The request engine: validates worker requests, runs each as a task, times out, aborts, reports.

Every request is keyed by (name, round) and involves only the peers its op needs. A failure
(mismatch, timeout, a peer gone) fails the op here and is sent as ABORT to the op's other
participants, so both sides of a disagreement fail with the same message instead of one of them
hanging. A stall inspector logs the ranks an op is still waiting for.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from decentd import dtypes
from decentd.errors import OpError
from decentd.topology import Step, Topology
from decentd.transport import (
    JOB_SEPARATOR,
    Arrival,
    Progress,
    Transport,
    part,
    qualify,
)
from decentd.wire import pb

if TYPE_CHECKING:
    from decentd.arena import Arena
    from decentd.bulk import Outgoing
    from decentd.windows import Windows

log = logging.getLogger("decentd.engine")

_EMPTY = np.empty(0, np.uint8)
_NO_BYTES = memoryview(b"")


@dataclass
class WorkerSession:
    """One registered local worker: its arena and the channel its completions go out on."""

    worker_id: str
    pid: int
    framework: str
    arena: Arena
    job: str = ""
    in_flight: set[tuple[str, int]] = field(default_factory=set)
    attached: bool = False
    #: writes one completion to the worker's data channel (set when the worker attaches)
    deliver: Callable[[pb.Completion], None] | None = None

    def complete(self, completion: pb.Completion) -> None:
        """Send a completion to the worker (dropped if it is gone)."""
        if self.deliver is not None:
            self.deliver(completion)


@dataclass
class PartSpec:
    """One tensor of a request (a fused request has several): its wire key and arena views."""

    name: str  # wire name (job-qualified)
    display: str
    round: int
    dtype: int
    shape: tuple[int, ...]
    x: np.ndarray  # storage-dtype view of the input, flat
    out: memoryview  # this tensor's output region
    raw: memoryview  # the input's bytes

    @property
    def nbytes(self) -> int:
        """Input bytes."""
        return int(self.x.nbytes)


@dataclass
class OpResult:
    """What an op wrote to the worker's output region."""

    out_nbytes: int
    shape: tuple[int, ...]
    src_ranks: list[int] = field(default_factory=list)


def op_label(op: int) -> str:
    """``neighbor_allreduce`` style name of an op type."""
    return str(pb.OpType.Name(op)).lower()


class OpContext:
    """Everything one running op needs: its request, peers, and send/recv with validation."""

    def __init__(self, engine: Engine, session: WorkerSession, req: pb.SubmitRequest,
                 parts: list[PartSpec]) -> None:
        self.engine = engine
        self.session = session
        self.req = req
        self.rank: int = engine.rank
        self.size: int = engine.size
        self.parts = parts
        self.by_name = {p.name: p for p in parts}
        #: every part's input, in order: the payload of this op's messages (sent gathered)
        self.payload = [p.raw for p in parts]
        first = parts[0]
        #: the op's key on the wire (the job id, if any, qualifies the user's name)
        self.name = first.name
        self.display = first.display
        self.round = first.round
        self.op = int(req.op)
        self.dtype = first.dtype
        self.shape = first.shape
        self.waiting: set[int] = set()  # ranks whose data this op still needs
        self.unacked: set[int] = set()  # ranks that have not yet matched what this op sent
        self.participants: set[int] = set()
        self.started = time.monotonic()
        self.warned_at = 0.0
        self.task: asyncio.Task[None] | None = None
        self.failure: OpError | None = None
        self.aborted_by = -1
        self.running = False  # set once the task has started

    @property
    def transport(self) -> Transport:
        """The daemon's peer transport."""
        return self.engine.transport

    @property
    def label(self) -> str:
        """``neighbor_allreduce 'w' round 3`` for messages."""
        fused = f" (+{len(self.parts) - 1} fused)" if len(self.parts) > 1 else ""
        return f"{op_label(self.op)} '{self.display}'{fused} round {self.round}"

    def topology_step(self) -> Step:
        """This rank's neighbors and weights at this op's step (= its round)."""
        return self.engine.topology.step(self.rank, self.round)

    def wire_parts(self, tag: int, weight: float, parts: list[PartSpec] | None = None
                   ) -> list[pb.Part]:
        """This op's tensors (or ``parts`` of them) as the parts of one message."""
        return [part(p.name, p.round, tag, self.op, p.dtype, p.shape, p.nbytes, weight)
                for p in (self.parts if parts is None else parts)]

    async def send(self, dst: int, tag: int, weight: float = 1.0, ack: bool = False,
                   track: list[tuple[Outgoing, int]] | None = None,
                   parts: list[PartSpec] | None = None,
                   data: memoryview | None = None) -> None:
        """Send this op's tensors (or ``parts`` of them; one message) to ``dst``; ``ack``: wait
        until they are matched.

        ``track`` receives the queued frame (and its header size), to follow its progress.
        ``data`` replaces the payload of a one-tensor op (e.g. its compressed form).
        """
        want = self.parts if parts is None else parts
        payload = self.payload if parts is None else [p.raw for p in parts]
        wire = self.wire_parts(tag, weight, want)
        if data is not None:
            payload = [data]
            wire[0].nbytes = len(data)
        futs = [self.transport.expect_ack(dst, p.name, p.round, tag) for p in want] \
            if ack else []
        self.unacked.add(dst)
        await self.transport.send_parts(dst, wire, payload, track)
        if futs:
            await asyncio.gather(*futs)
        self.unacked.discard(dst)

    async def recv_parts(self, src: int, tag: int, ack: bool = False,
                         parts: list[PartSpec] | None = None, sized: bool = True,
                         progress: Progress | None = None, direct: bool = False,
                         into: np.ndarray | None = None) -> list[Arrival]:
        """Receive this op's tensors (or ``parts`` of them) from ``src``, however the sender
        grouped them into messages.

        A part whose op, dtype or shape differs from ours fails the op with MISMATCH. The
        arrivals' bytes stay valid until the op ends (or :meth:`release`). ``direct``: a part
        that travels alone is received straight into its output region; ``into`` (uint8, for
        one part): straight into that buffer when the payload has its size. Either may still
        arrive elsewhere (it came before the op ran): compare ``Arrival.data`` with it.
        """
        link = self.transport.links.get(src)
        if link is None:
            raise OpError(pb.PEER_UNAVAILABLE, f"{self.label}: rank {src} is not a peer")
        want = self.parts if parts is None else parts

        def dest(p: PartSpec) -> np.ndarray | None:
            if into is not None:
                return into
            return np.frombuffer(p.out, np.uint8, p.nbytes) if direct else None

        futs = [self.transport.expect(src, p.name, p.round, tag,
                                      (self.op, p.dtype, p.shape) if ack and sized else None,
                                      progress,
                                      None if (d := dest(p)) is None
                                      else (d, (self.op, p.dtype, p.shape)))
                for p in want]
        if link.inbound_lost and not all(f.done() for f in futs):
            for f in futs:
                f.cancel()
            raise OpError(pb.PEER_UNAVAILABLE, f"{self.label}: rank {src} has disconnected")
        self.waiting.add(src)
        arrivals = list(await asyncio.gather(*futs))
        self.waiting.discard(src)
        for p, arrival in zip(want, arrivals, strict=True):
            problem = self.mismatch(src, arrival, p, sized)
            if problem is not None:
                raise problem
        if ack:
            late = [(p.name, p.round) for p, a in zip(want, arrivals, strict=True) if not a.acked]
            if late:
                self.transport.send_acks(src, late, tag, arrived=True)
        return arrivals

    async def recv(self, src: int, tag: int, ack: bool = False, sized: bool = True
                   ) -> tuple[np.ndarray, float]:
        """Receive this (one-tensor) op's tensor from ``src``: (storage array, dst weight)."""
        (arrival,) = await self.recv_parts(src, tag, ack, self.parts[:1], sized)
        return arrival.data.view(dtypes.STORAGE[self.dtype]), arrival.weight

    def release(self, arrival: Arrival) -> None:
        """Done with a received tensor before the op ends: its buffer can be reused."""
        self.transport.release(arrival)

    def mismatch(self, src: int, arrival: Arrival, p: PartSpec | None = None,
                 exact_size: bool = True) -> OpError | None:
        """MISMATCH when ``src``'s tensor disagrees with part ``p``'s op kind, dtype or shape."""
        p = p or self.parts[0]
        problem = None
        if arrival.op != self.op:
            problem = (f"rank {self.rank} submitted {op_label(self.op)} but rank {src} "
                       f"submitted {op_label(arrival.op)}")
        elif arrival.dtype != p.dtype or arrival.shape != p.shape:
            problem = (f"rank {self.rank} has {dtypes.describe(p.dtype, p.shape)} but rank {src} "
                       f"sent {dtypes.describe(arrival.dtype, arrival.shape)}")
        elif exact_size and arrival.data.nbytes != p.nbytes:
            problem = (f"rank {src} sent {arrival.data.nbytes} bytes for "
                       f"{dtypes.describe(p.dtype, p.shape)} ({p.nbytes} bytes)")
        if problem is None:
            return None
        return OpError(pb.MISMATCH, f"tensor '{p.display}' round {p.round}: {problem}")

    def waiting_for(self) -> str:
        """``rank(s) [2] to send, rank(s) [1] to take ours`` for stall and timeout messages."""
        parts = []
        if self.waiting:
            parts.append(f"rank(s) {sorted(self.waiting)} to send their tensor")
        if self.unacked:
            parts.append(f"rank(s) {sorted(self.unacked)} to match the tensor sent to them")
        return "; ".join(parts) or "nothing remote (local work)"

    def release_views(self) -> None:
        """Drop this op's views of the worker's arena (so the arena can be unmapped)."""
        for p in self.parts:
            p.x, p.out, p.raw = _EMPTY, _NO_BYTES, _NO_BYTES
        self.by_name = {}
        self.payload = []

    def fail(self, error: OpError) -> None:
        """Fail this op from outside (an ABORT from a peer, shutdown).

        A task that has not started yet is not cancelled (a task cancelled before its first step
        never runs its cleanup); it sees ``failure`` when it starts.
        """
        if self.failure is None:
            self.failure = error
        if self.running and self.task is not None and not self.task.done():
            self.task.cancel()


OpFn = Callable[[OpContext], Awaitable[OpResult]]


@dataclass(frozen=True)
class OpSpec:
    """An op: how to run it, and which peers it involves (known before it runs, so that an op
    failing before or while it starts can tell them)."""

    run: OpFn
    peers: Callable[[OpContext], set[int]]
    #: the message tags this op can receive (None: any); another tag means the sender went
    #: another way (e.g. another broadcast root, ring vs. direct allreduce)
    tags: Callable[[OpContext], set[int] | None] = lambda _ctx: None
    #: whether several tensors may travel as one request (each still matched on its own)
    fusable: bool = False


def expected_tag_hint(op: int) -> str:
    """What a tag disagreement means for ``op``, for the MISMATCH message."""
    if op == pb.BROADCAST:
        return "different broadcast roots"
    if op == pb.ALLREDUCE:
        return "ring vs. direct exchange: is transport.ring_threshold_bytes the same everywhere?"
    if op == pb.NEIGHBOR_ALLREDUCE:
        return "pairwise halves vs. whole tensors: do both ranks have the same topology?"
    return "different message tags"


class Engine:
    """Runs requests; one per daemon."""

    def __init__(
        self,
        rank: int,
        size: int,
        topology: Topology,
        transport: Transport,
        default_timeout: float,
        stall_warning: float,
        ring_threshold: int,
        ops: Mapping[int, OpSpec],
    ) -> None:
        self.ops = ops
        self.rank = rank
        self.size = size
        self.topology = topology
        self.transport = transport
        self.default_timeout = default_timeout
        self.stall_warning = stall_warning
        self.ring_threshold = ring_threshold
        self.running: dict[tuple[str, int], OpContext] = {}
        self._early_aborts: collections.OrderedDict[tuple[str, int], tuple[int, pb.Error]] = (
            collections.OrderedDict()
        )
        self.completed = 0
        self.failed = 0
        self.closing = False
        #: the window service (decentd.windows), installed by the server
        self.windows: Windows | None = None

    # ------------------------------------------------------------------ submission

    def submit(self, session: WorkerSession, req: pb.SubmitRequest) -> None:
        """Validate and start one request; OpError when it is refused outright."""
        if self.closing:
            raise OpError(pb.SHUTTING_DOWN, f"daemon rank {self.rank} is shutting down")
        spec = self.ops.get(int(req.op))
        if spec is None:
            raise OpError(pb.INVALID_ARGUMENT, f"unknown op type {req.op}")
        if not math.isfinite(req.timeout_s) or req.timeout_s < 0:
            raise OpError(pb.INVALID_ARGUMENT, f"tensor '{req.name}': timeout must be a positive "
                          f"number of seconds, got {req.timeout_s}")
        arena = session.arena
        if req.parts:
            if not spec.fusable:
                raise OpError(pb.INVALID_ARGUMENT, f"{op_label(req.op)} requests cannot be fused")
            parts = [self._part(session, p.name, int(p.round), p.meta,
                                arena.view(p.offset, p.nbytes, f"tensor '{p.name}' input"),
                                arena.view(p.out_offset, p.nbytes, f"tensor '{p.name}' output"))
                     for p in req.parts]
            if len({p.round for p in parts}) != 1:
                raise OpError(pb.INVALID_ARGUMENT, f"fused request '{req.name}' mixes rounds "
                              f"{sorted({p.round for p in parts})}; fuse one step's tensors")
        else:
            parts = [self._part(
                session, req.name, int(req.round), req.meta,
                arena.view(req.offset, req.nbytes, f"tensor '{req.name}' input"),
                arena.view(req.out_offset, req.out_capacity, f"tensor '{req.name}' output"))]
        keys = [(p.name, p.round) for p in parts]
        for key, p in zip(keys, parts, strict=True):
            if key in self.running:
                raise OpError(pb.INVALID_ARGUMENT, f"'{p.display}' round {p.round} is already in "
                                                   f"flight on rank {self.rank}")
        if len(set(keys)) != len(keys):
            raise OpError(pb.INVALID_ARGUMENT, f"fused request '{req.name}' names a tensor twice")
        ctx = OpContext(self, session, req, parts)
        for key in keys:
            self.running[key] = ctx
            session.in_flight.add(key)
            early = self._early_aborts.pop(key, None)
            if early is not None:
                self._abort_from(ctx, *early)
        ctx.task = asyncio.get_running_loop().create_task(self._run(ctx, spec))

    @staticmethod
    def _part(session: WorkerSession, name: str, round_: int, meta: pb.TensorMeta,
              x_bytes: memoryview, out_bytes: memoryview) -> PartSpec:
        """Validate one tensor of a request and map its arena views."""
        if not name:
            raise OpError(pb.INVALID_ARGUMENT, "request has an empty name")
        if JOB_SEPARATOR in name:
            raise OpError(pb.INVALID_ARGUMENT, f"op name {name!r} contains \\x1f")
        if meta.dtype not in dtypes.STORAGE:
            raise OpError(pb.INVALID_ARGUMENT, f"tensor '{name}': unsupported dtype {meta.dtype}")
        shape = tuple(int(s) for s in meta.shape)
        if any(s < 0 for s in shape):
            raise OpError(pb.INVALID_ARGUMENT, f"tensor '{name}': negative dimension in "
                          f"shape {list(shape)}")
        want = math.prod(shape) * dtypes.itemsize(meta.dtype)
        if want != len(x_bytes):
            raise OpError(pb.INVALID_ARGUMENT, f"tensor '{name}': "
                          f"{dtypes.describe(meta.dtype, shape)} is {want} bytes but the request "
                          f"says {len(x_bytes)}")
        x = np.frombuffer(x_bytes, dtypes.STORAGE[meta.dtype])
        return PartSpec(qualify(session.job, name), name, round_, int(meta.dtype), shape, x,
                        out_bytes, x_bytes)

    async def _run(self, ctx: OpContext, spec: OpSpec) -> None:
        ctx.running = True
        timeout = ctx.req.timeout_s or self.default_timeout
        completion = pb.Completion(request_id=ctx.req.request_id)
        try:
            try:
                ctx.participants = spec.peers(ctx)
            except OpError:  # its own arguments are bad: every rank may be waiting for it
                ctx.participants = set(range(self.size)) - {self.rank}
                raise
            if ctx.failure is not None:  # aborted by a peer, or shut down, before it started
                raise asyncio.CancelledError
            # a timer instead of asyncio.wait_for: no extra task per op on the hot path
            timer = asyncio.get_running_loop().call_later(timeout, self._time_out, ctx, timeout)
            try:
                result = await spec.run(ctx)
            finally:
                timer.cancel()
        except asyncio.CancelledError:
            err = ctx.failure or OpError(pb.SHUTTING_DOWN, f"{ctx.label} was cancelled")
            self._fail(ctx, err, completion)
        except OpError as err:
            if not err.message.startswith(ctx.label) and ctx.display not in err.message:
                err = OpError(err.code, f"{ctx.label}: {err.message}")
            self._fail(ctx, err, completion)
        except Exception as exc:  # a bug: fail this request, keep the daemon
            log.exception("internal error in %s", ctx.label)
            self._fail(ctx, OpError(pb.INTERNAL, f"{ctx.label}: internal error: {exc!r}"),
                       completion)
        else:
            self.completed += 1
            completion.out_nbytes = result.out_nbytes
            completion.out_meta.dtype = ctx.dtype
            completion.out_meta.shape.extend(result.shape)
            completion.src_ranks.extend(result.src_ranks)
        finally:
            keys = [(p.name, p.round) for p in ctx.parts]
            for key in keys:
                self.running.pop(key, None)
                ctx.session.in_flight.discard(key)
            self.transport.close_ops(keys)
            ctx.release_views()
        ctx.session.complete(completion)

    def _time_out(self, ctx: OpContext, timeout: float) -> None:
        ctx.fail(OpError(pb.TIMEOUT, f"{ctx.label} timed out after {timeout:g}s on rank "
                                     f"{self.rank}; still waiting for {ctx.waiting_for()}"))

    def _fail(self, ctx: OpContext, err: OpError, completion: pb.Completion) -> None:
        self.failed += 1
        completion.error.CopyFrom(err.to_pb())
        if err.code != pb.SHUTTING_DOWN or ctx.failure is None:
            log.warning("%s failed: %s", ctx.label, err)
        notify = ctx.participants - {ctx.aborted_by}
        keys = [(p.name, p.round) for p in ctx.parts]
        for peer in notify:
            self.transport.send_abort(peer, keys, err.to_pb())

    # ------------------------------------------------------------------ from peers

    def on_abort(self, src: int, name: str, round_: int, error: pb.Error) -> None:
        """A peer failed (name, round) and told us."""
        ctx = self.running.get((name, round_))
        if ctx is None:
            # kept for an op that may still be submitted here (the oldest go first)
            self._early_aborts[(name, round_)] = (src, error)
            while len(self._early_aborts) > 4096:
                self._early_aborts.popitem(last=False)
            return
        self._abort_from(ctx, src, error)

    def check_arrival(self, src: int, name: str, round_: int, tag: int, arrival: Arrival) -> None:
        """A message for a running op that nothing waits for: fail the op if it disagrees.

        Without this, ranks that took different paths for the same op (another shape on the other
        side of the ring threshold, another broadcast root) would each wait out the timeout.
        """
        ctx = self.running.get((name, round_))
        if ctx is None or not ctx.running or ctx.failure is not None:
            return
        err = ctx.mismatch(src, arrival, ctx.by_name.get(name), exact_size=False)
        if err is None:
            expected = self.ops[ctx.op].tags(ctx)
            if expected is not None and tag not in expected:
                err = OpError(pb.MISMATCH, f"tensor '{ctx.display}' round {ctx.round}: rank {src} "
                              f"runs {ctx.label.split(' ')[0]} differently from rank {self.rank} "
                              f"({expected_tag_hint(ctx.op)})")
        if err is not None:
            ctx.participants.add(src)
            ctx.fail(err)

    def _abort_from(self, ctx: OpContext, src: int, error: pb.Error) -> None:
        ctx.aborted_by = src
        message = error.message
        if f"rank {src}" not in message:
            message = f"rank {src} failed {ctx.label}: {message}"
        ctx.fail(OpError(error.code or pb.ABORTED, message))

    def on_peer_down(self, src: int, reason: str) -> None:
        """The connection from ``src`` is gone (waiters were already failed by the transport)."""
        if reason == "stream closed":  # the peer closed its stream: an orderly stop
            log.info("rank %d closed its connection", src)
        else:
            log.warning("rank %d disconnected: %s", src, reason)

    # ------------------------------------------------------------------ housekeeping

    async def stall_inspector(self) -> None:
        """Every second, warn about ops that have waited longer than ``stall_warning``."""
        while True:
            await asyncio.sleep(min(1.0, self.stall_warning))
            now = time.monotonic()
            for ctx in list(self.running.values()):
                age = now - ctx.started
                if age >= self.stall_warning and now - ctx.warned_at >= self.stall_warning:
                    ctx.warned_at = now
                    log.warning(
                        "stall: %s on rank %d has waited %.1fs; still waiting for %s",
                        ctx.label, self.rank, age, ctx.waiting_for(),
                    )

    def forget_history(self) -> None:
        """The last local worker left: a new job may reuse (name, round) keys from round 0."""
        self._early_aborts.clear()
        self.transport.forget_history()

    async def shutdown(self, reason: str) -> None:
        """Fail every in-flight op with SHUTTING_DOWN and wait for their completions."""
        self.closing = True
        tasks = []
        for ctx in list(self.running.values()):
            ctx.fail(OpError(pb.SHUTTING_DOWN, f"{ctx.label}: daemon rank {self.rank} is "
                                               f"shutting down ({reason})"))
            if ctx.task is not None:
                tasks.append(ctx.task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

