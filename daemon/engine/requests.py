"""The request engine: validates worker requests, runs each as a task, times out, aborts, reports.

Every request is keyed by (name, round) and involves only the peers its op needs. A failure
(mismatch, timeout, a peer gone) fails the op here and is sent as ABORT to the op's other
participants, so both sides of a disagreement fail with the same message instead of one of them
hanging. A stall inspector logs the ranks an op is still waiting for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from decent_wire.errors import DecentError
from decent_wire.ops import BY_TYPE, OP_OF_FIELD, Result, op_types
from decent_wire.protocol import op_label
from decent_wire.topology import Topology, from_spec
from decent_wire.v1 import decent_pb2 as pb
from decentd.engine.hierarchy import Hierarchy
from decentd.engine.node_gathers import Request
from decentd.engine.placement import request_parts
from decentd.errors import VERDICT_CODES
from decentd.keys import OpKey, agreement, at_worker
from decentd.logs import op_fields
from decentd.net.late_rounds import peer_id
from decentd.ops.agreement import WORKER_AGREED, Agreements, description
from decentd.ops.api import Level, OpContext, OpResult, OpSpec, PartSpec, Services
from decentd.ops.phases import Phases
from decentd.security.auth import shown
from decentd.workers.sessions import WorkerSession

log = logging.getLogger("decentd.engine.requests")

#: characters of a peer's ABORT text that reach the log (the op's error keeps more)
LOGGED_ABORT = 300
#: ops whose result is at least their input's size: an output region too small fails at once
SAME_SIZE_RESULT = op_types(result=Result.SAME) | op_types(result=Result.PAIR)



#: told how a started op ended: its result, or the error it failed with
Done = Callable[[OpResult | None, DecentError | None], None]


class OpObserver(Protocol):
    """Watches ops go by (metrics, the timeline); called on the event loop."""

    def submitted(self, session: WorkerSession, req: pb.SubmitRequest) -> None:
        """A worker's request arrived (before it is checked)."""

    def ended(self, ctx: OpContext, error: DecentError | None, seconds: float) -> None:
        """An op ended after ``seconds`` of running, with ``error`` or not."""


@runtime_checkable
class PhaseObserver(OpObserver, Protocol):
    """An observer of each op's phases (the timeline). While one is given, the engine stamps
    every op with :class:`~decentd.ops.api.Phases` (``ctx.phases``, which the op's sends and
    receives mark too) and a worker's tensors with their client's times (``submitted``)."""

    def completed(self, ctx: OpContext) -> None:
        """``ctx`` ended and its completion went to its worker(s) (written right after
        ``ctx.phases.done_ns``)."""


class Engine:
    """Runs requests; one per daemon."""

    def __init__(self, services: Services, ops: Mapping[int, OpSpec], default_timeout: float,
                 stall_warning: float, observers: Sequence[OpObserver] = (),
                 replay_parked: Callable[[], None] = lambda: None) -> None:
        """``replay_parked``: dispatch the frames of late peers that an op just made
        placeable (the receiver's)."""
        self.services = services
        self._replay_parked = replay_parked
        self.observers = tuple(observers)
        self.tracers = tuple(o for o in self.observers if isinstance(o, PhaseObserver))
        self.machine = services.machine
        self.ops = ops
        self.default_timeout = default_timeout
        self.stall_warning = stall_warning
        self.running: dict[OpKey, OpContext] = {}
        self.completed = 0
        #: inputs sent while their workers copied them in, and their bytes sent before the end
        self.streamed = [0, 0]
        #: requests whose input their worker left out (TensorRef.blank)
        self.left_out = 0
        self.failed = 0
        self.closing = False
        #: allreduce, broadcast, barrier and hierarchical averaging: a node's workers combined
        self.hierarchy = Hierarchy(services, ops, self.start)
        self.agreements = Agreements(services, self.start)

    # ------------------------------------------------------------------ submission

    def submit(self, session: WorkerSession, req: pb.SubmitRequest) -> None:
        """Validate and start one request; DecentError when it is refused outright."""
        which = req.WhichOneof("op")
        if which == "fill":
            self._filled(session, req.request_id, req.fill.bytes)
            return
        for observer in self.observers:
            observer.submitted(session, req)
        if self.closing:
            raise DecentError(pb.SHUTTING_DOWN, f"daemon rank {self.machine} is shutting down")
        if which == "set_topology":
            session.topology = self._topology(req.set_topology.spec_json)
            session.complete(pb.Completion(request_id=req.request_id))
            return
        op, spec, args = self._op(req, which)
        if session.arena.faulted():
            raise session.arena.fault_error(f"{pb.OpType.Name(op)} request {req.request_id}")
        timeout = req.timeout_s or self.default_timeout
        parts = request_parts(session, req, op)
        self.left_out += any(p.input.blank for p in parts)
        if self.tracers:
            self._stamp(req, parts)
        if op in self.hierarchy.ops:
            self.hierarchy.submit(Request(session, req.request_id, op, args, parts, timeout))
            return
        for p in parts:
            p.name = at_worker(p.name, session.rank)
        level = Level(session.rank, self.services.workers,
                      session.topology or self.services.topology)
        ctx = OpContext(self.services, op, args, parts, spec, level)
        if op in WORKER_AGREED:  # a collective: the workers agree on it first
            descriptions = [description(op, args, p, [session.rank]) for p in parts]
            self.agreements.run(level, parts, descriptions, timeout, lambda err: self._agreed(
                session, req.request_id, ctx, timeout, err))
            return
        self.start(ctx, timeout, lambda result, err: self._complete(session, ctx,
                                                                    req.request_id, result, err))
        session.in_flight.update(ctx.keys)

    def _agreed(self, session: WorkerSession, request_id: int, ctx: OpContext, timeout: float,
                err: DecentError | None) -> None:
        """Every worker of a collective has the same verdict: run it, or fail it with that."""
        if err is None:
            try:
                self.start(ctx, timeout, lambda result, e: self._complete(session, ctx,
                                                                          request_id, result, e))
                session.in_flight.update(ctx.keys)
                return
            except DecentError as exc:
                err = exc
        ctx.release_views()
        self._complete(session, ctx, request_id, None, err)

    @staticmethod
    def _filled(session: WorkerSession, request_id: int, nbytes: int) -> None:
        """A worker copied the first ``nbytes`` of a filling request's tensor in (a note on a
        request that ended, or never was, is dropped)."""
        fill = session.filling.get(request_id)
        if fill is not None:
            fill.advance(nbytes)
            if fill.complete:
                del session.filling[request_id]

    def start(self, ctx: OpContext, timeout: float, done: Done) -> None:
        """Open the op's keys and run it as a task; ``done`` is told how it ended.
        DecentError when one of its keys is in flight already."""
        keys = ctx.keys
        for key, p in zip(keys, ctx.parts, strict=True):
            if key in self.running:
                raise DecentError(pb.INVALID_ARGUMENT, f"'{p.display}' round {p.round} is "
                                                       f"already in flight on rank {ctx.rank}")
        if len(set(keys)) != len(keys):
            raise DecentError(pb.INVALID_ARGUMENT, f"fused request '{ctx.display}' names a "
                                                   "tensor twice")
        for key in keys:
            self.running[key] = ctx
        if self.tracers:
            ctx.phases = Phases()
        for src, error in self.services.mailbox.open(keys, ctx):
            ctx.aborted(src, error)
        ctx.task = asyncio.get_running_loop().create_task(self._run(ctx, timeout, done))

    def _complete(self, session: WorkerSession, ctx: OpContext, request_id: int,
                  result: OpResult | None, err: DecentError | None) -> None:
        """A worker-level op ended: its completion to its worker."""
        session.in_flight.difference_update(ctx.keys)
        fill = session.filling.pop(request_id, None) or ctx.parts[0].input.fill
        if fill is not None:
            self.streamed[0] += 1
            self.streamed[1] += fill.early
        epoch = self.services.members.epoch
        if err is not None:
            completion = pb.Completion(request_id=request_id, view_epoch=epoch,
                                       error=err.to_pb())
        elif result is not None:
            completion = pb.Completion(
                request_id=request_id, view_epoch=epoch, out_nbytes=result.out_nbytes,
                out_meta=pb.TensorMeta(dtype=ctx.dtype, shape=result.shape),
                src_ranks=result.src_ranks, combine=result.combine)
        else:
            completion = pb.Completion(request_id=request_id, view_epoch=epoch)
        session.complete(completion)

    def _op(self, req: pb.SubmitRequest, which: str | None) -> tuple[int, OpSpec, Any]:
        """The request's op (its ``op`` field ``which``), its spec and its typed arguments,
        checked."""
        op = OP_OF_FIELD.get(which or "")
        spec = self.ops.get(op) if op is not None else None
        if op is None or spec is None:
            if op is not None and op in self.hierarchy.ops:
                spec = self.hierarchy.ops[op]
            else:
                raise DecentError(pb.INVALID_ARGUMENT, f"request {req.request_id} names no op "
                                                       f"this daemon runs ({which})")
        first = req.tensors[0].name if req.tensors else "?"
        if not math.isfinite(req.timeout_s) or req.timeout_s < 0:
            raise DecentError(pb.INVALID_ARGUMENT, f"tensor '{first}': timeout must be a "
                              f"positive number of seconds, got {req.timeout_s}")
        if not req.tensors:
            raise DecentError(pb.INVALID_ARGUMENT, f"request {req.request_id} carries no tensor")
        if len(req.tensors) > 1 and not BY_TYPE[op].fuses:
            raise DecentError(pb.INVALID_ARGUMENT, f"{which} requests cannot be fused")
        return op, spec, getattr(req, which or "")

    def _topology(self, spec_json: str) -> Topology | None:
        """The topology a worker sets (an empty spec: back to the daemon's)."""
        if not spec_json:
            return None
        try:
            return from_spec(json.loads(spec_json), self.services.workers)
        except (ValueError, TypeError) as exc:  # TopologyError, JSONDecodeError
            raise DecentError(pb.INVALID_ARGUMENT, f"set_topology: {exc}") from None

    @staticmethod
    def _stamp(req: pb.SubmitRequest, parts: list[PartSpec]) -> None:
        """Each tensor's client times, for the timeline (none from a client that sent none)."""
        if len(req.queued_ns) == len(req.fused_ns) == len(parts):
            for p, queued, fused in zip(parts, req.queued_ns, req.fused_ns, strict=True):
                p.submitted = (queued, fused, req.sent_ns)

    # ------------------------------------------------------------------ running

    async def _run(self, ctx: OpContext, timeout: float, done: Done) -> None:
        ctx.running = True
        began = time.monotonic()
        result: OpResult | None = None
        error: DecentError | None = None
        try:
            try:
                ctx.participants = ctx.spec.peers(ctx)
            except DecentError:  # its own arguments are bad: every rank may be waiting for it
                ctx.participants = set(range(ctx.size)) - {ctx.rank}
                raise
            self._place_late_peers(ctx)
            if ctx.failure is not None and not _rules_anyway(ctx):  # failed before it started
                raise asyncio.CancelledError
            if ctx.op in SAME_SIZE_RESULT:  # fail (and tell the peers) before receiving
                for p in ctx.parts:
                    if p.nbytes > len(p.out):
                        p.output(p.nbytes, ctx.label)
            # a timer instead of asyncio.wait_for: no extra task per op on the hot path
            timer = asyncio.get_running_loop().call_later(timeout, self._time_out, ctx, timeout)
            try:
                result = await ctx.spec.run(ctx)
                if ctx.phases is not None:
                    ctx.phases.ran_ns = time.monotonic_ns()
            finally:
                timer.cancel()
        except asyncio.CancelledError:
            error = ctx.failure or DecentError(pb.SHUTTING_DOWN, f"{ctx.label} was cancelled")
        except DecentError as err:
            if not err.message.startswith(ctx.label) and ctx.display not in err.message \
                    and not _names_a_part(ctx, err.message):
                err = DecentError(err.code, f"{ctx.label}: {err.message}")
            error = err
        except Exception as exc:  # a bug: fail this request, keep the daemon
            log.exception("internal error in %s", ctx.label)
            error = DecentError(pb.INTERNAL, f"{ctx.label}: internal error: {exc!r}")
        else:
            self.completed += ctx.spec.counted
            for peer in ctx.left_out & ctx.participants:  # its op may still wait for us
                self.services.links.outbox.send_skip(peer, ctx.keys)
        finally:
            for key in ctx.keys:
                self.running.pop(key, None)
            self.services.mailbox.close(ctx.keys)
            ctx.release_views()
        if error is not None:
            self._fail(ctx, error)
            result = None
        for observer in self.observers:
            observer.ended(ctx, error, time.monotonic() - began)
        if ctx.phases is not None:  # the op's last phase ends as its completion goes out
            ctx.phases.done_ns = time.monotonic_ns()
        try:
            done(result, error)
        except Exception:  # a bug in whoever waits: log it, keep the daemon
            log.exception("completing %s failed", ctx.label)
        if ctx.phases is not None:  # recorded once the worker has its completion
            for tracer in self.tracers:
                tracer.completed(ctx)

    def _place_late_peers(self, ctx: OpContext) -> None:
        """The op's late peers (:mod:`decentd.net.late_rounds`) count this op's rounds as their 0,
        unless an earlier op placed them (and its agreement's, when it agrees in its own
        exchange: an agreement of its own would place them as it ran)."""
        rounds = self.services.links.rounds
        if not rounds.any_late:
            return
        placed = False
        for peer in ctx.participants:
            pid = peer_id(peer, ctx.name)
            if rounds.is_late(pid, ctx.name):
                for p in ctx.parts:
                    for name in (p.name, agreement(p.name)) if ctx.agrees_in_exchange else \
                            (p.name,):
                        placed = rounds.establish(pid, name, p.round) or placed
        if placed:
            self._replay_parked()

    def _time_out(self, ctx: OpContext, timeout: float) -> None:
        ctx.fail(DecentError(pb.TIMEOUT, f"{ctx.label} timed out after {timeout:g}s on rank "
                                         f"{ctx.rank}; still waiting for {waiting_for(ctx)}"))

    def _fail(self, ctx: OpContext, err: DecentError) -> None:
        self.failed += 1
        if err.code != pb.SHUTTING_DOWN or ctx.failure is None:  # a peer's ABORT text: escaped
            text = str(err) if ctx.aborted_by < 0 else shown(str(err), LOGGED_ABORT)
            log.warning("%s failed: %s", ctx.label, text, extra=op_fields(ctx))
        for peer in ctx.participants - {ctx.aborted_by}:
            self.services.links.outbox.send_abort(peer, ctx.keys, err.to_pb())

    # ------------------------------------------------------------------ housekeeping

    async def stall_inspector(self) -> None:
        """Every second, warn about ops that have waited longer than ``stall_warning``."""
        while True:
            await asyncio.sleep(min(1.0, self.stall_warning))
            now = time.monotonic()
            for ctx in set(self.running.values()):
                age = now - ctx.started
                if age >= self.stall_warning and now - ctx.warned_at >= self.stall_warning:
                    ctx.warned_at = now
                    log.warning("stall: %s on rank %d has waited %.1fs; still waiting for %s",
                                ctx.label, ctx.rank, age, waiting_for(ctx))

    def fail_session(self, session: WorkerSession) -> list[asyncio.Task[None]]:
        """The worker went away: fail its in-flight ops (and the node's collectives that wait
        for it); their tasks, to wait for."""
        session.gone = True
        for fill in session.filling.values():  # nothing more of them comes
            fill.release()
        self.services.links.outbox.tell_all(pb.BulkHeader(kind=pb.WORKER_LEFT, parts=[
            pb.Part(name=session.job, src=session.rank)]))
        tasks = self.hierarchy.fail_session(session)
        for key in list(session.in_flight):
            ctx = self.running.get(key)
            if ctx is not None:
                ctx.fail(DecentError(pb.ABORTED, f"{ctx.label}: its worker went away"))
                if ctx.task is not None:
                    tasks.append(ctx.task)
        return tasks

    def joined(self, session: WorkerSession) -> None:
        """A worker registered: it takes part in the node's collectives, and peers wait for it,
        again (it counts its rounds from 0: they translate for it, we do not)."""
        self.services.links.rounds.restarted_here(session.rank, session.job)
        self.services.mailbox.restarted(session.rank, session.job)
        self.hierarchy.joined(session)
        self.services.links.outbox.tell_all(pb.BulkHeader(kind=pb.WORKER_JOINED, parts=[
            pb.Part(name=session.job, src=session.rank)]))

    def forget_history(self) -> None:
        """The last local worker left: a new job may reuse (name, round) keys from round 0."""
        self.services.mailbox.forget_history()

    async def shutdown(self, reason: str) -> None:
        """Fail every in-flight op with SHUTTING_DOWN and wait for their completions."""
        self.closing = True
        self.hierarchy.shutdown(reason)
        tasks = []
        for ctx in set(self.running.values()):
            ctx.fail(DecentError(pb.SHUTTING_DOWN, f"{ctx.label}: daemon rank {self.machine} is "
                                                   f"shutting down ({reason})"))
            if ctx.task is not None:
                tasks.append(ctx.task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def waiting_for(ctx: OpContext) -> str:
    """``rank(s) [2] to send, rank(s) [1] to take ours``: what op ``ctx`` waits for, for
    stall and timeout messages."""
    said = []
    if ctx.waiting:
        said.append(f"rank(s) {sorted(ctx.waiting)} to send their tensor (not submitted there "
                    "yet? a rank behind, ops submitted in another order, or a worker waiting "
                    "for room in a full arena)")
    if ctx.unacked:
        said.append(f"rank(s) {sorted(ctx.unacked)} to match the tensor sent to them")
    return "; ".join(said) or "nothing remote (local work)"


def _names_a_part(ctx: OpContext, message: str) -> bool:
    """Whether ``message`` is about one of ``ctx``'s fused tensors (a verdict on it, drawn
    alike on every rank, however each fused it)."""
    return any(message.startswith(f"{op_label(ctx.op)} '{p.display}' ") for p in ctx.parts)


def _rules_anyway(ctx: OpContext) -> bool:
    """Whether an op that a peer failed before it started runs all the same: one that agrees
    in its own exchange, failed for a disagreement, still draws the verdict (the same on every
    rank) from the descriptions that come."""
    return ctx.agrees_in_exchange and ctx.failure is not None and \
        ctx.failure.code in VERDICT_CODES
