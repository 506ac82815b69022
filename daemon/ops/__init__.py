"""The ops the daemon runs for its workers, by ``OpType``.

Each op is an :class:`~decentd.ops.api.OpSpec` whose ``run`` gets an
:class:`~decentd.ops.api.OpContext`: the request's tensors and arguments and the daemon's
services, nothing else. :mod:`~decentd.ops.neighbor` averages with neighbors,
:mod:`~decentd.ops.collectives` runs allreduce, broadcast and barrier over every rank,
:mod:`~decentd.ops.exchange` sends chosen rows to chosen ranks (alltoall, sendrecv), and
:mod:`~decentd.ops.window_ops` the one-sided window ops.
"""

from __future__ import annotations

from decentd.ops.api import OpSpec
from decentd.ops.collectives import COLLECTIVE_OPS
from decentd.ops.exchange import EXCHANGE_OPS
from decentd.ops.neighbor import NEIGHBOR_OPS
from decentd.ops.window_ops import WINDOW_OPS

#: every op a worker may submit
OPS: dict[int, OpSpec] = {**NEIGHBOR_OPS, **COLLECTIVE_OPS, **EXCHANGE_OPS, **WINDOW_OPS}

__all__ = ["OPS"]
