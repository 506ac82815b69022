"""What BlueFog's torch programs call, for ``import decent.torch as bf``, beyond decent's own
names (:mod:`decent.core.surface.compat` lists the aliases): BlueFog's optimizer wrappers,
its communication types, ``neighbor_allreduce_nonblocking`` and ``wait``,
``win_update_then_collect``, and its process queries. The graph builders are
:mod:`decent.torch.topology_util` (also at ``bf.`` level).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import torch

from decent.core.requests.handles import Handle
from decent.core.surface.args import WeightsArg
from decent.torch.client import default_client
from decent.torch.optim import DecentralizedOptimizer, check_step_topology


class CommunicationType(enum.Enum):
    """BlueFog's ``CommunicationType``: how its optimizers combine."""

    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


def _optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None,
               communication_type: CommunicationType, num_steps_per_communication: int,
               combine: str) -> DecentralizedOptimizer:
    """A BlueFog wrapper as a :class:`DecentralizedOptimizer` (``combine``: dsgd for
    adapt-then-combine, dsgd-cta for adapt-with-combine)."""
    interval: dict[str, Any] = {"communication_interval": int(num_steps_per_communication)}
    if communication_type is CommunicationType.allreduce:
        return DecentralizedOptimizer(optimizer, model, "allreduce", **interval)
    if communication_type is CommunicationType.hierarchical_neighbor_allreduce:
        return DecentralizedOptimizer(optimizer, model, combine, hierarchical=True, **interval)
    if communication_type is CommunicationType.empty:  # local steps only: never combines
        return DecentralizedOptimizer(optimizer, model, combine,
                                      communication_interval=1 << 62)
    return DecentralizedOptimizer(optimizer, model, combine, **interval)


def DistributedAdaptThenCombineOptimizer(
        optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
        communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
        num_steps_per_communication: int = 1) -> DecentralizedOptimizer:
    """BlueFog's ATC wrapper: the local step, then the neighbor average of the parameters
    (``x_i' = sum_j w_ij (x_j - lr g_j)``: decent's ``dsgd``)."""
    return _optimizer(optimizer, model, communication_type, num_steps_per_communication,
                      "dsgd")


def DistributedAdaptWithCombineOptimizer(
        optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
        communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
        num_steps_per_communication: int = 1) -> DecentralizedOptimizer:
    """BlueFog's AWC wrapper: the parameters' average runs beside forward and backward
    (``x_i' = sum_j w_ij x_j - lr g_i(x_i)``: decent's ``dsgd-cta``)."""
    return _optimizer(optimizer, model, communication_type, num_steps_per_communication,
                      "dsgd-cta")


def DistributedNeighborAllreduceOptimizer(
        optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
        num_steps_per_communication: int = 1) -> DecentralizedOptimizer:
    """BlueFog's older name of the neighbor-averaging wrapper (adapt-with-combine, its
    parameters averaged beside forward and backward)."""
    return DistributedAdaptWithCombineOptimizer(optimizer, model,
                                                num_steps_per_communication=
                                                num_steps_per_communication)


def neighbor_allreduce_nonblocking(
        tensor: torch.Tensor, self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None, dst_weights: WeightsArg = None,
        enable_topo_check: bool = False, name: str | None = None) -> Handle[torch.Tensor]:
    """BlueFog's ``neighbor_allreduce_nonblocking``: decent's ``neighbor_allreduce_async``.
    ``enable_topo_check`` (with both weights given): first check, collectively, that every
    rank's sources are exactly the ranks that name it as a destination."""
    client = default_client.get()
    if enable_topo_check and src_weights is not None and dst_weights is not None:
        check_step_topology(client, src_weights, dst_weights)
    return client.neighbor_allreduce_async(tensor, name=name, self_weight=self_weight,
                                           src_weights=src_weights, dst_weights=dst_weights)


def wait(handle: Handle[Any]) -> Any:
    """BlueFog's ``bf.wait(handle)``: the op's result."""
    return handle.wait()


def win_update_then_collect(name: str, require_mutex: bool = True) -> torch.Tensor:
    """BlueFog's ``win_update_then_collect``: the own tensor plus everything accumulated into
    the window's buffers (weights 1), and the buffers zeroed."""
    client = default_client.get()
    ones = {int(r): 1.0 for r in client.in_neighbors()}
    result: torch.Tensor = client.win_update(name, self_weight=1.0, neighbor_weights=ones,
                                             reset=True, require_mutex=require_mutex)
    return result


def is_homogeneous() -> bool:
    """BlueFog's ``is_homogeneous()``: whether every node runs the same number of workers
    (always, in decent: ``workers_per_node`` is one number for the job)."""
    return default_client.get().size % default_client.get().local_size == 0


def suspend() -> bool:
    """BlueFog's ``suspend()`` (for interactive sessions): the worker sends what it has
    queued; decent has no worker-side thread to stop, and the daemon keeps serving the
    peers (windows stay readable). True."""
    default_client.get().flush()
    return True


def resume() -> bool:
    """BlueFog's ``resume()``: True (see :func:`suspend`)."""
    default_client.get()
    return True
