"""The op table: what each op is, declared once for the daemon and the clients.

One :class:`OpDecl` per op gives its name (the field of ``SubmitRequest.op`` and the stem of
the client's methods), its ``OpType``, its request message, the size of its result, the forms
the client offers (asynchronous, blocking, in place), and whether it fuses, streams its input,
is agreed first, runs node-level or is differentiable. The daemon derives its op traits from
this table, the client generates its methods from it (``scripts/gen_surface.py``), and the
module shortcuts of ``decent.torch`` and ``decent.tf`` are exported from it.

Not every value of ``OpType`` is a user op: :attr:`Kind.CONTROL` requests ride the op field
without moving tensors (``set_topology``), :attr:`Kind.NOTE` is a note on another request
(``fill``), and :attr:`Kind.PEER` kinds travel only between daemons (window replies, WAGMA's
trigger and result, a collective's agreement). The wire keeps them in one enum and one oneof;
this table says which is which.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from decent_wire import dtypes
from decent_wire.v1 import decent_pb2 as pb


class Kind(enum.Enum):
    """What an ``OpType`` is."""

    USER = "user"  #: an op a worker submits on behalf of its user
    CONTROL = "control"  #: a worker's request that moves no tensor
    NOTE = "note"  #: a note on another request
    PEER = "peer"  #: sent between daemons only


class Result(enum.Enum):
    """The size of an op's result, from its input (see :func:`result_nbytes`)."""

    SAME = "same"  #: the input's dtype and shape
    PAIR = "pair"  #: ``[2, *shape]``: the mix and this rank's own compressed tensor
    STACKED = "stacked"  #: one input per source, stacked (or their rows concatenated)
    GATHERED = "gathered"  #: every rank's rows, concatenated (first dims may differ)
    EXCHANGED = "exchanged"  #: the rows received (alltoall: ``recv_rows``, or one piece reduced)
    NONE = "none"  #: no tensor comes back


class Agreed(enum.Enum):
    """Who agrees on a collective before any data moves (``decentd.ops.agreement``)."""

    NO = "no"
    WORKERS = "workers"  #: the workers themselves (a worker-level collective)
    NODES = "nodes"  #: the daemons, for their workers (a node-level collective)


class Returns(enum.Enum):
    """What the blocking form returns."""

    RESULT = "result"  #: the result tensor
    NOTHING = "nothing"  #: None (the op only has to finish)
    TRUE = "true"  #: True (BlueFog's ``win_create``)


@dataclass(frozen=True)
class Forms:
    """The methods the client offers for an op, by suffix: ``_async``, blocking, and the
    in-place pair (``_async_``, ``_``). An op with none is reached only through a composite
    method (``win_free``, ``win_mutex``, ``set_topology``)."""

    asynchronous: bool = True
    blocking: bool = True
    in_place: bool = False

    def method_names(self, name: str) -> list[str]:
        """The client's method names of op ``name``."""
        names = []
        if self.asynchronous:
            names.append(f"{name}_async")
        if self.blocking:
            names.append(name)
        if self.in_place:
            names += [f"{name}_async_", f"{name}_"]
        return names


NO_FORMS = Forms(asynchronous=False, blocking=False)
BLOCKING_ONLY = Forms(asynchronous=False)
ALL_FORMS = Forms(in_place=True)


@dataclass(frozen=True)
class OpDecl:
    """One op, as the daemon and the clients both see it."""

    name: str  #: the field of ``SubmitRequest.op``, and the stem of the client's methods
    op_type: int  #: its ``pb.OpType``
    request: Any  #: its request message class (``pb.NeighborAllreduce``), None for PEER kinds
    summary: str  #: one line for docs and generated docstrings
    kind: Kind = Kind.USER
    result: Result = Result.SAME
    forms: Forms = Forms()
    returns: Returns = Returns.RESULT
    #: several tensors may travel as one request (each still matched on its own)
    fuses: bool = False
    #: a large private input is sent while its worker still copies it in, and an in-place
    #: result is copied out while it arrives (``SubmitRequest.filling``/``draining``)
    streams: bool = False
    agreed: Agreed = Agreed.NO
    #: the daemon runs it once for all its workers (hierarchical)
    node_level: bool = False
    #: the blocking out-of-place form of a tensor that requires grad is differentiable
    differentiable: bool = False

    @property
    def methods(self) -> list[str]:
        """The client's method names for this op."""
        return self.forms.method_names(self.name)


def _user(name: str, request: Any, summary: str, **traits: Any) -> OpDecl:
    return OpDecl(name, pb.OpType.Value(name.upper()), request, summary, **traits)


def _peer(op_type: int, summary: str, fuses: bool = False) -> OpDecl:
    return OpDecl(str(pb.OpType.Name(op_type)).lower(), op_type, None, summary, Kind.PEER,
                  Result.NONE, NO_FORMS, Returns.NOTHING, fuses=fuses)


#: every op, user ops first in the order the client surface lists them
OPS: tuple[OpDecl, ...] = (
    _user("neighbor_allreduce", pb.NeighborAllreduce,
          "Weighted average with this step's in-neighbors.", forms=ALL_FORMS, fuses=True,
          streams=True, differentiable=True),
    _user("compressed_neighbor_allreduce", pb.CompressedNeighborAllreduce,
          "Neighbor averaging of the compressed tensor (CHOCO-SGD's gossip).",
          result=Result.PAIR),
    _user("neighbor_allgather", pb.NeighborAllgather,
          "The in-neighbors' tensors, stacked or concatenated.", result=Result.STACKED),
    _user("hierarchical_neighbor_allreduce", pb.HierarchicalNeighborAllreduce,
          "Neighbor averaging of the machines' means.", forms=ALL_FORMS, fuses=True,
          node_level=True),
    _user("allreduce", pb.Allreduce, "Average or sum over every rank.", forms=ALL_FORMS,
          fuses=True, agreed=Agreed.NODES, node_level=True, differentiable=True),
    _user("allgather", pb.Allgather, "Every rank's rows, concatenated in rank order.",
          result=Result.GATHERED, agreed=Agreed.WORKERS, differentiable=True),
    _user("broadcast", pb.Broadcast, "The root's tensor on every rank.", forms=ALL_FORMS,
          fuses=True, agreed=Agreed.NODES, node_level=True, differentiable=True),
    _user("alltoall", pb.Alltoall, "Rows to and from every rank (scatter, gather, "
          "reduce_scatter, all_to_all).", result=Result.EXCHANGED, agreed=Agreed.WORKERS),
    _user("sendrecv", pb.Alltoall, "Rows to and from one or two ranks (send and recv).",
          result=Result.EXCHANGED, forms=NO_FORMS),
    _user("barrier", pb.Barrier, "Returns when every rank has reached it.",
          result=Result.NONE, forms=BLOCKING_ONLY, returns=Returns.NOTHING,
          agreed=Agreed.NODES, node_level=True),
    _user("win_create", pb.WinCreate, "Create a window holding the tensor.",
          result=Result.NONE, forms=BLOCKING_ONLY, returns=Returns.TRUE),
    _user("win_put", pb.WinWrite, "Write the tensor into the destinations' buffers."),
    _user("win_accumulate", pb.WinWrite, "Add the tensor to the destinations' buffers."),
    _user("win_get", pb.WinGet, "Fetch the sources' own copies into this rank's buffers.",
          result=Result.NONE, returns=Returns.NOTHING),
    _user("win_update", pb.WinUpdate, "Combine the window's own copy and its buffers.",
          forms=BLOCKING_ONLY),
    _user("win_publish", pb.WinPublish, "Make the tensor the window's own copy.",
          result=Result.NONE, forms=BLOCKING_ONLY, returns=Returns.NOTHING),
    _user("win_free", pb.WinFree, "Free a window.", result=Result.NONE, forms=NO_FORMS,
          returns=Returns.NOTHING),
    _user("win_exchange", pb.WinExchange, "Average with one peer's own copy, atomically."),
    _user("win_add", pb.WinAdd, "Add to the window's own copy, atomically.",
          forms=BLOCKING_ONLY),
    _user("group_allreduce", pb.GroupAllreduce, "Wait-avoiding group average (WAGMA)."),
    _user("win_lock", pb.WinLock, "Take window mutex slots.", result=Result.NONE,
          forms=NO_FORMS, returns=Returns.NOTHING),
    _user("win_unlock", pb.WinLock, "Release window mutex slots.", result=Result.NONE,
          forms=NO_FORMS, returns=Returns.NOTHING),
    OpDecl("set_topology", pb.SET_TOPOLOGY, pb.SetTopology,
           "This job's topology for the ops submitted after it.", Kind.CONTROL, Result.NONE,
           NO_FORMS, Returns.TRUE),
    OpDecl("fill", pb.OP_UNSPECIFIED, pb.Fill, "How much of a filling request's tensor is in.",
           Kind.NOTE, Result.NONE, NO_FORMS, Returns.NOTHING),
    _peer(pb.WIN_REPLY, "The answer to a window request."),
    _peer(pb.GROUP_TRIGGER, "A WAGMA group member arrived (to the leader)."),
    _peer(pb.GROUP_RESULT, "A WAGMA group's sum (from the leader)."),
    _peer(pb.AGREEMENT, "What a collective's participant was asked to run.", fuses=True),
)

#: the ops by name and by ``OpType`` (the note has no OpType of its own)
BY_NAME: dict[str, OpDecl] = {d.name: d for d in OPS}
BY_TYPE: dict[int, OpDecl] = {d.op_type: d for d in OPS if d.kind is not Kind.NOTE}
#: the ops users call
USER_OPS: tuple[OpDecl, ...] = tuple(d for d in OPS if d.kind is Kind.USER)
#: the ``OpType`` of each field of ``SubmitRequest.op`` that names an op or a control request
OP_OF_FIELD: dict[str, int] = {d.name: d.op_type for d in OPS
                               if d.kind in (Kind.USER, Kind.CONTROL)}


def op_types(**traits: Any) -> frozenset[int]:
    """The ``OpType`` of every op whose traits equal ``traits`` (``streams=True``, ...)."""
    return frozenset(d.op_type for d in OPS if d.kind is not Kind.NOTE
                     and all(getattr(d, k) == v for k, v in traits.items()))


def exchanged_rows(args: Any) -> int:
    """The rows an ``alltoall`` or ``sendrecv`` with ``args`` gives this rank: every piece
    received, or one piece when they are reduced."""
    recv = [int(r) for r in args.recv_rows]
    if args.HasField("reduce"):
        return max(recv, default=0)
    return sum(recv)


def result_nbytes(result: Result, dtype: int, shape: Sequence[int], sources: int = 1,
                  rows: Sequence[int] | None = None) -> int:
    """How many bytes an op's result takes, for an input of ``dtype`` and ``shape``:
    ``sources`` stacked inputs (:attr:`Result.STACKED`), or ``rows`` first-dimension rows in
    all (a concatenation: :attr:`Result.STACKED` with sizes, :attr:`Result.GATHERED`)."""
    if result is Result.NONE:
        return 0
    if rows is not None:
        return sum(int(r) for r in rows) * dtypes.nbytes(dtype, tuple(shape[1:]))
    nbytes = dtypes.nbytes(dtype, tuple(shape))
    if result is Result.PAIR:
        return 2 * nbytes
    if result is Result.STACKED:
        return sources * nbytes
    return nbytes
