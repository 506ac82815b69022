"""PyTorch client of decent.

    import decent.torch as dt
    client = dt.connect()                      # $DECENT_DAEMON, else the default socket
    h = client.neighbor_allreduce_async(t)     # returns at once
    t_avg = h.wait()                           # same shape, dtype and device as t

Module-level shortcuts (``dt.init()``, ``dt.neighbor_allreduce_async(t)``, ...) use one default
client per process. A script written for Horovod's torch API runs with ``import decent.torch as
hvd`` (``DistributedOptimizer``, ``Compression``, ``allreduce(average=..., op=hvd.Sum)``,
``synchronize``, ``broadcast_parameters(..., root_rank=0)``, ...).
"""

from __future__ import annotations

from decent.core import Client, DecentError, Handle
from decent.core.surface.default_client import SHORTCUTS
from decent.core.training.algorithms import ALGORITHMS, AlgorithmError
from decent.torch.client import TorchClient, connect, default_client
from decent.torch.flat import flatten_parameters
from decent.torch.horovod import (
    Adasum,
    Average,
    Compression,
    DistributedOptimizer,
    Sum,
    poll,
    synchronize,
)
from decent.torch.optim import (
    DecentralizedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    consensus,
)

# the module-level shortcuts: the default client's methods (decent.core.surface.default_client)
_default = default_client
init = _default.init
shutdown = _default.shutdown
rank = _default.rank
size = _default.size
local_rank = _default.local_rank
local_size = _default.local_size
allgather_async = _default.allgather_async
allgather = _default.allgather
set_topology = _default.set_topology
load_topology = _default.load_topology
is_topo_weighted = _default.is_topo_weighted
in_neighbor_ranks = _default.in_neighbor_ranks
out_neighbor_ranks = _default.out_neighbor_ranks
InferDestinationFromSourceRanks = _default.InferDestinationFromSourceRanks
InferSourceFromDestinationRanks = _default.InferSourceFromDestinationRanks
window_names = _default.window_names
win_associated_p = _default.win_associated_p
win_mutex = _default.win_mutex
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
machine_rank = _default.machine_rank
machine_size = _default.machine_size
hierarchical_neighbor_allreduce_async = _default.hierarchical_neighbor_allreduce_async
hierarchical_neighbor_allreduce = _default.hierarchical_neighbor_allreduce
hierarchical_neighbor_allreduce_async_ = _default.hierarchical_neighbor_allreduce_async_
hierarchical_neighbor_allreduce_ = _default.hierarchical_neighbor_allreduce_

__all__ = ["ALGORITHMS", "Adasum", "AlgorithmError", "Average", "Client", "Compression",
           "DecentError", "DecentralizedOptimizer", "DistributedOptimizer", "Handle", "Sum",
           "TorchClient", "broadcast_optimizer_state", "broadcast_parameters", "connect",
           "consensus", "flatten_parameters", "poll", "synchronize", *SHORTCUTS]
