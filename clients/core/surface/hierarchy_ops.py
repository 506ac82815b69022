"""Hierarchical neighbor averaging (BlueFog's ``hierarchical_neighbor_allreduce``): part of
:class:`decent.core.Client`'s op surface.

Every worker of machine ``I`` gets ``self_weight * mean_I + sum_J src_machine_weights[J] *
mean_J``, where ``mean_J`` is the average of the tensor over machine ``J``'s workers. The
daemon averages its workers' tensors in shared memory and sends one copy per neighbor machine,
whatever its worker count. Every worker of every machine calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from decent.core.requests.calls import OpCall
from decent.core.requests.handles import Handle
from decent.core.surface.args import WeightsArg, op_args, rank_weights
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")


class HierarchicalOps(Generic[T]):
    """Hierarchical averaging over the client's ``_call`` (see :class:`decent.core.Client`)."""

    def _call(self, call: OpCall, tensor: T | None, name: str | None, timeout: float | None,
              **options: Any) -> Handle[T]:
        raise NotImplementedError

    def hierarchical_neighbor_allreduce_async(
        self, tensor: T, name: str | None = None, self_weight: float | None = None,
        src_machine_weights: Mapping[int, float] | None = None,
        dst_machine_weights: WeightsArg = None, timeout: float | None = None,
    ) -> Handle[T]:
        """Start ``self_weight * mean_I + sum_J src_machine_weights[J] * mean_J`` over the
        machines (keys: machine ranks); returns at once. No weights: the machine topology's.
        ``dst_machine_weights`` makes the call dynamic, as ``dst_weights`` does for
        ``neighbor_allreduce``."""
        return self._hierarchical(tensor, None, name, self_weight, src_machine_weights,
                                  dst_machine_weights, timeout)

    def hierarchical_neighbor_allreduce(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`hierarchical_neighbor_allreduce_async`."""
        return self.hierarchical_neighbor_allreduce_async(tensor, **kwargs).wait()

    def hierarchical_neighbor_allreduce_async_(
        self, tensor: T, name: str | None = None, self_weight: float | None = None,
        src_machine_weights: Mapping[int, float] | None = None,
        dst_machine_weights: WeightsArg = None, timeout: float | None = None,
    ) -> Handle[T]:
        """In-place :meth:`hierarchical_neighbor_allreduce_async` (``wait()`` writes the
        result into ``tensor``)."""
        return self._hierarchical(tensor, tensor, name, self_weight, src_machine_weights,
                                  dst_machine_weights, timeout)

    def hierarchical_neighbor_allreduce_(self, tensor: T, **kwargs: Any) -> T:
        """Blocking in-place :meth:`hierarchical_neighbor_allreduce_async`."""
        return self.hierarchical_neighbor_allreduce_async_(tensor, **kwargs).wait()

    def _hierarchical(self, tensor: T, into: T | None, name: str | None,
                      self_weight: float | None, src: WeightsArg, dst: WeightsArg,
                      timeout: float | None) -> Handle[T]:
        args = op_args(name, pb.HierarchicalNeighborAllreduce, self_weight=self_weight,
                       src_machine_weights=rank_weights(src),
                       dst_machine_weights=rank_weights(dst))
        return self._call(OpCall("hierarchical_neighbor_allreduce", args), tensor, name,
                          timeout, into=into, fuse=True)
