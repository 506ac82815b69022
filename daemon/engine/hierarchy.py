"""Hierarchical collectives: a node's workers are combined first, then the op runs once among
the daemons.

``allreduce``, ``broadcast``, ``barrier`` and ``hierarchical_neighbor_allreduce`` are node-level:
each worker of a node submits its part of the k-th call of a name (a *gather*); once the node
has them all, the daemon stages one tensor from them (the local sum, the root's tensor, nothing,
the local mean), runs the op among the daemons under a node-level key, and writes the result
into every local worker's output. A node sends what one worker would, whatever its worker
count. With one worker per node the worker's own tensor is the staged one: nothing is copied.

A large staged tensor runs as consecutive *segments* (one op each, keys from
:func:`decentd.keys.segment`): segment k+1 is staged while segment k is on the wire, and a
segment's result reaches the workers while the next ones still arrive, so the local copies
overlap the transfer instead of adding to it. Every segment's wire part carries the whole
tensor's shape, so daemons whose tensors differ still fail with MISMATCH naming both shapes.

A gather that cannot complete (a member's timeout, a member that left, members that disagree)
fails every member with the same error and tells the daemons the node-level op would have met.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.numerics import ACCUM, from_accum, reduce_into, to_accum, weighted_sum
from decent_wire.ops import op_types
from decent_wire.protocol import op_label
from decent_wire.v1 import decent_pb2 as pb
from decentd.engine.node_gathers import Gather, Launch, Request, Staged, Worker, segment_bounds
from decentd.keys import OpKey, at_node, segment
from decentd.ops.agreement import (
    NODE_AGREED,
    Agreements,
    description,
    description_parts,
    outcome,
    refused_verdict,
)
from decentd.ops.api import Level, OpContext, OpResult, OpSpec, PartSpec, Services
from decentd.ops.faults import live_group

log = logging.getLogger("decentd.engine.hierarchy")

#: the wire dtype of each accumulation dtype (node sums travel in it)
ACCUM_WIRE = {np.dtype(np.float32): pb.FLOAT32, np.dtype(np.float64): pb.FLOAT64,
              np.dtype(np.int64): pb.INT64}
#: ops the daemon runs once for all its workers (the op table's ``node_level``)
NODE_LEVEL = op_types(node_level=True)

Done = Callable[[OpResult | None, DecentError | None], None]
Start = Callable[[OpContext, float, Done], None]


class Hierarchy:
    """The node-level ops of one daemon."""

    def __init__(self, services: Services, ops: Mapping[int, OpSpec], start: Start) -> None:
        self.services = services
        self.per_node = services.per_node
        self._start = start
        self.agreements = Agreements(services, start)
        self._spec = dict(ops)
        #: the ops run here, by the op workers submit
        self.ops: dict[int, OpSpec] = {op: ops[op] for op in NODE_LEVEL if op in ops}
        self.ops[pb.HIERARCHICAL_NEIGHBOR_ALLREDUCE] = dataclasses.replace(
            ops[pb.NEIGHBOR_ALLREDUCE])
        self.gathers: dict[OpKey, Gather] = {}
        #: node-level ops running among the daemons, with their gathers
        self.running: dict[OpContext, list[Gather]] = {}
        #: by job: the local ranks that left (and have not come back), with their ranks
        self.departed: dict[str, dict[int, int]] = {}

    # ------------------------------------------------------------------ gathering

    def submit(self, req: Request) -> None:
        """A worker's part of node-level ops: gathered, and the op started once the node has
        every worker's (DecentError when the request itself is refused)."""
        if req.op == pb.BROADCAST:
            root = int(req.args.root)
            if not 0 <= root < self.services.workers:  # the other ranks fail with it too
                req.refused = DecentError(pb.INVALID_ARGUMENT, f"root {root} is not a rank "
                                          f"(0..{self.services.workers - 1})")
        local = req.session.local_rank
        for p in req.parts:
            g = self.gathers.get((p.name, p.round))
            if g is not None and local in g.members:
                raise DecentError(pb.INVALID_ARGUMENT, f"'{p.display}' round {p.round} is "
                                  f"already in flight on rank {req.session.rank}")
        ready = []
        left = self.departed.get(req.session.job, {})
        for p in req.parts:
            g = self.gathers.setdefault((p.name, p.round), Gather((p.name, p.round)))
            problem = self._disagreement(g, req, p) or self._departure(left, req, p)
            g.members[local] = (req, p)
            if problem is not None:
                self._fail(g, problem)
            elif len(g.members) == self.per_node:
                ready.append(g)
            elif g.timer is None:
                g.timer = asyncio.get_running_loop().call_later(req.timeout, self._expire, g)
        if ready:
            self._launch(req, ready)

    def _disagreement(self, g: Gather, req: Request, p: PartSpec) -> DecentError | None:
        """MISMATCH when ``req``'s part differs from what another local worker submitted."""
        if not g.members:
            return None
        other, q = next(iter(g.members.values()))
        mine = (req.op, req.args.SerializeToString(deterministic=True), p.dtype, p.shape)
        theirs = (other.op, other.args.SerializeToString(deterministic=True), q.dtype, q.shape)
        if mine == theirs:
            return None
        what = (f"{op_label(req.op)} {dtypes.describe(p.dtype, p.shape)}",
                f"{op_label(other.op)} {dtypes.describe(q.dtype, q.shape)}")
        if what[0] == what[1]:
            what = (f"{what[0]} ({_args(req.args)})", f"{what[1]} ({_args(other.args)})")
        return DecentError(pb.MISMATCH, f"tensor '{p.display}' round {p.round}: rank "
                           f"{req.session.rank} submitted {what[0]} but rank "
                           f"{other.session.rank} on the same node {what[1]}")

    @staticmethod
    def _departure(left: Mapping[int, int], req: Request, p: PartSpec) -> DecentError | None:
        """ABORTED when a worker of the node that this op needs has left."""
        if not left:
            return None
        return DecentError(pb.ABORTED, f"{op_label(req.op)} '{p.display}' round {p.round}: "
                           f"rank {', '.join(str(r) for r in sorted(left.values()))} left; "
                           "this node's workers cannot all take part")

    def _expire(self, g: Gather) -> None:
        g.timer = None
        if g.launched is not None or self.gathers.get(g.key) is not g:
            return
        missing = sorted(self.services.machine * self.per_node + r
                         for r in range(self.per_node) if r not in g.members)
        req, p = next(iter(g.members.values()))
        self._fail(g, DecentError(pb.TIMEOUT, f"{op_label(req.op)} '{p.display}' round "
                                  f"{p.round} timed out after {req.timeout:g}s; still waiting "
                                  f"for rank(s) {missing} on the same node to submit it"))

    def _fail(self, g: Gather, err: DecentError) -> None:
        """A gather that will never run: every member fails, the daemons are told (through
        the agreement for a collective, so that all fail alike)."""
        self.gathers.pop(g.key, None)
        if g.timer is not None:
            g.timer.cancel()
        req, _ = next(iter(g.members.values()))
        if req.op in NODE_AGREED:
            self._agree_on(req, [g], err)
            return
        ctx = self._context(req, [g])
        try:
            peers = ctx.spec.peers(ctx)
        except DecentError:
            peers = set(range(ctx.size)) - {ctx.rank}
        for peer in peers:
            self.services.links.outbox.send_abort(peer, ctx.keys, err.to_pb())
        log.warning("%s", err.message)
        for member, _ in g.members.values():
            self._resolve(member, err)

    # ------------------------------------------------------------------ running among daemons

    def _launch(self, req: Request, ready: list[Gather]) -> None:
        """The ready gathers: run their op among the daemons; a collective's daemons agree on
        it meanwhile (:mod:`decentd.ops.agreement`), and its results wait for the verdict."""
        for g in ready:
            self.gathers.pop(g.key, None)
            if g.timer is not None:
                g.timer.cancel()
        if req.op not in NODE_AGREED:
            self._run_launch(req, ready, agreeing=False)
            return
        self._agree_on(req, ready, next((m.refused for g in ready for m, _ in g.members.values()
                                         if m.refused is not None), None))

    def _agree_on(self, req: Request, ready: list[Gather], refused: DecentError | None) -> None:
        """Run the gathers' collective, its daemons agreeing on it in its own exchange or
        beside it (``refused``: why this node cannot run it; it only tells the others)."""
        descriptions = self._descriptions(req, ready, refused)
        ctx = self._context(req, ready, descriptions=descriptions) if self.per_node == 1 \
            else None
        if ctx is not None and ctx.agrees_in_exchange:
            self._run_agreeing(req, ready, ctx)
        elif refused is not None:  # it cannot run here: only the verdict
            if ctx is not None:
                ctx.release_views()
            self._agree(req, ready, descriptions, None)
        else:
            self._agree(req, ready, descriptions,
                        self._run_launch(req, ready, agreeing=True, ctx=ctx))

    def _descriptions(self, req: Request, ready: list[Gather], refused: DecentError | None
                      ) -> list[pb.Agreement]:
        """What this node was asked to run for each of the gathers' tensors (``refused``: why
        it cannot run it)."""
        ranks = [self.services.machine * self.per_node + k for k in range(self.per_node)]
        return [description(req.op, req.args, p, ranks, refused)
                for _, p in (next(iter(g.members.values())) for g in ready)]

    def _run_agreeing(self, req: Request, ready: list[Gather], ctx: OpContext) -> None:
        """Run a collective that agrees in its own exchange; if this node cannot run it, send
        the others its descriptions alone (they fail with the verdict they draw from them)
        and fail with its own."""
        if all(p.agreement is None or p.agreement.error.code == pb.OK for p in ctx.parts):
            self._run_launch(req, ready, agreeing=False, ctx=ctx)
            return
        said = description_parts(ctx)
        for peer in live_group(ctx):
            if peer != ctx.rank:
                self.services.links.outbox.send_nowait(peer, said)
        # what the peers send for it from now on is dropped (it never runs here)
        self.services.mailbox.close([*ctx.keys, *((w.name, w.round) for w in said)])
        err = refused_verdict(ctx)
        ctx.release_views()
        for g in ready:
            for member, _ in g.members.values():
                self._resolve(member, err)

    def _agree(self, req: Request, ready: list[Gather], descriptions: list[pb.Agreement],
               launch: Launch | None) -> None:
        """The daemons agree on the gathers' collective (``descriptions``: this node's, one
        per gather); :meth:`_agreed` applies the verdict to ``launch`` (None: not run)."""
        s = self.services
        members = [next(iter(g.members.values())) for g in ready]
        parts = [p.copy(at_node(p.name)) for _, p in members]
        level = Level(s.machine, s.machines, s.machine_topology, node=True)
        timeout = min(m.timeout for g in ready for m, _ in g.members.values())
        self.agreements.run(level, parts, descriptions, timeout,
                            lambda err: self._agreed(ready, launch, err))

    def _agreed(self, ready: list[Gather], launch: Launch | None,
                err: DecentError | None) -> None:
        """Every daemon has the same verdict: the op's results go out, or every member fails
        with it (the op, if still running, stops)."""
        if launch is None:
            for g in ready:
                for member, _ in g.members.values():
                    self._resolve(member, err)
            return
        launch.agreeing = False
        if err is not None:
            launch.verdict = err
            for ctx in launch.contexts:
                ctx.fail(err)
        self._segments_ended(launch)

    def _run_launch(self, req: Request, ready: list[Gather], agreeing: bool,
                    ctx: OpContext | None = None) -> Launch:
        """Run the ready gathers' op among the daemons: the one local worker's tensors as they
        are (in ``ctx``, if built already), else staged in pooled buffers, segment by segment
        (``agreeing``: its results wait for an agreement's verdict)."""
        if self.per_node == 1:
            ctx = ctx or self._context(req, ready)
            for g in ready:
                g.launched = ctx
            launch = Launch(req, ready, [], 1, agreeing=agreeing)
            self._run_segment(launch, ctx)
            return launch
        staged = [self._staging(req.op, g) for g in ready]
        bounds = [segment_bounds(st.part.x.size, st.part.x.itemsize) for st in staged]
        launch = Launch(req, ready, staged, max(len(b) for b in bounds), agreeing=agreeing)
        self._next_segment(launch, bounds, 0)
        return launch

    def _next_segment(self, launch: Launch, bounds: list[list[tuple[int, int]]],
                      k: int) -> None:
        """Stage segment ``k`` of every gather that has one, start its op, and schedule the
        next (the event loop runs in between: the sender and receiver go on meanwhile)."""
        if launch.error is not None:  # an earlier segment failed: the rest never start
            launch.left -= launch.segments - k
            self._segments_ended(launch)
            return
        parts = []
        for g, st, b in zip(launch.gathers, launch.staged, bounds, strict=True):
            if k < len(b):
                part = self._segment_part(st.part, k, *b[k])
                self._stage(launch.req.op, g, part, *b[k])
                parts.append(part)
        ctx = self._context(launch.req, launch.gathers, parts)
        for g in launch.gathers:
            g.launched = g.launched or ctx
        if k + 1 < launch.segments:
            asyncio.get_running_loop().call_soon(self._next_segment, launch, bounds, k + 1)
        self._run_segment(launch, ctx, bounds, k)

    @staticmethod
    def _segment_part(whole: PartSpec, k: int, lo: int, hi: int) -> PartSpec:
        """Elements ``lo:hi`` of a staged tensor under segment ``k``'s key (the wire part
        keeps the whole tensor's shape)."""
        return whole.segment(segment(whole.name, k), lo, hi)

    def _run_segment(self, launch: Launch, ctx: OpContext,
                     bounds: list[list[tuple[int, int]]] | None = None, k: int = 0) -> None:
        """Start one segment's op among the daemons."""
        launch.contexts.append(ctx)
        self.running[ctx] = launch.gathers
        timeout = min(m.timeout for g in launch.gathers for m, _ in g.members.values())
        try:
            self._start(ctx, timeout, lambda result, err: self._segment_done(
                launch, ctx, err, bounds, k))
        except DecentError as err:
            self._segment_done(launch, ctx, err, bounds, k)

    def _segment_done(self, launch: Launch, ctx: OpContext, err: DecentError | None,
                      bounds: list[list[tuple[int, int]]] | None, k: int) -> None:
        """One segment ended: its result into the workers' outputs, or the launch fails (the
        segments still running stop); the members' completions once every segment ended."""
        self.running.pop(ctx, None)
        if err is None and ctx.group is not None:
            launch.group = launch.group or ctx.group
            if ctx.group != launch.group:
                err = DecentError(pb.ABORTED, f"{ctx.label}: the live daemons changed between "
                                  f"its segments ({launch.group} -> {ctx.group}); retry it")
        if err is None and launch.error is None and bounds is not None:
            err = self._deliver_segment(launch, ctx, bounds, k)
        if err is not None and launch.error is None:
            launch.error = err
            for other in launch.contexts:
                if other is not ctx:
                    other.fail(err)
        launch.left -= 1
        self._segments_ended(launch)

    def _deliver_segment(self, launch: Launch, ctx: OpContext,
                         bounds: list[list[tuple[int, int]]], k: int) -> DecentError | None:
        """Segment ``k`` of each staged tensor into its members' outputs."""
        try:
            for g, st, b in zip(launch.gathers, launch.staged, bounds, strict=True):
                if k < len(b):
                    self._deliver(launch.req.op, launch.req.args, g, st.part, *b[k],
                                  len(launch.group or [0]) * self.per_node)
        except DecentError as exc:
            return exc
        except Exception as exc:  # a bug: the members fail, the daemon goes on
            log.exception("delivering %s failed", ctx.label)
            return DecentError(pb.INTERNAL, f"{ctx.label}: internal error: {exc!r}")
        return None

    def _segments_ended(self, launch: Launch) -> None:
        """Every segment ended (and the agreement, if any): the members' completions; the
        staging buffers go back."""
        if launch.left or launch.agreeing:
            return
        covered = [d * self.per_node + k for d in launch.group or () for k in range(self.per_node)]
        for g in launch.gathers:
            for member, _ in g.members.values():
                member.covered = covered
                self._resolve(member, outcome(launch.verdict, launch.error))
        for st in launch.staged:
            self.services.pool.put(st.buf)
        launch.staged = []

    def _context(self, req: Request, gathers: list[Gather], staged: list[PartSpec] | None = None,
                 descriptions: list[pb.Agreement] | None = None) -> OpContext:
        """The node-level op of ``gathers``: on ``staged`` tensors (copies of their specs: the
        op drops its views when it ends), else on the one local worker's own tensors."""
        op, args, spec = self._machine_op(req.op, req.args)
        if staged is not None:
            parts = [p.copy() for p in staged]
        else:
            members = [next(iter(g.members.values()))[1] for g in gathers]
            parts = [p.copy(at_node(p.name), d) for p, d in
                     zip(members, descriptions or [None] * len(members), strict=True)]
        s = self.services
        level = Level(s.machine, s.machines, s.machine_topology, node=True)
        return OpContext(s, op, args, parts, spec, level)

    def _machine_op(self, op: int, args: Any) -> tuple[int, Any, OpSpec]:
        """What runs among the daemons: the op, its arguments in daemon ranks, its spec."""
        if op == pb.HIERARCHICAL_NEIGHBOR_ALLREDUCE:
            nar = pb.NeighborAllreduce()
            if args.HasField("self_weight"):
                nar.self_weight = args.self_weight
            if args.HasField("src_machine_weights"):
                nar.src_weights.CopyFrom(args.src_machine_weights)
            if args.HasField("dst_machine_weights"):
                nar.dst_weights.CopyFrom(args.dst_machine_weights)
            return pb.NEIGHBOR_ALLREDUCE, nar, self._spec[pb.NEIGHBOR_ALLREDUCE]
        if self.per_node > 1 and op == pb.ALLREDUCE:  # an average divides once, at the end
            reduce = pb.SUM if args.reduce_op == pb.AVERAGE else args.reduce_op
            return op, pb.Allreduce(reduce_op=reduce), self._spec[op]
        if self.per_node > 1 and op == pb.BROADCAST:
            return op, pb.Broadcast(root=int(args.root) // self.per_node), self._spec[op]
        return op, args, self._spec[op]

    def _staging(self, op: int, g: Gather) -> Staged:
        """A pooled buffer for the node's tensor of gather ``g`` (allreduce: in the
        accumulation dtype, so that sums neither overflow nor round on the way); segments are
        staged into it as they start."""
        _, p = next(iter(g.members.values()))
        dtype = ACCUM_WIRE[ACCUM[p.dtype]] if op == pb.ALLREDUCE else p.dtype
        buf = self.services.pool.get(dtypes.nbytes(dtype, p.shape))
        view = buf.data
        staged = Staged(PartSpec.over(at_node(p.name), p.display, p.round, dtype, p.shape,
                                 buf.view(dtypes.STORAGE[dtype]), view, view), buf)
        return staged

    def _stage(self, op: int, g: Gather, staged: PartSpec, lo: int, hi: int) -> None:
        """Elements ``lo:hi`` of the members' tensors combined into ``staged`` (a segment)."""
        members = [p.x[lo:hi] for _, (_, p) in sorted(g.members.items())]
        if op == pb.ALLREDUCE:
            req, p = next(iter(g.members.values()))
            acc = to_accum(members[0], p.dtype)
            for x in members[1:]:
                reduce_into(acc, to_accum(x, p.dtype), req.args.reduce_op)
            np.copyto(staged.x, acc)
        elif op == pb.BROADCAST:
            req, _ = next(iter(g.members.values()))
            root = int(req.args.root)
            if root // self.per_node == self.services.machine:
                np.copyto(staged.x, members[root % self.per_node])
        elif op == pb.HIERARCHICAL_NEIGHBOR_ALLREDUCE:
            share = 1.0 / len(members)
            weighted_sum(staged.x, members[0], share, [(x, share) for x in members[1:]],
                         staged.dtype)

    def _deliver(self, op: int, args: Any, g: Gather, staged: PartSpec, lo: int,
                 hi: int, covered: int) -> None:
        """Elements ``lo:hi`` of the staged result into each local worker's output (an
        average divides by the ``covered`` workers)."""
        divisor = covered if (op == pb.ALLREDUCE and args.reduce_op == pb.AVERAGE) else 1
        for req, p in g.members.values():
            if req.session.gone or not p.nbytes:
                continue
            out = p.output(p.nbytes, f"{op_label(op)} '{p.display}' round {p.round}")[lo:hi]
            if op == pb.ALLREDUCE:
                out[...] = from_accum(staged.x[lo:hi], p.dtype, divisor)
            else:
                np.copyto(out, staged.x[lo:hi])

    def _resolve(self, req: Request, err: DecentError | None) -> None:
        """One of ``req``'s parts ended; its completion once all have."""
        if err is not None and req.error is None:
            req.error = err
        req.left -= 1
        if req.left:
            return
        completion = pb.Completion(request_id=req.request_id,
                                   view_epoch=self.services.members.epoch)
        if req.error is not None:
            completion.error.CopyFrom(req.error.to_pb())
        else:
            first = req.parts[0]
            completion.out_nbytes = sum(p.nbytes for p in req.parts)
            completion.out_meta.dtype = first.dtype
            completion.out_meta.shape.extend(first.shape)
            completion.src_ranks.extend(req.covered)
        for p in req.parts:  # the worker's memory is not ours to hold any more
            p.release()
        req.session.complete(completion)

    def requests_of(self, session: Worker) -> int:
        """The node-level requests of ``session`` not completed yet (gathering or running)."""
        gathers = [*self.gathers.values(), *(g for gs in self.running.values() for g in gs)]
        return len({id(m) for g in gathers for m, _ in g.members.values()
                    if m.session is session})

    # ------------------------------------------------------------------ workers leaving

    def joined(self, session: Worker) -> None:
        """A worker registered: its local rank takes part again."""
        left = self.departed.get(session.job)
        if left is not None:
            left.pop(session.local_rank, None)

    def fail_session(self, session: Worker) -> list[asyncio.Task[None]]:
        """A local worker left: every gather of its job not yet run fails (it can never
        complete), and so do later ones until a worker takes its local rank again; the
        tasks of node-level ops that read its memory, to wait for."""
        self.departed.setdefault(session.job, {})[session.local_rank] = session.rank
        err = DecentError(pb.ABORTED, f"rank {session.rank} left before the node's workers "
                                      "all submitted it")
        for g in list(self.gathers.values()):
            if any(m.session.job == session.job for m, _ in g.members.values()):
                self._fail(g, err)
        return [ctx.task for ctx, gathers in self.running.items() if ctx.task is not None and
                any(m.session is session for g in gathers for m, _ in g.members.values())]

    def shutdown(self, reason: str) -> None:
        """Every gather not yet run fails with SHUTTING_DOWN."""
        err = DecentError(pb.SHUTTING_DOWN, f"daemon rank {self.services.machine} is shutting "
                                            f"down ({reason})")
        for g in list(self.gathers.values()):
            self._fail(g, err)


def _args(args: Any) -> str:
    """A short form of an op's arguments for messages."""
    text = str(args).replace("\n", " ").strip()
    return text or "no arguments"
