"""The gradients of the collectives, written once for every framework.

Each blocking out-of-place collective is a linear map of the inputs of all ranks, so its gradient
is the adjoint map applied to the incoming gradients of all ranks, itself a collective:

- ``allreduce`` (sum or average; ``y = post * reduce(pre * x)``): the same allreduce of the
  gradients, with the scale factors swapped;
- ``broadcast`` from ``root``: the sum of every rank's gradient, delivered to the root (the other
  ranks' inputs did not reach any output: zero);
- ``allgather``: the sum of every rank's gradient of the whole result, of which each rank keeps
  its own rows;
- (the module functions, Horovod's API, average instead of summing for these two, as Horovod
  does: :data:`GRADIENT_RULE`);
- ``neighbor_allreduce`` with ``y_i = s_i x_i + sum_j w_ij d_ji x_j``: the same op with send and
  receive swapped (W transposed): rank i sends its gradient to its in-neighbors ``j`` scaled by
  ``w_ij`` (a destination weight), and receives from its out-neighbors with the weights ``d`` it
  sent them with.

A framework adapter runs the forward op and, on the backward pass, :attr:`Adjoint.op` with
:attr:`Adjoint.kwargs` on the incoming gradient through its own non-differentiable blocking op,
then :meth:`Adjoint.keep` (``decent.torch``: an ``autograd.Function``; ``decent.tf``:
``tf.custom_gradient``). Backward ops are named after the forward's name plus ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

#: how the gradients of ``broadcast`` and ``allgather`` combine the ranks' gradients: summed
#: (``torch.distributed.nn``'s rule: the adjoint map, a client's methods) or averaged
#: (Horovod's rule: the module functions, ``hvd.broadcast``/``hvd.allgather``)
GRADIENT_RULE: ContextVar[str] = ContextVar("decent_gradient_rule", default="sum")


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Adjoint:
    """The backward pass of one collective call."""

    op: str  #: the blocking op that maps the incoming gradient: ``allreduce``, ...
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: what of that op's result is this rank's gradient
    keep: Callable[[Any], Any] = _identity


def grad_name(kwargs: Mapping[str, Any]) -> str | None:
    """The backward op's name (None for an unnamed forward: the op's unnamed sequence)."""
    name = kwargs.get("name")
    return f"{name}.grad" if name else None


def _common(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": grad_name(kwargs), "timeout": kwargs.get("timeout")}


def allreduce(kwargs: Mapping[str, Any]) -> Adjoint:
    """``allreduce(x, op, average, compression, prescale_factor, postscale_factor)``."""
    back = _common(kwargs)
    for key in ("op", "average", "compression"):
        if key in kwargs:
            back[key] = kwargs[key]
    back["prescale_factor"] = kwargs.get("postscale_factor", 1.0)
    back["postscale_factor"] = kwargs.get("prescale_factor", 1.0)
    return Adjoint("allreduce", back)


def broadcast(rank: int, root: int, kwargs: Mapping[str, Any]) -> Adjoint:
    """``broadcast(x, root)``: the sum of the gradients on the root (their average under
    Horovod's rule, :data:`GRADIENT_RULE`), zero elsewhere."""
    back = {**_common(kwargs), "op": GRADIENT_RULE.get()}
    return Adjoint("allreduce", back, _identity if rank == root else _zero)


def _zero(value: Any) -> Any:
    return value * 0


def own_rows(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    """(start, end) of ``rank``'s rows in an allgather where rank r gave ``sizes[r]`` rows."""
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def allgather(start: Any, end: Any, kwargs: Mapping[str, Any]) -> Adjoint:
    """``allgather(x)`` whose result holds this rank's rows at ``start:end`` (ints, or a
    framework's scalars when they are known only as the graph runs): those rows of the summed
    gradient (averaged under Horovod's rule, :data:`GRADIENT_RULE`)."""
    return Adjoint("allreduce", {**_common(kwargs), "op": GRADIENT_RULE.get()},
                   lambda full: full[start:end])


def neighbor_allreduce(self_weight: float, src_weights: Mapping[int, float],
                       dst_weights: Mapping[int, float], kwargs: Mapping[str, Any]) -> Adjoint:
    """The forward's plan (its self weight, the weights it received with, the ranks it sent to
    with their destination weights): the same op on the gradient with W transposed."""
    back = {**_common(kwargs), "self_weight": self_weight,
            "src_weights": {int(d): float(w) for d, w in dst_weights.items()},
            "dst_weights": {int(j): float(w) for j, w in src_weights.items()}}
    return Adjoint("neighbor_allreduce", back)


def neighbor_plan(client: Any, kwargs: Mapping[str, Any]
                  ) -> tuple[float, dict[int, float], dict[int, float]]:
    """(self weight, source weights, destination weights) of a ``neighbor_allreduce`` call:
    its own weights, or the topology's at the name's next round."""
    src = kwargs.get("src_weights")
    if src is not None and kwargs.get("self_weight") is not None:
        dst = kwargs.get("dst_weights")
        if dst is None:
            dst_map = {int(d): 1.0 for d in client.out_neighbors(kwargs.get("name"))}
        elif isinstance(dst, Mapping):
            dst_map = {int(d): float(w) for d, w in dst.items()}
        else:
            dst_map = {int(d): 1.0 for d in dst}
        return float(kwargs["self_weight"]), {int(j): float(w) for j, w in src.items()}, dst_map
    info = client.topology_at(kwargs.get("name") or "neighbor_allreduce.unnamed")
    return (float(info.self_weight), {int(j): float(w) for j, w in info.src_weights.items()},
            {int(d): 1.0 for d in info.out_neighbors})


def of(op: str, client: Any, kwargs: Mapping[str, Any]) -> Adjoint:
    """The backward pass of a blocking ``op`` (``allreduce``, ``broadcast`` or
    ``neighbor_allreduce``) called with ``kwargs`` on ``client`` (allgather's needs every
    rank's row count, which only its adapter can ask for)."""
    if op == "allreduce":
        return allreduce(kwargs)
    if op == "broadcast":
        root = kwargs.get("root_rank")
        return broadcast(client.rank, int(kwargs.get("root", 0) if root is None else root),
                         kwargs)
    if op == "neighbor_allreduce":
        return neighbor_allreduce(*neighbor_plan(client, kwargs), kwargs)
    raise ValueError(f"{op} has no adjoint here")
