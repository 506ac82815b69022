"""PyTorch client of decent.

    import decent.torch as dt
    client = dt.connect()                      # $DECENT_DAEMON, else the default socket
    h = client.neighbor_allreduce_async(t)     # returns at once
    t_avg = h.wait()                           # same shape, dtype and device as t

Module-level shortcuts (``dt.init()``, ``dt.neighbor_allreduce_async(t)``, ...) use one default
client per process.
"""

from __future__ import annotations

from decent.core import Client, DecentError, Handle
from decent.core.algorithms import ALGORITHMS, AlgorithmError
from decent.core.shortcuts import SHORTCUTS
from decent.torch.client import TorchClient, connect, default_client
from decent.torch.flat import flatten_parameters
from decent.torch.optim import (
    DecentralizedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    consensus,
)

# the module-level shortcuts: the default client's methods (decent.core.shortcuts)
_default = default_client
init = _default.init
shutdown = _default.shutdown
rank = _default.rank
size = _default.size
neighbor_allreduce_async = _default.neighbor_allreduce_async
neighbor_allreduce = _default.neighbor_allreduce
neighbor_allreduce_async_ = _default.neighbor_allreduce_async_
neighbor_allreduce_ = _default.neighbor_allreduce_
compressed_neighbor_allreduce_async = _default.compressed_neighbor_allreduce_async
compressed_neighbor_allreduce = _default.compressed_neighbor_allreduce
neighbor_allgather_async = _default.neighbor_allgather_async
neighbor_allgather = _default.neighbor_allgather
allreduce_async = _default.allreduce_async
allreduce = _default.allreduce
allreduce_async_ = _default.allreduce_async_
allreduce_ = _default.allreduce_
broadcast_async = _default.broadcast_async
broadcast = _default.broadcast
broadcast_async_ = _default.broadcast_async_
broadcast_ = _default.broadcast_
barrier = _default.barrier
flush = _default.flush
in_neighbors = _default.in_neighbors
out_neighbors = _default.out_neighbors
win_create = _default.win_create
win_put_async = _default.win_put_async
win_put = _default.win_put
win_accumulate_async = _default.win_accumulate_async
win_accumulate = _default.win_accumulate
win_get_async = _default.win_get_async
win_get = _default.win_get
win_update = _default.win_update
win_publish = _default.win_publish
win_free = _default.win_free
win_info = _default.win_info
win_versions = _default.win_versions
win_exchange_async = _default.win_exchange_async
win_exchange = _default.win_exchange
win_add = _default.win_add
group_allreduce_async = _default.group_allreduce_async
group_allreduce = _default.group_allreduce

__all__ = ["ALGORITHMS", "AlgorithmError", "Client", "DecentError", "DecentralizedOptimizer",
           "Handle", "TorchClient", "broadcast_optimizer_state", "broadcast_parameters",
           "connect", "consensus", "flatten_parameters", *SHORTCUTS]
