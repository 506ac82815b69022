"""What one call of an op asks of the daemon (:class:`OpCall`), before it becomes a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decent_wire.ops import BY_NAME, OpDecl
from decent_wire.v1 import decent_pb2 as pb


@dataclass(frozen=True)
class OpCall:
    """One call of an op: its entry of the op table and its typed arguments."""

    op: OpDecl  #: what the op is (``decent_wire.ops``)
    args: Any  #: ``pb.NeighborAllreduce(...)``, ``pb.Broadcast(root=0)``, ...
    #: the op never reads the input (it is not copied in; the daemon is told so)
    blank_input: bool = False
    #: in place, the result is the input unchanged (it is not copied out)
    result_is_input: bool = False

    @property
    def field(self) -> str:
        """The op's field of ``SubmitRequest.op``."""
        return self.op.name


def op_call(name: str, args: Any) -> OpCall:
    """A call of op ``name`` with ``args``."""
    return OpCall(BY_NAME[name], args)


def neighbor_call(args: pb.NeighborAllreduce, self_weight: float | None,
                  srcs: dict[int, float] | None, dsts: dict[int, float] | None) -> OpCall:
    """A neighbor_allreduce call, with the copies its weights make needless: a receive-only
    call never reads its tensor; one keeping its own tensor whole and adding nothing returns
    it unchanged."""
    receives_only = self_weight == 0.0 and dsts == {}
    adds_nothing = self_weight == 1.0 and srcs is not None and not any(srcs.values())
    return OpCall(BY_NAME["neighbor_allreduce"], args, blank_input=receives_only,
                  result_is_input=adds_nothing)
