"""PyTorch client of decent.

    import decent.torch as dt
    client = dt.connect()                      # $DECENT_DAEMON, else the default socket
    h = client.neighbor_allreduce_async(t)     # returns at once
    t_avg = h.wait()                           # same shape, dtype and device as t

``import decent.torch`` also makes ``"decent"`` a torch.distributed backend
(``dist.init_process_group("decent")``, :mod:`decent.torch.distributed`).

Module-level shortcuts (``dt.init()``, ``dt.neighbor_allreduce_async(t)``, ...) use one default
client per process. A script written for Horovod's torch API runs with ``import decent.torch as
hvd`` (``DistributedOptimizer``, ``Compression``, ``allreduce(average=..., op=hvd.Sum)``,
``synchronize``, ``broadcast_parameters(..., root_rank=0)``, ...).
"""

from __future__ import annotations

from typing import Any

import torch

from decent.core import Client, DecentError, Handle
from decent.core.surface.default_client import SHORTCUTS
from decent.core.training.algorithms import ALGORITHMS, AlgorithmError
from decent.torch import topology_util
from decent.torch.bluefog import (
    CommunicationType,
    DistributedAdaptThenCombineOptimizer,
    DistributedAdaptWithCombineOptimizer,
    DistributedNeighborAllreduceOptimizer,
    is_homogeneous,
    neighbor_allreduce_nonblocking,
    resume,
    suspend,
    wait,
    win_update_then_collect,
)
from decent.torch.broadcasts import broadcast_optimizer_state, broadcast_parameters
from decent.torch.client import TorchClient, connect, default_client
from decent.torch.distributed import register as register_backend
from decent.torch.flat import flatten_parameters
from decent.torch.horovod import (
    Adasum,
    Average,
    Compression,
    DistributedOptimizer,
    Sum,
    cross_rank,
    cross_size,
    is_initialized,
    mpi_threads_supported,
    nccl_built,
    poll,
    synchronize,
)
from decent.torch.optim import DecentralizedOptimizer, consensus

# BlueFog's graph builders, also at module level (bf.ExponentialTwoGraph(bf.size()))
globals().update({name: getattr(topology_util, name) for name in topology_util.__all__})
# the module-level shortcuts: the default client's, from the op table (every op's methods) and
# the client's queries (decent.core.surface.default_client)
globals().update(default_client.shortcuts())
# torch.distributed's "decent" backend (decent.torch.distributed)
register_backend()


def device() -> torch.device:
    """The default client's device (``cuda:LOCAL_RANK`` where CUDA is present, else the CPU)."""
    return default_client.get().device


def __getattr__(name: str) -> Any:
    """Only for names that do not exist (the shortcuts above are set when the module loads)."""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ALGORITHMS", "Adasum", "AlgorithmError", "Average", "Client", "Compression",
           "DecentError", "DecentralizedOptimizer", "DistributedOptimizer", "Handle", "Sum",
           "TorchClient", "broadcast_optimizer_state", "broadcast_parameters", "connect",
           "consensus", "cross_rank", "cross_size", "device", "flatten_parameters",
           "is_initialized", "mpi_threads_supported", "nccl_built", "poll", "synchronize",
           "CommunicationType", "DistributedAdaptThenCombineOptimizer",
           "DistributedAdaptWithCombineOptimizer", "DistributedNeighborAllreduceOptimizer",
           "is_homogeneous", "neighbor_allreduce_nonblocking", "resume", "suspend",
           "topology_util", "wait", "win_update_then_collect", *topology_util.__all__,
           *SHORTCUTS]
